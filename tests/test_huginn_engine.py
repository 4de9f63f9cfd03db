"""Huginn-0125 served by the Engine (the embedded model/checkpoints/tiny-huginn, fp32): greedy tokens are the
plain reference's (tests/reference_huginn.py, zero initial states) at every loop count, chunked, on a prefix
hit and after preemption; drawn initial states are the same for a seed whatever the batch, the chunking or a
recompute; both warm starts are the reference's; the options Huginn cannot serve are refused by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import Engine, SamplingParams
from model.tiny import HUGINN_PRESETS, huginn_hf_config, huginn_random_weights
from runner.initial_states import token_seed
from tests.conftest import ROOT
from tests.reference_huginn import ReferenceHuginn

CHECKPOINT = ROOT / "model" / "checkpoints" / "tiny-huginn"
PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9], [100, 3, 77, 250, 251, 252, 19, 5, 6, 60, 61]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def reference():
    return ReferenceHuginn(CHECKPOINT)


def generate(prompts, params=GREEDY, **options) -> list[list[int]]:
    options = {"device": "cpu", "dtype": "float32", "verbose": False, **options}
    with Engine(CHECKPOINT, **options) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        generate.engine_stats = (engine.scheduler.num_preemptions, [o.num_cached_tokens for o in outputs])
    return [list(o.outputs[0].token_ids) for o in outputs]


def reference_tokens(reference, loops: int, warm_start: str | None = None,
                     prompts=PROMPTS) -> list[list[int]]:
    return [reference.generate(p, GREEDY.max_tokens, loops, warm_start=warm_start).tokens for p in prompts]


@pytest.mark.parametrize("loops", [1, 2, 4, 8, 32])
def test_greedy_tokens_are_the_references_at_every_loop_count(reference, loops):
    assert generate(PROMPTS, loops=loops, init_scale=0) == reference_tokens(reference, loops)


def test_the_default_loop_count_is_the_configs_mean_recurrence():
    with Engine(CHECKPOINT, device="cpu", verbose=False) as engine:
        assert engine.engine_config.loops == engine.config.mean_recurrence == 8
        slot_map = engine.model.slot_map
        assert (slot_map.prelude_layers, slot_map.loops, slot_map.loop_layers, slot_map.coda_layers) == \
            (1, 8, 2, 1)
    with Engine(CHECKPOINT, device="cpu", verbose=False, loops=3) as engine:
        # the pool holds prelude, 3 x core and coda slots per token
        assert engine.model.slot_map.num_slots == 1 + 3 * 2 + 1 == engine.kv_pool.num_slots


def test_chunked_prefill_prefix_hits_and_preemption_give_the_references_tokens(reference):
    want = reference_tokens(reference, 4)
    assert generate(PROMPTS, loops=4, init_scale=0, max_num_batched_tokens=4) == want
    shared = [PROMPTS[2] + [1, 2, 3, 4, 5], PROMPTS[2] + [9, 8, 7, 6, 5]]
    with Engine(CHECKPOINT, device="cpu", dtype="float32", verbose=False, loops=4, init_scale=0,
                block_size=4) as engine:
        first = engine.generate(shared[:1], GREEDY, use_tqdm=False)[0]
        hit = engine.generate(shared[1:], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 8
    assert [list(first.outputs[0].token_ids), list(hit.outputs[0].token_ids)] == \
        reference_tokens(reference, 4, prompts=shared)
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    preempted = generate(PROMPTS, long, loops=4, init_scale=0, num_kv_blocks=7, block_size=4,
                         admission="greedy", max_model_len=28)
    assert generate.engine_stats[0] > 0
    assert preempted == [reference.generate(p, 12, 4).tokens for p in PROMPTS]


def test_a_seed_gives_the_same_initial_states_alone_batched_chunked_and_recomputed():
    seeded = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, seed=1234)
    alone = generate(PROMPTS[2:], seeded, loops=4)
    others = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, seed=s) for s in (5, 6)]
    batched = generate(PROMPTS, others + [seeded], loops=4)
    chunked = generate(PROMPTS, others + [seeded], loops=4, max_num_batched_tokens=4)
    recomputed = generate(PROMPTS, others + [seeded], loops=4, num_kv_blocks=7, block_size=4,
                          admission="greedy", max_model_len=28)
    assert generate.engine_stats[0] > 0
    assert batched[2] == chunked[2] == recomputed[2] == alone[0]
    assert batched[:2] == chunked[:2] == recomputed[:2]
    zero = generate(PROMPTS[2:], seeded, loops=4, init_scale=0)
    other_seed = generate(PROMPTS[2:], others[0], loops=4)
    assert alone != zero and alone != other_seed  # the states are drawn, and from the request's seed


def test_a_tokens_state_is_drawn_from_its_requests_seed_and_its_position():
    """runner/initial_states.py: the generator of (seed, position), through the model's truncated normal."""
    with Engine(CHECKPOINT, device="cpu", verbose=False) as engine:
        states = engine.runner.initial_states

        class Fake:
            request_id, num_prompt_tokens, state_seed = "r", 4, 99

        drawn = states.for_step([Fake()], [2], [4])
        model = engine.model
    for row, position in enumerate((2, 3)):
        generator = torch.Generator().manual_seed(token_seed(99, position))
        want = model.initial_state(torch.empty(1, 64), 1.0, generator)[0]
        assert torch.equal(drawn[row], want)
    assert not torch.equal(drawn[0], drawn[1]) and drawn.abs().max() <= 3 * model.config.init_std * 8.0


