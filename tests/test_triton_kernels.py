"""The Triton kernels against the torch reference backend, at tiny shapes. Without CUDA they run in the
Triton interpreter (conftest sets TRITON_INTERPRET=1), so shapes and parameter grids stay small."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention.base import SharedKVMetadata
from attention.kernels.decode import host_split_count
from attention.kernels.kv_store import kv_store_kernel
from attention.registry import select
from attention.triton_backend import SplitRule
from tests.paged_cases import assert_matches, bound, make_case, reference, run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DECODE_ROWS = {"query_lens": [1, 1, 1, 1], "context_lens": [1, 9, 17, 30]}
# Rows with a cached prefix and a chunk, rows without a prefix, and decode rows, in one step.
MIXED_ROWS = {"query_lens": [1, 20, 7, 1, 5], "context_lens": [9, 33, 7, 30, 5]}


def triton_backend(case, splits: str = "many", requirements=None):
    backend = bound("triton", case, requirements)
    backend.prefill_block_m = backend.prefill_block_n = 16
    backend.decode_block_n = 16  # four 4-token pages per key tile (tl.dot needs 16)
    if splits == "one":
        backend.split_cap = 1
    else:
        backend.split_min_keys, backend.short_context = 8, 0  # the long rule: splits of 8 keys
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_store_writes_new_tokens_into_their_pages(dtype):
    case = make_case([3, 1], [5, 9], dtype=dtype, heads=3, kv_heads=3, device=DEVICE)
    _, ref = reference(case)
    key_cache, value_cache = case.key_cache[1].clone(), case.value_cache[1].clone()
    k, v = case.k, case.v
    kv_store_kernel[(k.shape[0],)](k, v, key_cache, value_cache, key_cache, case.meta.slot_mapping,
                                   k.stride(0), k.stride(1), v.stride(0), v.stride(1), 3, 64, 64, 4, False,
                                   False)
    assert torch.equal(key_cache, ref.key_cache[1]) and torch.equal(value_cache, ref.value_cache[1])


@pytest.mark.parametrize("dtype,head_dim,splits", [
    (torch.float32, 64, "one"), (torch.float32, 128, "many"), (torch.float16, 64, "many"),
    (torch.float16, 128, "one"), (torch.bfloat16, 64, "one"), (torch.bfloat16, 128, "many"),
])
def test_decode_matches_reference_and_stores_kv(dtype, head_dim, splits):
    case = make_case(**DECODE_ROWS, dtype=dtype, head_dim=head_dim, device=DEVICE)
    expected, ref = reference(case)
    backend = triton_backend(case, splits)
    assert_matches(run(backend, case), expected, case)
    assert backend._plan.decode.grid[0] == (1 if splits == "one" else 4)
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)


def test_decode_with_grouped_kv_heads_matches_reference():
    case = make_case(**DECODE_ROWS, heads=4, kv_heads=2, device=DEVICE)
    expected, ref = reference(case)
    backend = triton_backend(case)
    assert_matches(run(backend, case), expected, case)
    assert torch.equal(backend.key_cache, ref.key_cache)


def test_split_rule_counts_splits_per_row_context():
    splits = [host_split_count(c, 512, 16) for c in (0, 1, 512, 513, 2048, 8192, 100_000)]
    assert splits == [1, 1, 1, 2, 4, 16, 16]


def test_empty_splits_give_no_nan():
    # 17 keys in 9 splits of one 16-key tile each: splits 2..8 hold no key.
    case = make_case([1], [17], device=DEVICE)
    expected, _ = reference(case)
    backend = triton_backend(case)
    backend.decode_block_n, backend.split_min_keys, backend.short_context = 16, 2, 0
    assert_matches(run(backend, case), expected, case)


def test_row_with_empty_context_gives_zeros_not_nan():
    """Graph buckets pad with such rows; they must not disturb the others."""
    case = make_case([1, 1], [5, 9], device=DEVICE)
    expected, _ = reference(case)
    case.meta.context_lens[0] = 0
    case.meta.context_lens_cpu[0] = 0
    out = run(triton_backend(case), case)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_matches(out[1:], expected[1:])


def test_two_decode_runs_are_bitwise_equal():
    case = make_case(**DECODE_ROWS, dtype=torch.bfloat16, device=DEVICE)
    backend = triton_backend(case)
    assert torch.equal(run(backend, case), run(backend, case))


def graph_mode_run(backend, case, slot: int = 1) -> tuple[torch.Tensor, object]:
    """A decode step planned as for a CUDA graph (the capture itself needs CUDA): capture_begin gives the
    launch a grid with room for every context the block table holds, and this instance's partials and
    tickets instead of the eager workspace's."""
    backend.capture_begin(max_rows=case.meta.num_rows)
    try:
        return run(backend, case, slot), backend._plan
    finally:
        backend.capture_end()


