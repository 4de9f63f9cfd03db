"""KV cache formats: what a `kv_cache_dtype` string means, which tile shapes are valid, and what a token
costs.

    auto               K/V in the model's dtype, one (loop, layer) slot per token
    bf16               K/V in bfloat16 whatever the model's dtype
    fp8_e4m3           8-bit float K/V, one fp32 scale per (slot, kv head) (attention/fp8.py)
    kvarn_kXvY_gG      KVarN (arXiv 2606.03458): tiles of G tokens x head_dim per (block, kv head), Hadamard-
                       rotated, variance-normalized, X-bit keys and Y-bit values with fp16 scales
                       (cache/kvarn.py); the first `sink` and newest `tail` tokens and the unfilled tile stay
                       in high precision in a side pool (cache/kvarn_pool.py)

A KVarN tile stores, per kv head: the key codes (G x D x key_bits), a per-channel key scale and zero and a
per-token key scale; the value codes (G x D x value_bits), a per-channel value scale and a per-token value
scale and zero; every scale fp16. Parsing is fail-closed: a string that is not one of these raises a
ValueError naming `kv_cache_dtype` and the valid names.
"""

from __future__ import annotations

import dataclasses

import torch

from attention.fp8 import FP8_DTYPE

KVARN_PRESETS = {
    "kvarn_k4v2_g64": (4, 2, 64),
    "kvarn_k4v2_g128": (4, 2, 128),
    "kvarn_k4v4_g64": (4, 4, 64),
    "kvarn_k4v4_g128": (4, 4, 128),
    "kvarn_k5v5_g64": (5, 5, 64),
}
DENSE = ("auto", "bf16")
FP8 = ("fp8_e4m3",)
SCALE_BYTES = 2  # fp16


@dataclasses.dataclass(frozen=True)
class KVFormat:
    name: str
    key_bits: int
    value_bits: int
    group: int | None = None  # tile tokens (KVarN); None: per-token storage
    kind: str = "dense"  # "dense", "fp8" or "kvarn"

    @property
    def quantized(self) -> bool:
        return self.kind != "dense"

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The element dtype of a per-token pool in this format (dense and fp8)."""
        if self.kind == "kvarn":
            raise ValueError(f"kv_cache_dtype {self.name!r} stores packed tiles, not per-token elements")
        if self.kind == "fp8":
            return FP8_DTYPE
        return model_dtype if self.name == "auto" else torch.bfloat16

    def tile_bytes(self, head_dim: int) -> int:
        """KVarN: bytes of one packed tile (keys and values) of one kv head, scales included."""
        if self.kind != "kvarn":
            raise ValueError(f"kv_cache_dtype {self.name!r} has no tiles")
        g, d = self.group, head_dim
        # codes, then the channel scale and zero and the token scale (keys); the channel scale and the token
        # scale and zero (values)
        keys = g * d * self.key_bits // 8 + SCALE_BYTES * (2 * d + g)
        values = g * d * self.value_bits // 8 + SCALE_BYTES * (d + 2 * g)
        return keys + values

    def packed_token_bytes(self, kv_heads: int, head_dim: int) -> float:
        """K + V bytes per token in one (loop, layer) slot, in packed storage (no side pool)."""
        if self.kind == "kvarn":
            return kv_heads * self.tile_bytes(head_dim) / self.group
        element = 2 if self.kind == "dense" else 1
        return 2 * kv_heads * head_dim * element

    def sequence_bytes(self, tokens: int, slots: int, kv_heads: int, head_dim: int, sink: int = 0,
                       tail: int = 0, high_precision_bytes: int = 2) -> int:
        """Bytes one sequence of `tokens` holds in `slots` (loop, layer) slots: packed tiles for every full
        tile, plus, for KVarN, the side pool's high-precision rows (the first `sink` tokens, the newest `tail`
        tokens and the unfilled tile, counted once each)."""
        row = 2 * kv_heads * head_dim * high_precision_bytes  # one token's K + V in one slot, high precision
        if self.kind != "kvarn":
            return int(slots * tokens * self.packed_token_bytes(kv_heads, head_dim))
        full = tokens // self.group
        packed = full * kv_heads * self.tile_bytes(head_dim)
        return slots * (packed + high_precision_rows(tokens, self.group, sink, tail) * row)


def high_precision_rows(tokens: int, group: int, sink: int, tail: int) -> int:
    """Tokens of a `tokens`-long sequence whose K/V the side pool holds: the first `sink`, the newest `tail`
    and the unfilled tile's, each counted once."""
    partial = tokens % group
    rows = set(range(min(sink, tokens)))
    rows.update(range(max(0, tokens - max(tail, partial)), tokens))
    return len(rows)


def parse_kv_cache_dtype(name: object) -> KVFormat:
    if isinstance(name, str):
        if name in DENSE:
            return KVFormat(name, 16, 16)
        if name in FP8:
            return KVFormat(name, 8, 8, kind="fp8")
        if name in KVARN_PRESETS:
            key_bits, value_bits, group = KVARN_PRESETS[name]
            return KVFormat(name, key_bits, value_bits, group, "kvarn")
    valid = ", ".join((*DENSE, *FP8, *KVARN_PRESETS))
    raise ValueError(f"kv_cache_dtype must be one of {valid}; got {name!r}")


def check_tile_dims(group: int, head_dim: int) -> None:
    """A KVarN tile needs power-of-two dims: the Hadamard rotation is over head_dim, and codes pack whole
    bytes per token row."""
    for what, value in (("tile tokens (group)", group), ("head_dim", head_dim)):
        if value < 8 or value & (value - 1):
            raise ValueError(f"KVarN needs a power-of-two {what} of at least 8, got {value}")