def test_an_unseeded_request_gets_a_state_seed_when_added_and_a_seeded_one_its_own():
    with Engine(CHECKPOINT, device="cpu", verbose=False) as engine:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="a")
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, seed=7), request_id="b")
        seeds = {r.request_id: r.state_seed for r in engine.scheduler.waiting}
    assert seeds["b"] == 7 and isinstance(seeds["a"], int)
    with Engine(CHECKPOINT, device="cpu", verbose=False, init_scale=0) as engine:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="a")
        assert [r.state_seed for r in engine.scheduler.waiting] == [None]  # zero states: nothing drawn


@pytest.mark.parametrize("warm_start", ["normalized", "raw"])
def test_warm_start_gives_the_references_tokens_alone_batched_and_after_preemption(reference, warm_start):
    want = reference_tokens(reference, 4, warm_start)
    assert want != reference_tokens(reference, 4)
    assert generate(PROMPTS, loops=4, init_scale=0, continuous_compute=warm_start) == want
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    preempted = generate(PROMPTS, long, loops=4, init_scale=0, continuous_compute=warm_start,
                         num_kv_blocks=7, block_size=4, admission="greedy", max_model_len=28)
    assert generate.engine_stats[0] > 0
    assert preempted == [reference.generate(p, 12, 4, warm_start=warm_start).tokens for p in PROMPTS]


def test_a_finished_request_releases_its_last_state():
    with Engine(CHECKPOINT, device="cpu", verbose=False, init_scale=0, continuous_compute="raw") as engine:
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert engine.runner.initial_states.last == {}


@pytest.mark.parametrize("options, message", [
    ({"exit_policy": "early:0.5"}, "exit_policy='early:0.5' reads an exit gate, which this model does not"),
    ({"exit_policy": "weighted"}, "exit_policy='weighted' reads an exit gate"),
    ({"exit_policy": "step:2"}, "run loops=3 instead"),
    ({"exit_threshold": 0.5}, "exit_threshold=0.5: Huginn-0125 has no exit gate"),
    ({"speculative": "loops:2", "continuous_compute": "raw"},
     "speculative='loops:2' cannot be combined with continuous_compute='raw'"),
    ({"kv_sharing": "last"}, "kv_sharing='last'"),
    ({"continuous_compute": "ln_f"}, "continuous_compute must be None, 'normalized' or 'raw'"),
    ({"init_scale": -1}, "init_scale must be a finite number >= 0"),
    ({"continuous_compute": "raw", "async_scheduling": True}, "async_scheduling=True cannot be combined"),
])
def test_options_huginn_cannot_serve_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Engine(CHECKPOINT, device="cpu", verbose=False, **options)


def test_requests_asking_for_a_gate_are_refused_by_name():
    with Engine(CHECKPOINT, device="cpu", verbose=False) as engine:
        with pytest.raises(ValueError, match="SamplingParams.exit_policy='threshold:0.5' reads an exit gate"):
            engine.generate([[1, 2]], SamplingParams(exit_policy="threshold:0.5"), use_tqdm=False)
        with pytest.raises(ValueError, match="loop_trace traces the exit gate"):
            engine.generate([[1, 2]], SamplingParams(loop_trace=True), use_tqdm=False)


