"""CUDA-only: depth batching with captured loop passes (runner/pass_graphs.py). Every decode pass replays its
bucket's graph, and a request's tokens are those of the eager depth-batched engine and of the lockstep
engine, under full depth and early:0.5 with mixed exits (fp32, the Triton backend), over kv_sharing="last"
and an fp8 cache, for Huginn; in deterministic mode bit for bit; chained passes and pipelined
self-speculation's passes too, also where its drafts pause.
The same code without the capture runs on CPU in tests/test_pass_graphs.py."""

import pytest

from engine import DEFAULT_MODEL, Engine
from runner.chain_graphs import SpeculativeChainGraphs
from runner.model_runner import ModelRunner
from tests.test_depth_batching import HUGINN, HUGINN_PROMPTS, PROMPTS, assert_same_completions, greedy

pytestmark = pytest.mark.gpu

# 5 rows: passes of 5 rows replay the 8-row bucket; 16 rows at most, so the capture stays small
FIVE_PROMPTS = PROMPTS + ["Once upon a time"]


def run(checkpoint, prompts, params, depth_batching: bool, enforce_eager: bool, **engine_args):
    """Completions on CUDA (fp32, Triton, chunked prefill of 16 tokens: prompt chunks share steps with
    decode passes), and the engine's LoopStats. Under depth batching with graphs, every decode pass is a
    replay."""
    engine_args = {"device": "cuda", "dtype": "float32", "attention": "triton", "max_num_seqs": 16,
                   "num_kv_blocks": 512, "max_num_batched_tokens": 16, "verbose": False, **engine_args}
    with Engine(checkpoint, depth_batching=depth_batching, enforce_eager=enforce_eager,
                **engine_args) as engine:
        assert engine.uses_cuda_graphs != enforce_eager
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.loop_stats
        if depth_batching:
            graphs = engine.runner.depth.graphs
            if enforce_eager:
                assert graphs is None
            else:
                # every loop pass is a replay, of a pass graph or (a chained pass) of a chain graph (a lone
                # row's token runs lockstep's one-row graphs)
                chains = [c.graphs for c in (engine.runner.chains, engine.runner.speculative_chains)
                          if c is not None and c.graphs is not None]
                chained = sum(c.replays for c in chains)
                assert graphs.captured and all(c.captured for c in chains)
                assert graphs.replays == graphs.passes and 0 < graphs.passes + chained <= stats.decode_passes
                if engine_args.get("passes_per_step", 1) > 1:
                    assert chained > 0
            assert not engine.runner.mid_tokens
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return [out.outputs[0] for out in outputs], stats


@pytest.mark.parametrize("policy", ["full", "early:0.5"])
@pytest.mark.parametrize("prompts", [PROMPTS * 2, FIVE_PROMPTS], ids=["8 rows", "5 rows"])
def test_replayed_passes_give_the_eager_depth_and_lockstep_tokens(tiny_checkpoint, policy, prompts):
    """early:0.5 on the random tiny gate in fp32 exits tokens after mixed loops, so passes hold rows at
    different loops, each reading its own slots through the captured per-row-slot decode kernel."""
    params = greedy(max_tokens=12, loop_trace=True)
    graphs, stats = run(tiny_checkpoint, prompts, params, True, False, loops=4, exit_policy=policy)
    eager, eager_stats = run(tiny_checkpoint, prompts, params, True, True, loops=4, exit_policy=policy)
    lockstep, _ = run(tiny_checkpoint, prompts, params, False, False, loops=4, exit_policy=policy)
    assert_same_completions(eager, graphs)
    assert_same_completions(lockstep, graphs)
    assert stats.decode_loops == eager_stats.decode_loops
    assert stats.decode_passes < stats.decode_loops  # rows at different loops shared passes
    if policy == "early:0.5":
        assert len({t.exit_loop for c in graphs for t in c.traces[1:]}) >= 2


@pytest.mark.parametrize("policy", ["full", "early:0.5"])
def test_replayed_chains_give_the_lockstep_tokens(tiny_checkpoint, policy):
    """Greedy rows without logprobs chain 8 passes a step (runner/pass_chains.py), each pass a replay fed
    from the device: the tokens are the eager chain's and lockstep's."""
    params = greedy(max_tokens=12, logprobs=None)
    graphs, stats = run(tiny_checkpoint, FIVE_PROMPTS, params, True, False, loops=4, exit_policy=policy,
                        passes_per_step=8)
    eager, eager_stats = run(tiny_checkpoint, FIVE_PROMPTS, params, True, True, loops=4, exit_policy=policy,
                             passes_per_step=8)
    lockstep, _ = run(tiny_checkpoint, FIVE_PROMPTS, params, False, False, loops=4, exit_policy=policy)
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager] == [c.token_ids for c in lockstep]
    assert stats.decode_loops == eager_stats.decode_loops


@pytest.mark.parametrize("engine_args", [dict(kv_sharing="last"), dict(kv_cache_dtype="fp8_e4m3")],
                         ids=["kv_sharing=last", "fp8"])
def test_replayed_passes_over_kv_options_give_the_eager_depth_tokens(tiny_checkpoint, engine_args):
    params = greedy(max_tokens=12)
    args = dict(loops=4, exit_policy="early:0.5", **engine_args)
    graphs, _ = run(tiny_checkpoint, FIVE_PROMPTS, params, True, False, **args)
    eager, _ = run(tiny_checkpoint, FIVE_PROMPTS, params, True, True, **args)
    assert_same_completions(eager, graphs)


