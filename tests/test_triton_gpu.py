"""The Triton backend on CUDA at Ouro's shapes (16 heads x 128, pages of 16 tokens), with the tuned
defaults: split rule, direct launches, the ticket merge in the decode launch (eager and CUDA graphs),
Programmatic Dependent Launch where the GPU has it, and 64-bit offsets."""

import pytest
import torch

from tests.paged_cases import assert_matches, bound, make_case, reference, run
from triton_runtime.launch import DIRECT_LAUNCH
from triton_runtime.pdl import pdl_supported
from triton_runtime.stream import current_stream
from triton_runtime.workspace import Workspace

pytestmark = pytest.mark.gpu

OURO = {"heads": 16, "kv_heads": 16, "head_dim": 128, "block_size": 16, "device": "cuda"}
# 1 to 9 splits under the default rule (512 keys per split).
DECODE_CONTEXTS = [1, 15, 16, 17, 100, 513, 1500, 2048, 4100]
DTYPES = [torch.bfloat16, torch.float32]


def decode_case(dtype, **kwargs):
    contexts = kwargs.pop("context_lens", DECODE_CONTEXTS)
    return make_case([1] * len(contexts), contexts, dtype=dtype, **OURO, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference_for_every_slot_of_a_step(dtype):
    """The first forward of a step goes through Triton's JIT, the later ones launch directly."""
    case = decode_case(dtype)
    ref = bound("torch", case)
    backend = bound("triton", case)
    ref.prepare(case.meta)
    backend.prepare(case.meta)
    for slot in (0, 1, 0):
        expected = ref.forward(case.q, case.k, case.v, slot)
        assert_matches(backend.forward(case.q, case.k, case.v, slot), expected)
    assert backend._plan.decode.grid[0] == 9
    assert (backend._plan.decode.compiled is not None) == DIRECT_LAUNCH
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_small_splits_match_reference(dtype):
    case = decode_case(dtype)
    expected, _ = reference(case)
    backend = bound("triton", case)
    backend.split_min_keys, backend.short_context = 64, 0
    assert_matches(run(backend, case), expected)
    assert backend._plan.decode.grid[0] == backend.split_cap


def test_fused_merge_is_deterministic_and_returns_every_ticket():
    case = decode_case(torch.bfloat16)
    backend = bound("triton", case)
    backend.workspace = Workspace()
    backend.split_min_keys, backend.short_context = 64, 0
    first = run(backend, case)
    for _ in range(20):
        assert torch.equal(run(backend, case), first)
    torch.cuda.synchronize()
    assert len(backend.workspace) == 1
    entry = backend.workspace.get(case.q.device, current_stream(case.q.device), 0, 0)
    assert not entry.tickets.any()


def capture_decode(backend, case, slot: int = 1) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, object]:
    """One decode call captured as the runner does it: capture_begin, a warm-up run outside the capture
    (it compiles the kernel and makes the graph's tickets), then the capture. Returns the graph, its output
    buffer and the captured plan."""
    backend.capture_begin(max_rows=case.meta.num_rows)
    try:
        run(backend, case, slot)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.prepare(case.meta)
            out = backend.forward(case.q, case.k, case.v, slot)
        plan = backend._plan
    finally:
        backend.capture_end()
    return graph, out, plan


