"""Piecewise CUDA graphs for steps with prompt tokens (runner/piecewise_graphs.py): the token buckets and the
option's validation on CPU; on the GPU, that steps which replay the pieces give the eager steps' tokens, and
bucket-sized steps their bits."""

import pytest
import torch

from engine import Engine, SamplingParams
from runner.loop_driver import EagerLoops, run_loops
from runner.piecewise_graphs import token_buckets
from tests.test_engine_parity import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_token_buckets_end_at_the_cap():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 384, 512]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(200) == [16, 32, 64, 128, 200]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "512"])
def test_piecewise_graph_tokens_must_be_a_non_negative_integer(tiny_checkpoint, bad):
    with pytest.raises(ValueError, match="piecewise_graph_tokens"):
        Engine(tiny_checkpoint, device="cpu", piecewise_graph_tokens=bad, verbose=False)


def _generate(path, prompts, **options):
    """Greedy tokens, and how many steps replayed the pieces. Chunks of at most 40 tokens put prefill
    chunks and decode rows in the same steps."""
    with Engine(path, device="cuda", num_kv_blocks=512, max_num_batched_tokens=40, verbose=False,
                **options) as engine:
        piecewise, runs = engine.runner.piecewise, [0]
        if piecewise is not None:
            run = piecewise.run

            def counted(*args):
                runs[0] += 1
                return run(*args)

            piecewise.run = counted
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], runs[0]


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(dtype="float32"), dict(dtype="bfloat16"),
                                     dict(dtype="bfloat16", kv_sharing="last"),
                                     dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"),
                                     dict(dtype="bfloat16", async_scheduling=False)])
def test_piecewise_steps_give_the_eager_steps_tokens(tiny_checkpoint, options):
    prompts = PROMPTS + [" ".join(["loop"] * 30), "x" * 70]
    graphs, runs = _generate(tiny_checkpoint, prompts, attention="triton", **options)
    eager, none = _generate(tiny_checkpoint, prompts, attention="triton", enforce_eager=True, **options)
    assert runs > 0 and none == 0
    assert graphs == eager


@pytest.mark.gpu
def test_early_exit_engines_keep_steps_with_prompt_tokens_eager(tiny_checkpoint):
    """early:Q decides exits after each loop on the host, which a replayed chain cannot stop for."""
    with Engine(tiny_checkpoint, device="cuda", num_kv_blocks=64, exit_policy="early:0.5",
                verbose=False) as engine:
        assert engine.runner.piecewise is None and engine.runner.graphs is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_len, tokens", [(200, 32), (26, 27)])
def test_a_bucket_sized_step_is_bitwise_the_eager_step(tiny_checkpoint, dtype, prompt_len, tokens):
    """One decode row beside a prompt chunk, in a 32-token budget: 32 tokens fill a bucket (bitwise), 27 are
    padded to it (the projections then see another row count; the tokens must still agree)."""
    with Engine(tiny_checkpoint, device="cuda", dtype=dtype, attention="triton", num_kv_blocks=512,
                max_num_batched_tokens=32, async_scheduling=False, verbose=False) as engine:
        engine.add_request([5] * 9, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()  # the first request's prefill
        engine.add_request([11 + i % 50 for i in range(prompt_len)], GREEDY)
        batch = engine.scheduler.schedule()
        assert batch.num_tokens == tokens and sorted(batch.num_new_tokens) == [1, tokens - 1]
        runner, model = engine.runner, engine.model
        assert runner.piecewise.buckets == [16, 32]
        inputs = runner.prepare(batch)
        loops = range(engine.config.total_ut_steps)
        with torch.inference_mode():
            graph = runner.forward(inputs)
            graph = (graph.hidden.clone(), graph.gate_logits.clone())
            eager = run_loops(EagerLoops(model, engine.backend), model, inputs, loops)
        if tokens == 32:
            assert torch.equal(graph[0], eager.hidden) and torch.equal(graph[1], eager.gate_logits)
        assert torch.equal(model.compute_logits(graph[0][-1]).argmax(-1),
                           model.compute_logits(eager.hidden[-1]).argmax(-1))
