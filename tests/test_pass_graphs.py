"""Depth batching through the loop pass's static buffers (runner/pass_graphs.py: PassGraphs), not captured:
the code a CUDA capture records, run eagerly on CPU. A request's tokens, logprobs and exit traces equal those
of depth batching's plain eager pass under full depth, early:0.5 with mixed exits, a criterion, per-request
loops, Huginn (its injection, drawn states, a coda criterion), an fp8 cache, kv_sharing="last" and a ring,
with passes of 3 and 5 rows padded to the 4- and 8-row buckets.

Bit for bit in deterministic mode (batch-invariant products: a padding row changes no real row's bits), which
runs Ouro over the paged and shared-last layouts. Elsewhere (Huginn, a ring, the default mode) a padded pass
multiplies more rows than the eager one, and the CPU GEMM's bits depend on the row count (as cuBLAS's do:
tests/test_gpu_engine.py), so logprobs agree to fp32 rounding (1e-4) and tokens exactly. The capture itself
runs on CUDA only: tests/test_pass_graphs_gpu.py."""

import pytest

from engine import Engine
from exit_policy import ExitPolicy, parse_exit_policy
from runner.cuda_graph import batch_buckets
from tests.test_depth_batching import HUGINN, HUGINN_PROMPTS, PROMPTS, assert_same_completions, greedy

FIVE_PROMPTS = PROMPTS + ["Once upon a time"]


def run(checkpoint, prompts, params, static: bool, **engine_args):
    """Depth-batched completions (chunked prefill: 6 tokens a step), and the row count of each pass through
    the static buffers (static=True: every pass goes through them)."""
    engine_args = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 6, "verbose": False,
                   **engine_args}
    sizes = []
    with Engine(checkpoint, depth_batching=True, **engine_args) as engine:
        if static:
            graphs = static_pass_graphs(engine, sizes)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        if static:
            # every loop pass went through the static buffers (a lone row's token runs lockstep's path)
            assert graphs.passes == len(sizes) <= engine.loop_stats.decode_passes and graphs.replays == 0
            assert not engine.uses_cuda_graphs
        assert not engine.runner.mid_tokens
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return [out.outputs[0] for out in outputs], sizes


def static_against_eager(checkpoint, prompts, params, bitwise: bool = True, **engine_args):
    """The static path's completions, checked against the eager pass's; and its passes' row counts."""
    eager, _ = run(checkpoint, prompts, params, False, deterministic=bitwise, **engine_args)
    static, sizes = run(checkpoint, prompts, params, True, deterministic=bitwise, **engine_args)
    assert_same_completions(eager, static, bitwise=bitwise)
    assert sizes
    return static, sizes


def test_full_depth_gives_the_eager_pass_tokens_bit_for_bit(tiny_checkpoint):
    static_against_eager(tiny_checkpoint, PROMPTS, greedy(), loops=4)


def test_early_exit_at_mixed_loops_gives_the_eager_pass_tokens_and_exits(tiny_checkpoint):
    completions, _ = static_against_eager(tiny_checkpoint, PROMPTS, greedy(loop_trace=True), loops=4,
                                          exit_policy="early:0.5")
    assert len({t.exit_loop for c in completions for t in c.traces[1:]}) >= 2


def test_a_criterion_gives_the_eager_pass_tokens_and_exits(tiny_checkpoint):
    completions, _ = static_against_eager(tiny_checkpoint, PROMPTS, greedy(loop_trace=True), loops=4,
                                          exit_policy="latent-diff:0.9")
    assert len({len(t.exit_pdf) for c in completions for t in c.traces[1:]}) > 1


def test_per_request_loops_give_the_eager_pass_tokens(tiny_checkpoint):
    params = [greedy(loops=k) for k in (1, 4, 2, 3)]
    completions, _ = static_against_eager(tiny_checkpoint, PROMPTS, params, loops=4)
    assert [c.depth.loops_per_token for c in completions] == [1, 4, 2, 3]


@pytest.mark.parametrize("prompts", [PROMPTS[:3], FIVE_PROMPTS], ids=["3 rows", "5 rows"])
@pytest.mark.parametrize("bitwise", [True, False], ids=["deterministic", "default"])
def test_passes_padded_to_a_bucket_give_the_eager_pass_tokens(tiny_checkpoint, prompts, bitwise):
    """Passes of 3 and 5 rows run in the 4- and 8-row buckets: the padding rows (the scratch block, loop 0)
    touch no real row's K/V or output. The prompts prefill in one step, so every row decodes in the first
    passes."""
    _, sizes = static_against_eager(tiny_checkpoint, prompts, greedy(), bitwise=bitwise, loops=4,
                                    exit_policy="early:0.5", max_num_batched_tokens=64)
    assert max(sizes) == len(prompts) and len(prompts) not in batch_buckets(256)