def kernels_launched(replay) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        replay()
        torch.cuda.synchronize()
    return [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_captured_decode_is_one_launch_bitwise_equal_to_eager(dtype):
    """Captured with dummy contexts of 1 and a table wider than any row needs; replayed on the real
    contexts. The graph's grid has room for every context the table holds, the per-row split counts
    are the eager ones, so the bits are too; the replay is the decode kernel alone (its ticket merge
    included) and leaves the graph's tickets at zero."""
    case = decode_case(dtype, spare_columns=200)
    expected, _ = reference(case)
    backend = bound("triton", case)
    real_contexts = case.meta.context_lens.clone()
    case.meta.context_lens.fill_(1)
    graph, graph_out, plan = capture_decode(backend, case)
    case.meta.context_lens.copy_(real_contexts)
    assert kernels_launched(graph.replay) == ["decode_split_kernel"]
    eager = run(backend, case)
    assert plan.decode.grid[0] > backend._plan.decode.grid[0]
    assert plan.tickets.data_ptr() == backend._graph_tickets[-1].data_ptr()
    assert torch.equal(graph_out, eager)
    assert_matches(eager, expected)
    assert not backend._graph_tickets[-1].any()


def test_graph_replays_are_deterministic_and_return_every_ticket():
    case = decode_case(torch.bfloat16)
    backend = bound("triton", case)
    backend.split_min_keys, backend.split_cap = 64, 32  # up to 32 splits a row: two merge rounds
    graph, out, _ = capture_decode(backend, case)
    graph.replay()
    first = out.clone()
    for _ in range(20):
        graph.replay()
        assert torch.equal(out, first)
    torch.cuda.synchronize()
    assert not backend._graph_tickets[-1].any()
    assert torch.equal(first, run(backend, case))


@pytest.mark.parametrize("dtype", DTYPES)
def test_short_rows_in_small_splits_match_reference_and_graph_equals_eager(dtype):
    """The short class (rows of at most 1024 keys in 64-key splits) beside long rows in one launch."""
    case = decode_case(dtype, context_lens=[1, 63, 64, 65, 512, 1024, 1025, 4100], spare_columns=100)
    expected, _ = reference(case)
    backend = bound("triton", case)
    backend.short_context, backend.short_split_keys = 1024, 64
    eager = run(backend, case)
    assert backend._plan.decode.grid[0] == backend.split_cap
    graph, graph_out, _ = capture_decode(backend, case)
    graph.replay()
    assert torch.equal(graph_out, eager)
    assert_matches(eager, expected)


def test_pdl_launches_change_no_bit():
    """Where the GPU has Programmatic Dependent Launch the decode step's kernels use it (a mixed step: the
    kv_store, prefill and decode kernels), and give the bits of launches without it."""
    case = make_case([1, 300, 1, 64, 1, 17], [2048, 1000, 33, 64, 4100, 17], dtype=torch.bfloat16, **OURO)
    outputs = []
    for pdl in (False, True):
        backend = bound("triton", case)
        backend.pdl = pdl and pdl_supported(case.q.device)
        outputs.append(run(backend, case))
        plan = backend._plan
        if DIRECT_LAUNCH:  # the compiled kernels are at hand
            assert [launch.compiled.metadata.launch_pdl for launch in (plan.store, plan.prefill, plan.decode)
                    ] == [backend.pdl] * 3
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_matches_reference(dtype):
    case = make_case([1, 300, 1, 64, 1, 17], [2048, 1000, 33, 64, 4100, 17], dtype=dtype, **OURO)
    expected, ref = reference(case)
    backend = bound("triton", case)
    assert_matches(run(backend, case), expected)
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)


# Huginn-0125's attention (55 heads x 96, no GQA): a head_dim that is no power of two, in 128 masked lanes.
HUGINN = {"heads": 55, "kv_heads": 55, "head_dim": 96, "block_size": 16, "device": "cuda"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_at_huginns_head_dim_96_matches_reference_eager_and_in_graph_mode(dtype):
    """Paged prefill with and without a prefix, multi-split decode, the K/V stores, with the tuned defaults;
    the decode rows alone also in graph mode, bitwise the eager bits."""
    case = make_case([1, 300, 1, 64, 1, 17], [2048, 1000, 33, 64, 4100, 17], dtype=dtype, **HUGINN)
    expected, ref = reference(case)
    backend = bound("triton", case)
    assert backend.block_d == 128
    assert_matches(run(backend, case), expected)
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)
    decode = make_case([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS, dtype=dtype, **HUGINN)
    expected, _ = reference(decode)
    backend = bound("triton", decode)
    eager = run(backend, decode)
    assert_matches(eager, expected)
    backend.capture_begin(max_rows=decode.meta.num_rows)  # the graph-mode plan (grid, buffers), uncaptured
    try:
        graph = run(backend, decode)
    finally:
        backend.capture_end()
    assert torch.equal(graph, eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_prefill_is_within_its_stated_tolerance(dtype):
    case = make_case([1, 300, 5, 64, 2, 17], [2048, 1000, 5, 64, 2, 17], dtype=dtype, **OURO)
    expected, ref = reference(case)
    backend = bound("triton", case, {"packed_prefill": True})
    out = run(backend, case)
    assert backend._plan.packed is not None
    tolerance = backend.capabilities.packed_prefill_tolerance
    assert (out.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    assert torch.equal(backend.key_cache, ref.key_cache)


def test_pages_beyond_2_31_elements_are_addressed_with_64_bit_offsets():
    blocks_needed = 2**31 // (16 * 16 * 128) + 64  # one slot plane of more than 2^31 elements
    case = make_case([1, 40], [300, 600], dtype=torch.bfloat16, num_slots=1, **OURO)
    shape = (1, blocks_needed, 16, 16, 128)
    key_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    high = blocks_needed - case.key_cache.shape[1]  # move every block to the top of the pool
    key_cache[:, high:] = case.key_cache
    value_cache[:, high:] = case.value_cache
    expected, _ = reference(case, slot=0)
    case.key_cache, case.value_cache = key_cache, value_cache
    case.meta.block_tables += high
    case.meta.slot_mapping += high * 16
    backend = bound("triton", case)
    assert_matches(run(backend, case, slot=0), expected)


def test_workspace_entries_follow_the_current_stream():
    case = decode_case(torch.bfloat16)
    backend = bound("triton", case)
    backend.workspace = Workspace()
    device = case.q.device
    assert current_stream(device) == torch.cuda.current_stream().cuda_stream
    first = run(backend, case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        second = run(backend, case)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(first, second)
    assert [key[1] for key in backend.workspace.oldest_first()] == [torch.cuda.current_stream().cuda_stream,
                                                            side.cuda_stream]