def test_graph_mode_decode_is_one_launch_bitwise_equal_to_eager():
    """The per-row split counts, and so every bit, are the eager ones; the ticket merge runs in the launch."""
    case = make_case(**DECODE_ROWS, dtype=torch.bfloat16, spare_columns=6, device=DEVICE)
    expected, _ = reference(case)
    backend = triton_backend(case)
    eager = run(backend, case)
    eager_splits = backend._plan.decode.grid[0]
    graph, plan = graph_mode_run(backend, case)
    assert (plan.store, plan.prefill, plan.packed) == (None, None, None)
    assert plan.decode.grid[0] > eager_splits and plan.workspace_size is None
    assert plan.tickets.data_ptr() == backend._graph_tickets[-1].data_ptr()
    assert torch.equal(graph, eager)
    assert_matches(graph, expected, case)
    assert not backend._graph_tickets[-1].any()  # the merging splits put every ticket back to 0


def test_merge_over_more_splits_than_one_round_matches_reference_in_both_modes():
    """19 splits of one 16-key tile: the merge loads MERGE_LANES (16) splits a round, so it takes two."""
    case = make_case([1, 1], [300, 20], device=DEVICE)
    expected, _ = reference(case)
    backend = triton_backend(case)
    backend.split_min_keys, backend.short_context = 16, 0
    eager = run(backend, case)
    assert backend._plan.decode.grid[0] == 19
    graph, plan = graph_mode_run(backend, case)
    assert plan.decode.grid[0] == 20
    assert torch.equal(graph, eager)
    assert_matches(eager, expected, case)
    assert not backend._graph_tickets[-1].any()


def test_split_rule_depends_on_the_row_length_class_only():
    rule = SplitRule(split_min_keys=512, split_cap=16, short_context=1024, short_split_keys=64)
    contexts = (0, 1, 64, 65, 512, 1024, 1025, 2048, 8192, 100_000)
    assert [rule.count(c) for c in contexts] == [1, 1, 1, 2, 8, 16, 3, 4, 16, 16]
    assert rule.grid_count(1500) == 16  # a 1024-key row (short) needs more splits than a 1500-key one
    assert rule.grid_count(512) == 8 and rule.grid_count(8192) == 16
    assert SplitRule(512, 16).count(2048) == host_split_count(2048, 512, 16)
    with pytest.raises(ValueError, match="short_split_keys"):
        SplitRule(512, 16, short_context=1024, short_split_keys=0)


def test_short_and_long_rows_take_their_own_split_sizes_in_one_launch():
    """A 40-key row (short class) in 16-key splits beside a 70-key row in 48-key ones, eager and graph
    mode."""
    case = make_case([1, 1, 1], [40, 70, 5], dtype=torch.bfloat16, device=DEVICE)
    expected, _ = reference(case)
    backend = triton_backend(case)
    backend.split_min_keys, backend.short_context, backend.short_split_keys = 48, 40, 16
    eager = run(backend, case)
    rule = backend._step.rule
    assert [rule.count(c) for c in case.meta.context_lens_cpu] == [3, 2, 1]
    assert backend._plan.decode.grid[0] == 3
    graph, _ = graph_mode_run(backend, case)
    assert torch.equal(graph, eager)
    assert_matches(eager, expected, case)


