"""The KV tensors: one key and one value pool, each addressed by (slot, block, offset).

slot = loop * num_layers + layer. A block id names the same token range in every slot, so one block
table per request serves all T x L slots, and a block costs T * L * 2 * block_size * kv_heads *
head_dim * dtype bytes.
"""

from __future__ import annotations

import torch

from model.config import OuroConfig


def kv_bytes_per_token(config: OuroConfig, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_slots * 2 * config.kv_size * element


class KVPool:
    def __init__(self, config: OuroConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        shape = (config.num_slots, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Unwritten positions are never read (attention masks past each row's context), so no fill.
        self.key_cache = torch.empty(shape, dtype=dtype, device=device)
        self.value_cache = torch.empty(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = kv_bytes_per_token(config, dtype)

    @property
    def num_bytes(self) -> int:
        return 2 * self.key_cache.numel() * self.key_cache.element_size()

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def blocks_for_budget(config: OuroConfig, block_size: int, dtype: torch.dtype,
                          budget_bytes: float) -> int:
        return int(budget_bytes // (kv_bytes_per_token(config, dtype) * block_size))
