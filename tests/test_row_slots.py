"""Rows at their own loops in one attention call (AttentionMetadata.slot_offsets, depth batching): each row
stores its new K/V in, and attends over, its own slot's plane, in the torch reference backend and the Triton
decode kernel (under TRITON_INTERPRET=1 without CUDA, so the shapes stay tiny)."""

import dataclasses

import pytest
import torch

from tests.paged_cases import TOLERANCE, bound, make_case, reference
from tests.test_triton_kernels import DEVICE, triton_backend

CALL_SLOT = 1
OFFSETS = [0, 2, 1, 2]  # rows in slots 1, 3, 2, 3
DECODE_ROWS = {"query_lens": [1, 1, 1, 1], "context_lens": [3, 9, 17, 30]}


def with_offsets(case, offsets: list[int]):
    meta = dataclasses.replace(case.meta, slot_offsets=torch.tensor(offsets, dtype=torch.int32,
                                                                     device=case.q.device),
                               slot_offsets_cpu=list(offsets))
    return dataclasses.replace(case, meta=meta)


def row_by_row(case, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row alone through the reference backend at its own slot (no offsets): the output and both caches
    the per-row call must give."""
    backend = bound("torch", case)
    out = torch.empty_like(case.q)
    for row, offset in enumerate(offsets):
        meta, tokens = case.meta.select([row])
        backend.prepare(meta)
        out[tokens] = backend.forward(case.q[tokens], case.k[tokens], case.v[tokens], CALL_SLOT + offset)
    return out, backend.key_cache, backend.value_cache


def test_reference_backend_gives_each_row_its_own_slot_bit_for_bit():
    case = make_case(**DECODE_ROWS, num_slots=4)
    expected, key_cache, value_cache = row_by_row(case, OFFSETS)
    got, backend = reference(with_offsets(case, OFFSETS), CALL_SLOT)
    assert torch.equal(got, expected)
    assert torch.equal(backend.key_cache, key_cache) and torch.equal(backend.value_cache, value_cache)
    lockstep, _ = reference(case, CALL_SLOT)  # the same call without offsets reads other planes
    assert not torch.equal(got, lockstep)


@pytest.mark.parametrize("dtype,splits", [(torch.float32, "one"), (torch.float32, "many"),
                                          (torch.bfloat16, "many")])
def test_triton_decode_kernel_reads_and_stores_each_rows_own_slot(dtype, splits):
    case = with_offsets(make_case(**DECODE_ROWS, num_slots=4, dtype=dtype, device=DEVICE), OFFSETS)
    expected, ref = reference(case, CALL_SLOT)
    backend = triton_backend(case, splits)
    backend.prepare(case.meta)
    got = backend.forward(case.q, case.k, case.v, CALL_SLOT).clone()
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype]
    assert torch.equal(backend.key_cache, ref.key_cache) and torch.equal(backend.value_cache, ref.value_cache)


def test_triton_refuses_per_row_slots_on_a_prompt_row_by_name():
    case = with_offsets(make_case([1, 3], [5, 9], num_slots=4, device=DEVICE), [0, 1])
    backend = triton_backend(case)
    with pytest.raises(ValueError, match="slot_offsets"):
        backend.prepare(case.meta)
