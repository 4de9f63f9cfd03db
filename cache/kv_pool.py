"""The KV tensors: one key and one value pool, each addressed by (slot, block, offset), and the one
operation that moves K/V between slots (copy-forward after an early exit, cache/copy_forward.py).

The model's slot map (model/looped.py: SlotMap) says how many slots a token has and which layer each is
(Ouro's slot = loop * num_layers + layer). A block id names the same token range in every slot, so one block
table per request serves them all, and a block costs num_slots * 2 * block_size * kv_heads * head_dim *
dtype bytes. Where a token's K/V sits is the KV layout's business (cache/layout.py).

An fp8_e4m3 pool (dtype torch.float8_e4m3fn) also holds `kv_scales` [num_slots, 2, kv_heads] fp32: per slot
the key scales, then the value scales, one per kv head (attention/fp8.py). They start at 1.0, vLLM's default
for a checkpoint without calibrated scales, and `set_kv_scales` replaces them before the first token is
stored.
"""

from __future__ import annotations

import torch

from attention.fp8 import FP8_DTYPE
from cache.copy_forward import copy_forward
from model.looped import SlotMap


def slot_token_bytes(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K + V bytes of one token in one slot."""
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(self, slot_map: SlotMap, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, loop_uniform_scales: bool = False) -> None:
        """loop_uniform_scales: K/V moves between the slots of a layer as bytes (copy-forward after an early
        exit, kv_sharing="last"), so an fp8 pool's scales may not differ between them."""
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.slot_map = slot_map
        shape = (slot_map.num_slots, num_blocks, block_size, kv_heads, head_dim)
        # Unwritten positions are never read (attention masks past each row's context), so no fill.
        self.key_cache = torch.empty(shape, dtype=dtype, device=device)
        self.value_cache = torch.empty(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slot_token_bytes = slot_token_bytes(kv_heads, head_dim, dtype)
        self.kv_scales = (torch.ones(slot_map.num_slots, 2, kv_heads, dtype=torch.float32, device=device)
                          if dtype == FP8_DTYPE else None)
        self.loop_uniform_scales = loop_uniform_scales

    def set_kv_scales(self, key_scales: torch.Tensor, value_scales: torch.Tensor) -> None:
        """fp8 pools: the scales of every (slot, kv head), [num_slots, kv_heads] each, finite and positive
        (and equal over the slots of a layer, slot_map.physical_layer, where the pool says
        loop_uniform_scales)."""
        if self.kv_scales is None:
            raise ValueError(f"kv scales belong to an fp8_e4m3 pool; this one is {self.key_cache.dtype}")
        shape = self.kv_scales[:, 0].shape
        for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
            if not isinstance(scales, torch.Tensor) or scales.shape != shape:
                raise ValueError(f"{name} must be a tensor of shape {tuple(shape)} (slots, kv heads), got "
                                 f"{getattr(scales, 'shape', type(scales).__name__)}")
            if not (torch.isfinite(scales).all() and (scales > 0).all()):
                raise ValueError(f"{name} must be finite and positive")
            if self.loop_uniform_scales:
                if not (scales == scales[self._first_slot_of_layer()]).all():
                    raise ValueError(f"{name} differ between the loops of a layer, but this KV layout copies "
                                     "K/V between loops (early exit or kv_sharing='last')")
        self.kv_scales[:, 0] = key_scales.to(self.kv_scales)
        self.kv_scales[:, 1] = value_scales.to(self.kv_scales)

    def _first_slot_of_layer(self) -> list[int]:
        """Per slot, the first slot that runs the same layer."""
        first: dict[int, int] = {}
        return [first.setdefault(self.slot_map.physical_layer(slot), slot) for slot in range(self.num_slots)]

    @property
    def num_slots(self) -> int:
        return self.slot_map.num_slots

    @property
    def num_bytes(self) -> int:
        return 2 * self.key_cache.numel() * self.key_cache.element_size()

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token in every slot (a prompt token's cost, in any layout)."""
        return self.num_slots * self.slot_token_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.num_slots * self.block_size * self.slot_token_bytes

    def copy_forward(self, slots: torch.Tensor, loop: int | torch.Tensor, mask: torch.Tensor | None = None
                     ) -> None:
        """Every loop layer's deeper slots (slot_map.deeper_slots) get the loop-`loop` K/V of the tokens at
        in-plane indices `slots` ([n] int64, block * block_size + offset): what a token that stopped after
        `loop` (or each row's, [n] on the device) leaves for the deeper loops of later tokens to read. mask
        ([n] bool, on the device): only those rows, decided without a host sync (cache/copy_forward.py; one
        launch on CUDA)."""
        copy_forward(self.key_cache, self.value_cache, self.slot_map, slots, loop, mask)

    @staticmethod
    def blocks_for_budget(bytes_per_block: int, budget_bytes: float) -> int:
        return int(budget_bytes // bytes_per_block)
