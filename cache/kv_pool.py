"""The KV tensors: one key and one value pool, each addressed by (slot, block, offset), and the one
operation that moves K/V between slots (copy-forward after an early exit, cache/copy_forward.py).

slot = loop * num_layers + layer. A block id names the same token range in every slot, so one block
table per request serves all T x L slots, and a block costs T * L * 2 * block_size * kv_heads *
head_dim * dtype bytes. Where a token's K/V sits is the KV layout's business (cache/layout.py).
"""

from __future__ import annotations

import torch

from cache.copy_forward import copy_forward


def slot_token_bytes(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K + V bytes of one token in one (loop, layer) slot."""
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(self, loops: int, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.loops, self.num_layers = loops, num_layers
        shape = (loops * num_layers, num_blocks, block_size, kv_heads, head_dim)
        # Unwritten positions are never read (attention masks past each row's context), so no fill.
        self.key_cache = torch.empty(shape, dtype=dtype, device=device)
        self.value_cache = torch.empty(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slot_token_bytes = slot_token_bytes(kv_heads, head_dim, dtype)

    @property
    def num_slots(self) -> int:
        return self.loops * self.num_layers

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

    def copy_forward(self, slots: torch.Tensor, loop: int, mask: torch.Tensor | None = None) -> None:
        """Every layer's slots of loops > `loop` get the loop-`loop` K/V of the tokens at in-plane indices
        `slots` ([n] int64, block * block_size + offset): what a token that stopped after `loop` leaves
        for the deeper loops of later tokens to read. mask ([n] bool, on the device): only those rows, decided
        without a host sync (cache/copy_forward.py; one launch on CUDA)."""
        copy_forward(self.key_cache, self.value_cache, self.loops, slots, loop, mask)

    @staticmethod
    def blocks_for_budget(bytes_per_block: int, budget_bytes: float) -> int:
        return int(budget_bytes // bytes_per_block)