def test_replayed_passes_in_deterministic_mode_give_the_eager_depth_logprobs_bit_for_bit(tiny_checkpoint):
    params = greedy(max_tokens=12)
    args = dict(loops=4, exit_policy="early:0.5", deterministic=True)
    graphs, _ = run(tiny_checkpoint, FIVE_PROMPTS, params, True, False, **args)
    eager, _ = run(tiny_checkpoint, FIVE_PROMPTS, params, True, True, **args)
    assert_same_completions(eager, graphs, bitwise=True)


def test_huginn_replayed_passes_read_their_injection_and_give_the_eager_depth_tokens():
    params = [greedy(max_tokens=6, seed=s, loops=k) for s, k in zip(range(3), (4, 2, 3))]
    args = dict(loops=4, init_scale=1.0)
    graphs, _ = run(HUGINN, HUGINN_PROMPTS, params, True, False, **args)
    eager, _ = run(HUGINN, HUGINN_PROMPTS, params, True, True, **args)
    assert_same_completions(eager, graphs)


def test_start_line_says_what_is_captured(tiny_checkpoint, capsys):
    with Engine(tiny_checkpoint, device="cuda", attention="triton", max_num_seqs=4, num_kv_blocks=64,
                depth_batching=True):
        pass
    line = capsys.readouterr().err
    assert ("depth_batching (CUDA graphs: a loop pass's layer stack, 3 batch sizes up to 4; chains of 16 "
            "passes a step where rows allow, each pass one graph with the step to the next;") in line
    assert "prompt steps: piecewise graphs)" in line


@pytest.mark.parametrize("d", [1, 2])
def test_replayed_pipelined_speculation_gives_plain_tokens(d, monkeypatch):
    """Pipelined self-speculation (runner/pipelined_speculation.py): verifying and drafting rows of one
    request replay one bucket's graph, each at its own slot offset; the trained tiny model accepts most
    drafts; once the batch settles, a chain goes on from the captured graphs' buffers
    (SpeculativeChainGraphs.resume; no logprobs, which would keep each step to one pass). The tokens are the
    eager pipelined engine's and the lockstep engine's without speculation."""
    resumed = []
    resume = SpeculativeChainGraphs.resume
    monkeypatch.setattr(SpeculativeChainGraphs, "resume", lambda *args: resumed.append(1) or resume(*args))
    params = greedy(max_tokens=40, logprobs=None)
    spec = {"speculative": f"loops:{d}", "loops": 4}
    graphs, stats = run(DEFAULT_MODEL, FIVE_PROMPTS, params, True, False, **spec)
    assert resumed
    eager, _ = run(DEFAULT_MODEL, FIVE_PROMPTS, params, True, True, **spec)
    plain, _ = run(DEFAULT_MODEL, FIVE_PROMPTS, params, False, False, loops=4)
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager] == [c.token_ids for c in plain]
    assert sum(c.depth.passes for c in graphs) < 4 * sum(c.depth.tokens for c in graphs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_replayed_pipelined_speculation_that_pauses_its_drafts_gives_plain_tokens(
        tiny_checkpoint, monkeypatch, async_scheduling):
    """Random weights reject nearly every draft, so requests pause drafting (scheduler/scheduler.py:
    PIPELINED_PAUSE) and decode through the whole-step graphs between chains of passes: plain tokens. Async
    (the CUDA default), those steps are launched ahead of the step before."""
    launched = []
    launch = ModelRunner.launch
    monkeypatch.setattr(ModelRunner, "launch", lambda *args: launched.append(1) or launch(*args))
    params = greedy(max_tokens=40, logprobs=None)  # chains of passes where a request drafts
    spec = {"speculative": "loops:2", "loops": 4, "async_scheduling": async_scheduling}
    graphs, _ = run(tiny_checkpoint, FIVE_PROMPTS, params, True, False, **spec)
    assert bool(launched) == async_scheduling
    plain, _ = run(tiny_checkpoint, FIVE_PROMPTS, params, False, False, loops=4)
    assert [c.token_ids for c in graphs] == [c.token_ids for c in plain]
    verified = sum(c.speculative.steps for c in graphs if c.speculative is not None)
    assert 0 < verified < sum(c.depth.tokens for c in graphs) / 2


def test_capturing_and_replaying_passes_leaves_the_split_k_tickets_at_zero(tmp_path):
    """Ouro-1.4B's layer shapes (4 of its layers), bf16: its skinny GEMMs split K. Capturing the pass graphs
    (each bucket's first replay beside the next bucket's warm-up, until those were ordered) and running
    passes leave every split-K ticket at zero, and no logprob is NaN."""
    import math

    from model.tiny import write_checkpoint
    from tests.test_deterministic_gpu import split_k_tickets_left

    checkpoint = write_checkpoint(tmp_path, "ouro-1.4b", layers=4)
    with Engine(checkpoint, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                num_kv_blocks=512, exit_policy="early:0.5", depth_batching=True, verbose=False) as engine:
        assert split_k_tickets_left() == 0
        outputs = engine.generate([[5 + i] * (20 + 7 * i) for i in range(12)], greedy(max_tokens=16),
                                  use_tqdm=False)
        assert engine.runner.depth.graphs.replays > 0
    assert split_k_tickets_left() == 0
    assert all(math.isfinite(v.logprob) for out in outputs for entry in out.outputs[0].logprobs
               for v in entry.values())
