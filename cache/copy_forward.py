"""Copy-forward: a token that stopped looping after loop t leaves its loop-t K/V in the slots of loops
t+1..T-1 (every loop layer: model/looped.py, SlotMap.deeper_slots), where later tokens' deeper loops read it.
Over a ring of K loops (compress:k) the same within the ring: a token that stopped after loop t < K-1 leaves
it in ring loops t+1..K-1, which it never wrote; past K-1 every ring loop holds its own last write.
One Triton launch on CUDA, for every stopped token and both pools; optionally masked on the device, so that a
captured loop graph copies exactly the rows whose exit it just decided, with no host round trip. Elsewhere
(CPU), plain indexing.

The pools are [num_slots, blocks, block_size, kv_heads, head_dim], contiguous. A slot map's loop slots are
one run of T x C planes (K x C with a ring; slot(t, l) = slot(0, 0) + t * C + l), viewed here as [T, C]; an
in-plane index s = block * block_size + offset addresses one token's kv_heads * head_dim values.
"""

from __future__ import annotations

import torch

from model.looped import SlotMap


def copy_forward(key_cache: torch.Tensor, value_cache: torch.Tensor, slot_map: SlotMap, slots: torch.Tensor,
                 loop: int | torch.Tensor, mask: torch.Tensor | None = None, use_triton: bool | None = None
                 ) -> None:
    """Each loop layer's deeper slots get its loop-`loop` K/V of the tokens at in-plane indices `slots` ([n]
    int64); loop a tensor ([n] int64, on the device): each row's own loop (one launch on CUDA for rows that
    stopped after different loops). mask ([n] bool): copy only those rows (on the device: no host sync).
    use_triton: default on CUDA."""
    loops, per_row = slot_map.stored_loops, isinstance(loop, torch.Tensor)
    if slots.numel() == 0 or not per_row and loop + 1 >= loops:
        return
    if use_triton is None:
        use_triton = key_cache.is_cuda
    if use_triton:
        _copy(key_cache, value_cache, slot_map, slots, loop, mask)
        return
    if per_row:  # one loop at a time
        for t in range(loops - 1):
            at = loop == t
            copy_forward(key_cache, value_cache, slot_map, slots, t, at if mask is None else at & mask, False)
        return
    key_cache, value_cache, plane_tokens = _loop_planes(key_cache, value_cache, slot_map)
    if mask is not None:
        slots = slots[mask]
    deeper = loops - loop - 1
    layers = slot_map.loop_layers
    for cache in (key_cache, value_cache):
        planes = cache.view(loops, layers, plane_tokens, *cache.shape[3:])  # [T, C, tokens, kvh, D]
        source = planes[loop].index_select(1, slots)
        planes[loop + 1:].index_copy_(2, slots, source.expand(deeper, *source.shape))


def _loop_planes(key_cache: torch.Tensor, value_cache: torch.Tensor, slot_map: SlotMap
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The pools' loop planes (fp8 as bytes: CPU index_copy_ has no float8 kernel) and a plane's tokens."""
    if key_cache.element_size() == 1:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    first, planes = slot_map.slot(0, 0), slot_map.stored_loops * slot_map.loop_layers
    key_cache, value_cache = (cache[first:first + planes] for cache in (key_cache, value_cache))
    return key_cache, value_cache, key_cache.shape[1] * key_cache.shape[2]


def _copy(key_cache: torch.Tensor, value_cache: torch.Tensor, slot_map: SlotMap, slots: torch.Tensor,
          loop: int | torch.Tensor, mask: torch.Tensor | None) -> None:
    """The Triton launch: one program per (row, loop layer)."""
    from cache.copy_forward_kernel import copy_forward_kernel  # Triton only where it runs

    key_cache, value_cache, plane_tokens = _loop_planes(key_cache, value_cache, slot_map)
    row = key_cache[0, 0, 0].numel()
    per_row = isinstance(loop, torch.Tensor)
    copy_forward_kernel[(slots.numel(), slot_map.loop_layers)](
        key_cache, value_cache, slots, mask if mask is not None else slots, 0 if per_row else loop,
        loop if per_row else slots, plane_tokens, LOOPS=slot_map.stored_loops, LAYERS=slot_map.loop_layers,
        ROW=row, BLOCK=1 << (row - 1).bit_length(), MASKED=mask is not None, ROW_LOOPS=per_row, num_warps=4)
