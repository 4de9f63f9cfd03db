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
                 loop: int, mask: torch.Tensor | None = None, use_triton: bool | None = None) -> None:
    """Each loop layer's deeper slots get its loop-`loop` K/V of the tokens at in-plane indices `slots` ([n]
    int64). mask ([n] bool): copy only those rows (on the device: no host sync). use_triton: default on
    CUDA."""
    loops, layers = slot_map.stored_loops, slot_map.loop_layers
    if loop + 1 >= loops or slots.numel() == 0:
        return
    if use_triton is None:
        use_triton = key_cache.is_cuda
    if key_cache.element_size() == 1:  # fp8: copied as bytes (CPU index_copy_ has no float8 kernel)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    first = slot_map.slot(0, 0)
    key_cache, value_cache = (cache[first:first + loops * layers] for cache in (key_cache, value_cache))
    row = key_cache[0, 0, 0].numel()
    plane_tokens = key_cache.shape[1] * key_cache.shape[2]
    if use_triton:
        from cache.copy_forward_kernel import copy_forward_kernel  # Triton only where it runs

        copy_forward_kernel[(slots.numel(), layers)](
            key_cache, value_cache, slots, mask if mask is not None else slots, loop, plane_tokens,
            LOOPS=loops, LAYERS=layers, ROW=row, BLOCK=1 << (row - 1).bit_length(), MASKED=mask is not None,
            num_warps=4)
        return
    if mask is not None:
        slots = slots[mask]
    deeper = loops - loop - 1
    for cache in (key_cache, value_cache):
        planes = cache.view(loops, layers, plane_tokens, *cache.shape[3:])  # [T, C, tokens, kvh, D]
        source = planes[loop].index_select(1, slots)
        planes[loop + 1:].index_copy_(2, slots, source.expand(deeper, *source.shape))