def shared_case(dtype: torch.dtype, loops: int = 2, layers: int = 2):
    """kv_sharing="last": a prompt row whose new token is its last prompt token, and two rows that
    generated tokens, kept in generated pages taken from the rows' own unused blocks."""
    contexts, prompt_lens = [9, 30, 40], [9, 12, 21]
    case = make_case([1, 1, 1], contexts, dtype=dtype, num_slots=loops * layers, device=DEVICE)
    block_size = case.meta.block_size
    tables = case.meta.block_tables.cpu()
    generated = [tables[row, -(-prompt // block_size):][:3].tolist()
                 for row, prompt in enumerate(prompt_lens)]
    generated[0] = tables[0, :3].tolist()  # never read: row 0 has no generated token
    slots = case.meta.slot_mapping.clone()
    slots[1:] = -1
    case.meta.slot_mapping = slots
    case.meta.shared_kv = SharedKVMetadata(torch.tensor(prompt_lens, dtype=torch.int32, device=DEVICE),
                                           torch.tensor(generated, dtype=torch.int32, device=DEVICE),
                                           prompt_lens, loops, layers)
    return case


def test_shared_last_decode_in_graph_mode_is_bitwise_equal_to_eager():
    case = shared_case(torch.float32)
    slot = 3  # loop 1, layer 1: generated tokens are one plane group away from the call's own plane
    expected, ref = reference(case, slot)
    backend = triton_backend(case)
    eager = run(backend, case, slot)
    graph, _ = graph_mode_run(backend, case, slot)
    assert torch.equal(graph, eager)
    assert_matches(eager, expected)
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)


@pytest.mark.parametrize("short_context", [0, 32])
def test_decode_row_gives_the_same_bits_in_any_batch(short_context):
    case = make_case(**DECODE_ROWS, dtype=torch.float16, device=DEVICE)
    alone = make_case([1], [30], dtype=torch.float16, device=DEVICE)
    alone.key_cache, alone.value_cache = case.key_cache, case.value_cache
    alone.q, alone.k, alone.v = case.q[3:], case.k[3:], case.v[3:]
    alone.meta.block_tables = case.meta.block_tables[3:]
    alone.meta.slot_mapping = case.meta.slot_mapping[3:]
    batched, single = triton_backend(case), triton_backend(alone)
    for backend in (batched, single):
        backend.short_context, backend.short_split_keys = short_context, 16
    assert torch.equal(run(batched, case)[3], run(single, alone)[0])


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 128), (torch.float16, 64), (torch.bfloat16, 128)])
def test_mixed_prefill_and_decode_step_matches_reference(dtype, head_dim):
    case = make_case(**MIXED_ROWS, dtype=dtype, head_dim=head_dim, device=DEVICE)
    expected, ref = reference(case)
    backend = triton_backend(case)
    assert_matches(run(backend, case), expected, case)
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.float16, 128), (torch.bfloat16, 64)])
def test_packed_prefill_is_within_its_stated_tolerance(dtype, head_dim):
    case = make_case(**MIXED_ROWS, dtype=dtype, heads=4, kv_heads=2, head_dim=head_dim, device=DEVICE)
    expected, ref = reference(case)
    backend = triton_backend(case, requirements={"packed_prefill": True})
    out = run(backend, case)
    # Rows 2 and 4 have no cached prefix, so they are packed; row 1 has one and goes per row.
    assert backend._plan.packed is not None and backend._plan.prefill is not None
    tolerance = backend.capabilities.packed_prefill_tolerance
    assert (out.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    assert torch.equal(backend.key_cache, ref.key_cache)


# Huginn-0125's head_dim (96) and another multiple of 16 that is no power of two: the kernels tile the head as
# the next power of two and mask the padding lanes.
PADDED_HEAD_DIMS = [(torch.float32, 96), (torch.bfloat16, 96), (torch.float32, 48), (torch.bfloat16, 48)]


@pytest.mark.parametrize("dtype,head_dim", PADDED_HEAD_DIMS)
def test_padded_head_dim_prefill_and_decode_match_reference_with_grouped_kv_heads(dtype, head_dim):
    """Paged prefill (with and without a cached prefix), split decode with its merge, and both K/V stores,
    at a head_dim that is no power of two; q, k and v are strided views, so a load past head_dim would read
    the next head's values, and a store past it would overwrite the next kv head's cache entries."""
    case = make_case(**MIXED_ROWS, dtype=dtype, heads=4, kv_heads=2, head_dim=head_dim, device=DEVICE)
    expected, ref = reference(case)
    backend = triton_backend(case)
    out = run(backend, case)
    assert backend.block_d == 2 * head_dim * 2 // 3  # 96 -> 128, 48 -> 64
    assert backend._plan.prefill is not None and backend._plan.decode.grid[0] == 4
    assert_matches(out, expected, case)
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_prefill_at_head_dim_96_is_within_its_stated_tolerance(dtype):
    case = make_case(**MIXED_ROWS, dtype=dtype, heads=4, kv_heads=2, head_dim=96, device=DEVICE)
    expected, ref = reference(case)
    backend = triton_backend(case, requirements={"packed_prefill": True})
    out = run(backend, case)
    assert backend._plan.packed is not None
    tolerance = backend.capabilities.packed_prefill_tolerance
    assert (out.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    assert torch.equal(backend.key_cache, ref.key_cache)


def test_head_dims_off_the_multiples_of_16_are_refused_by_name():
    backend = select("triton", torch.device(DEVICE))
    for head_dim in (96, 48, 16, 256):
        backend.check(torch.float32, head_dim, torch.device(DEVICE))
    for head_dim in (8, 40, 100, 272, 512):
        with pytest.raises(ValueError, match=f"'triton' does not support head_dim {head_dim} "):
            backend.check(torch.float32, head_dim, torch.device(DEVICE))


def test_every_kernel_variant_compiles_for_hopper_and_pdl_variants_wait_first():
    """The interpreter runs code the compiler rejects; compile each variant for sm_90 in a process
    without TRITON_INTERPRET (no GPU needed), and read each PDL variant's PTX: before griddepcontrol.wait
    only step inputs are loaded and nothing is written, on every path (tests/pdl_ptx.py)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-m", "tests.hopper_compile"], env=env, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parent.parent, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    checked = re.search(r"(\d+) PDL variants wait before reading activations or writing", result.stdout)
    assert checked and int(checked.group(1)) > 0, result.stdout
