"""Per-token KV formats: one element per (slot, block, offset, kv head, dim) in a KVPool (cache/kv_pool.py),
bound to a backend as key and value caches.

    auto       K/V in the model's dtype
    bf16       K/V in bfloat16 whatever the model's dtype
    fp8_e4m3   8-bit float K/V, one fp32 scale per (slot, kv head) (attention/fp8.py)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from attention.base import AttentionBackend
from cache.kv_format import KVFormat, PoolShape
from cache.kv_pool import KVPool
from cache.side_rows import SideRows


@dataclasses.dataclass(frozen=True)
class DenseFormat(KVFormat):
    storage: torch.dtype | None = None  # the element dtype; None: the model's
    kind: ClassVar[str] = "dense"

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The element dtype of the pool."""
        return model_dtype if self.storage is None else self.storage

    def packed_token_bytes(self, kv_heads: int, head_dim: int) -> float:
        return 2 * kv_heads * head_dim * self.key_bits // 8

    def make_pool(self, shape: PoolShape, num_blocks: int, side_rows: SideRows | None,
                  device: torch.device) -> KVPool:
        return KVPool(shape.slot_map, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim,
                      self.storage_dtype(shape.dtype), device, loop_uniform_scales=shape.loop_uniform_scales)

    def bind(self, backend: AttentionBackend, pool: KVPool, scale: float) -> None:
        backend.bind(pool.key_cache, pool.value_cache, scale, pool.kv_scales)


@dataclasses.dataclass(frozen=True)
class FP8Format(DenseFormat):
    """8-bit float elements with one scale per (slot, kv head): the pool holds kv_scales too."""

    kind: ClassVar[str] = "fp8"

    def check_options(self, values: dict[str, Any]) -> None:
        super().check_options(values)
        if values.get("packed_prefill"):
            raise ValueError(f"kv_cache_dtype={self.name!r} cannot be combined with packed_prefill=True: "
                             "packed prefill reads the new K/V from the step's inputs, not through the fp8 "
                             "cache that decode reads")
