"""The Triton kernels against the torch reference backend, at tiny shapes. Without CUDA they run in the
Triton interpreter (conftest sets TRITON_INTERPRET=1), so shapes and parameter grids stay small."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention.kernels.kv_store import kv_store_kernel
from attention.kernels.decode import host_split_count
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
        backend.split_min_keys = 8
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_store_writes_new_tokens_into_their_pages(dtype):
    case = make_case([3, 1], [5, 9], dtype=dtype, heads=3, kv_heads=3, device=DEVICE)
    _, ref = reference(case)
    key_cache, value_cache = case.key_cache[1].clone(), case.value_cache[1].clone()
    k, v = case.k, case.v
    kv_store_kernel[(k.shape[0],)](k, v, key_cache, value_cache, key_cache, case.meta.slot_mapping,
                                   k.stride(0), k.stride(1), v.stride(0), v.stride(1), 3, 64, 4, False)
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
    backend.decode_block_n, backend.split_min_keys = 16, 2
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


def test_graph_path_split_and_merge_is_bitwise_equal_to_fused_merge():
    """capture_begin switches to the split kernel + merge kernel (graph mode) with a grid sized for the
    longest context the block table holds; the per-row split count, and so every bit, is unchanged."""
    case = make_case(**DECODE_ROWS, dtype=torch.bfloat16, device=DEVICE)
    backend = triton_backend(case)
    fused = run(backend, case)
    backend.capture_begin(max_rows=4)
    graph = run(backend, case)
    assert backend._plan.merge is not None and backend._plan.decode.grid[0] > 4
    backend.capture_end()
    assert torch.equal(fused, graph)


def test_decode_row_gives_the_same_bits_in_any_batch():
    case = make_case(**DECODE_ROWS, dtype=torch.float16, device=DEVICE)
    alone = make_case([1], [30], dtype=torch.float16, device=DEVICE)
    alone.key_cache, alone.value_cache = case.key_cache, case.value_cache
    alone.q, alone.k, alone.v = case.q[3:], case.k[3:], case.v[3:]
    alone.meta.block_tables = case.meta.block_tables[3:]
    alone.meta.slot_mapping = case.meta.slot_mapping[3:]
    assert torch.equal(run(triton_backend(case), case)[3], run(triton_backend(alone), alone)[0])


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


def test_every_kernel_variant_compiles_for_hopper():
    """The interpreter runs code the compiler rejects; compile each variant for sm_90 in a process
    without TRITON_INTERPRET (no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-m", "tests.hopper_compile"], env=env, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parent.parent, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