@pytest.mark.parametrize("engine_args", [dict(kv_cache_dtype="fp8_e4m3"), dict(kv_sharing="last")],
                         ids=["fp8", "kv_sharing=last"])
def test_kv_options_give_the_eager_pass_tokens(tiny_checkpoint, engine_args):
    static_against_eager(tiny_checkpoint, FIVE_PROMPTS, greedy(), loops=3, exit_policy="early:0.5",
                         **engine_args)


def test_huginn_injection_and_drawn_states_give_the_eager_pass_tokens():
    params = [greedy(max_tokens=6, seed=s, loops=k) for s, k in zip(range(3), (4, 2, 3))]
    static_against_eager(HUGINN, HUGINN_PROMPTS, params, bitwise=False, loops=4, init_scale=1.0)


def test_huginn_coda_criterion_gives_the_eager_pass_tokens_and_exits():
    """kl reads out through the coda at each check: the coda runs eagerly on the static pass's outputs."""
    from tests.reference_huginn import ReferenceHuginn
    from tests.test_huginn_adaptive import threshold_for

    threshold = threshold_for(ReferenceHuginn(HUGINN), ExitPolicy("kl", 1.0, 0, 1), loops=8, new_tokens=6)
    policy = str(parse_exit_policy(f"kl:{threshold!r}", 8))
    completions, _ = static_against_eager(HUGINN, HUGINN_PROMPTS, greedy(max_tokens=6, loop_trace=True),
                                          bitwise=False, loops=8, exit_policy=policy, init_scale=0,
                                          max_num_batched_tokens=4)
    assert len({len(t.exit_pdf) for c in completions for t in c.traces[1:]}) > 1


def test_a_ring_gives_the_eager_pass_tokens():
    """compress:4 over 8 loops: rows at loops t and t + 4 share a ring plane. Deterministic mode refuses
    rings, so fp32 rounding's tolerance."""
    static_against_eager(HUGINN, HUGINN_PROMPTS, greedy(max_tokens=6), bitwise=False, loops=8, init_scale=0,
                         kv_layout="compress:4", max_num_batched_tokens=64)


@pytest.mark.parametrize("prompts", [PROMPTS[:3], FIVE_PROMPTS], ids=["3 rows", "5 rows"])
def test_chained_passes_over_the_static_buffers_give_the_eager_chain_tokens(tiny_checkpoint, prompts):
    """Greedy rows without logprobs chain 6 passes a step (runner/pass_chains.py): each pass's loops, slots
    and lengths reach the static buffers as device tensors, padded to the bucket."""
    params = greedy(logprobs=None)
    _, sizes = static_against_eager(tiny_checkpoint, prompts, params, loops=3, exit_policy="early:0.5",
                                    max_num_batched_tokens=64, passes_per_step=6)
    assert max(sizes) == len(prompts)


@pytest.mark.interpreter
def test_triton_decode_kernel_over_the_static_buffers_gives_the_eager_pass_tokens(tiny_checkpoint):
    """The Triton backend's per-row-slot decode kernel (the variant a capture records) over the static
    buffers, in passes of 3 rows in the 4-row bucket, under early:0.5. The prompts prefill in one step (the
    interpreter runs every step's kernels in Python; chunked prefill beside passes: the tests above)."""
    _, sizes = static_against_eager(tiny_checkpoint, PROMPTS[:3], greedy(max_tokens=5), loops=3,
                                    exit_policy="early:0.5", attention="triton", kv_sharing="last",
                                    max_num_batched_tokens=64)
    assert max(sizes) == 3


def static_pass_graphs(engine: Engine, sizes: list[int]):
    """The engine's loop passes through the pass graphs' static buffers, uncaptured (runner/pass_graphs.py),
    each pass's row count appended to `sizes`; the PassGraphs."""
    graphs = engine.runner.pass_graphs()
    engine.runner.depth.graphs = graphs
    run_pass = graphs.run

    def recorded(states, *args):
        sizes.append(len(states))
        return run_pass(states, *args)

    graphs.run = recorded
    return graphs