def test_initial_state_options_are_refused_for_a_model_without_one(tiny_checkpoint):
    for option in ({"init_scale": 0.0}, {"continuous_compute": "raw"}):
        with pytest.raises(ValueError, match="it has no initial state to set"):
            Engine(tiny_checkpoint, device="cpu", verbose=False, **option)


@pytest.mark.interpreter
def test_the_triton_backend_gives_the_references_tokens_in_the_interpreter(reference):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = generate(PROMPTS[:2], params, loops=2, init_scale=0, attention="triton")
    assert tokens == [reference.generate(p, 3, 2).tokens for p in PROMPTS[:2]]


def write_head_dim_96_checkpoint(path: Path) -> Path:
    """The tiny Huginn (its tokenizer and depth) at width 192 over 2 heads: Huginn-0125's head_dim, 5280 / 55
    = 96, which is no power of two."""
    shutil.copytree(CHECKPOINT, path)
    config = json.loads((path / "config.json").read_text())
    shape = {**{name: config[name] for name in HUGINN_PRESETS["huginn-tiny"]}, "n_embd": 192, "n_heads": 2}
    config = huginn_hf_config(shape, "float32")
    save_file(huginn_random_weights(config, seed=1, dtype=torch.float32, std=0.1),
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.interpreter
def test_the_triton_backend_at_head_dim_96_gives_the_torch_backends_tokens(tmp_path):
    path = write_head_dim_96_checkpoint(tmp_path / "huginn-96")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = {}
    for attention in ("torch", "triton"):
        with Engine(path, device="cpu", dtype="float32", attention=attention, loops=2, init_scale=0,
                    verbose=False) as engine:
            assert engine.model.config.head_dim == 96
            outputs = engine.generate(PROMPTS[:2], params, use_tqdm=False)
        tokens[attention] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["triton"] == tokens["torch"]


def test_a_kvarn_cache_at_head_dim_96_is_refused_naming_kv_cache_dtype_and_head_dim(tmp_path):
    """The KVarN kernels keep power-of-two heads (the Hadamard rotation is over head_dim)."""
    path = write_head_dim_96_checkpoint(tmp_path / "huginn-96")
    with pytest.raises(ValueError, match="kv_cache_dtype='kvarn_k4v2_g64' cannot serve this checkpoint: "
                                         "KVarN needs a power-of-two head_dim of at least 8, got 96"):
        Engine(path, device="cpu", dtype="float32", attention="triton", kv_cache_dtype="kvarn_k4v2_g64",
               block_size=64, verbose=False)


def _gpu_tokens(prompts, params, **options) -> list[list[int]]:
    with Engine(CHECKPOINT, device="cuda", dtype="float32", attention="triton", verbose=False,
                **options) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        _gpu_tokens.graphs = engine.uses_cuda_graphs
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("piecewise_graph_tokens", [0, 512])
def test_cuda_graphs_give_the_references_tokens_and_eagers(reference, piecewise_graph_tokens):
    """The whole-step decode graph, with or without the piecewise chain for prompt steps, in fp32."""
    graphs = _gpu_tokens(PROMPTS, GREEDY, loops=8, init_scale=0,
                         piecewise_graph_tokens=piecewise_graph_tokens)
    assert _gpu_tokens.graphs
    assert graphs == reference_tokens(reference, 8)
    assert graphs == _gpu_tokens(PROMPTS, GREEDY, loops=8, init_scale=0, enforce_eager=True)


@pytest.mark.gpu
def test_head_dim_96_under_cuda_graphs_gives_the_torch_backends_tokens(tmp_path):
    path = write_head_dim_96_checkpoint(tmp_path / "huginn-96")
    tokens = {}
    for attention in ("torch", "triton"):
        with Engine(path, device="cuda", dtype="float32", attention=attention, loops=8, init_scale=0,
                    verbose=False) as engine:
            outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert engine.uses_cuda_graphs or attention == "torch"
        tokens[attention] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("continuous_compute", [None, "normalized"])
def test_seeded_states_and_warm_starts_are_the_same_eager_and_under_graphs(continuous_compute):
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, seed=s) for s in (1, 2, 3)]
    options = {"loops": 8, "continuous_compute": continuous_compute}
    assert _gpu_tokens(PROMPTS, params, **options) == \
        _gpu_tokens(PROMPTS, params, enforce_eager=True, **options)
