"""Copy-forward (cache/copy_forward.py): the Triton kernel (in the interpreter on CPU) against plain indexing,
with and without a device-side row mask, and nothing outside the stopped tokens' deeper planes changes."""

import pytest
import torch

from cache.copy_forward import copy_forward
from cache.kv_pool import KVPool
from model.looped import SlotMap

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def filled_pool(loops: int, layers: int, kv_heads: int, head_dim: int) -> KVPool:
    pool = KVPool(SlotMap(loops, layers), num_blocks=5, block_size=4, kv_heads=kv_heads, head_dim=head_dim,
                  dtype=torch.float32, device=torch.device(DEVICE))
    generator = torch.Generator().manual_seed(0)
    pool.key_cache.copy_(torch.randn(pool.key_cache.shape, generator=generator))
    pool.value_cache.copy_(torch.randn(pool.value_cache.shape, generator=generator))
    return pool


@pytest.mark.parametrize("loop", [0, 1, 2])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 4), (3, 4)])  # a row of 12 values: a masked tail
def test_triton_copy_forward_matches_indexing(loop, masked, kv_heads, head_dim):
    loops, layers = 4, 3
    slots = torch.tensor([1, 6, 13, 19], dtype=torch.int64, device=DEVICE)
    mask = torch.tensor([True, False, True, True], device=DEVICE) if masked else None
    expected, actual = (filled_pool(loops, layers, kv_heads, head_dim) for _ in range(2))
    before = expected.key_cache.clone()
    slot_map = SlotMap(loops, layers)
    copy_forward(expected.key_cache, expected.value_cache, slot_map, slots, loop, mask, use_triton=False)
    copy_forward(actual.key_cache, actual.value_cache, slot_map, slots, loop, mask, use_triton=True)
    torch.testing.assert_close(actual.key_cache, expected.key_cache, rtol=0, atol=0)
    torch.testing.assert_close(actual.value_cache, expected.value_cache, rtol=0, atol=0)
    planes = expected.key_cache.view(loops, layers, -1, kv_heads, head_dim)
    old = before.view(loops, layers, -1, kv_heads, head_dim)
    copied = slots[mask] if masked else slots
    for token in range(planes.shape[2]):
        for t in range(loops):
            if t > loop and token in copied.tolist():
                assert torch.equal(planes[t, :, token], old[loop, :, token])
            else:
                assert torch.equal(planes[t, :, token], old[t, :, token])


def test_copy_forward_after_the_last_loop_is_a_no_op():
    pool = filled_pool(4, 2, 2, 4)
    before = pool.key_cache.clone()
    pool.copy_forward(torch.tensor([0, 3], device=DEVICE), 3)
    assert torch.equal(pool.key_cache, before)


@pytest.mark.parametrize("use_triton", [False, True])
def test_each_rows_own_loop_is_the_one_loop_copies_row_by_row(use_triton):
    """loop as a tensor (a chained pass's rows stopped after different loops): one call, each row from its
    own loop (the last loop's rows copy nothing), the same pools as a call per row."""
    loops, layers, kv_heads, head_dim = 4, 3, 2, 4
    slots = torch.tensor([1, 6, 13, 19, 7], dtype=torch.int64, device=DEVICE)
    loop = torch.tensor([0, 2, 1, 3, 0], dtype=torch.int64, device=DEVICE)
    mask = torch.tensor([True, True, True, True, False], device=DEVICE)
    expected, actual = (filled_pool(loops, layers, kv_heads, head_dim) for _ in range(2))
    slot_map = SlotMap(loops, layers)
    for row in range(4):
        copy_forward(expected.key_cache, expected.value_cache, slot_map, slots[row:row + 1], int(loop[row]),
                     use_triton=False)
    copy_forward(actual.key_cache, actual.value_cache, slot_map, slots, loop, mask, use_triton=use_triton)
    torch.testing.assert_close(actual.key_cache, expected.key_cache, rtol=0, atol=0)
    torch.testing.assert_close(actual.value_cache, expected.value_cache, rtol=0, atol=0)
