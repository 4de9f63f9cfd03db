"""The KVarN formats (arXiv 2606.03458), `kv_cache_dtype="kvarn_kXvY_gG"`: tiles of G tokens x head_dim per
(block, kv head), Hadamard-rotated, variance-normalized, X-bit keys and Y-bit values with fp16 scales
(cache/kvarn.py); the first `sink` and newest `tail` tokens and the unfilled tile stay in high precision in
side rows (cache/side_rows.py), in a KVarNPool (cache/kvarn_pool.py) that a backend binds as one packed pool.

A KVarN tile stores, per kv head: the key codes (G x D x key_bits), a per-channel key scale and zero and a
per-token key scale; the value codes (G x D x value_bits), a per-channel value scale and a per-token value
scale and zero; every scale fp16.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from attention.base import AttentionBackend
from cache.layout import parse_kv_layout
from cache.kv_format import KVFormat, PoolShape, check_tile_dims, high_precision_rows
from cache.kvarn_pool import KVarNPool
from cache.side_rows import SideRows

KVARN_PRESETS = {
    "kvarn_k4v2_g64": (4, 2, 64),
    "kvarn_k4v2_g128": (4, 2, 128),
    "kvarn_k4v4_g64": (4, 4, 64),
    "kvarn_k4v4_g128": (4, 4, 128),
    "kvarn_k5v5_g64": (5, 5, 64),
}
SCALE_BYTES = 2  # fp16


@dataclasses.dataclass(frozen=True)
class KVarNFormat(KVFormat):
    kind: ClassVar[str] = "kvarn"

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        raise ValueError(f"kv_cache_dtype {self.name!r} stores packed tiles, not per-token elements")

    def tile_bytes(self, head_dim: int) -> int:
        g, d = self.group, head_dim
        # codes, then the channel scale and zero and the token scale (keys); the channel scale and the token
        # scale and zero (values)
        keys = g * d * self.key_bits // 8 + SCALE_BYTES * (2 * d + g)
        values = g * d * self.value_bits // 8 + SCALE_BYTES * (d + 2 * g)
        return keys + values

    def packed_token_bytes(self, kv_heads: int, head_dim: int) -> float:
        return kv_heads * self.tile_bytes(head_dim) / self.group

    def sequence_bytes(self, tokens: int, slots: int, kv_heads: int, head_dim: int, sink: int = 0,
                       tail: int = 0, high_precision_bytes: int = 2) -> int:
        """Packed tiles for every full tile, plus the side rows' high-precision rows (the first `sink` tokens,
        the newest `tail` tokens and the unfilled tile, counted once each)."""
        row = 2 * kv_heads * head_dim * high_precision_bytes  # one token's K + V in one slot, high precision
        full = tokens // self.group
        packed = full * kv_heads * self.tile_bytes(head_dim)
        return slots * (packed + high_precision_rows(tokens, self.group, sink, tail) * row)

    def check_options(self, values: dict[str, Any]) -> None:
        """Sink and tail rows and the rotation are KVarN's own options: any values engine_config accepts."""

    def check_engine(self, values: dict[str, Any], backend: str, head_dim: int) -> None:
        """What the KVarN pool supports today: the torch backend's reference path and the Triton backend's
        (CUDA graphs for decode steps, piecewise graphs for prefill), tiles of block_size tokens, prefix
        caching and preemption, kv_sharing="last" on the torch backend, and nothing else that moves K/V
        between loops or rewinds it. Fail-closed: each other combination is a ValueError naming the
        options."""
        name = f"kv_cache_dtype={self.name!r}"
        try:
            check_tile_dims(self.group, head_dim)
        except ValueError as err:
            raise ValueError(f"{name} cannot serve this checkpoint: {err}") from None
        attention, policy, speculative = values["attention"], values["exit_policy"], values["speculative"]
        refused = [
            (backend not in ("torch", "triton"), f"runs on attention='torch' or 'triton', got "
                                                 f"attention={attention!r}"),
            (values["packed_prefill"], "cannot be combined with packed_prefill=True"),
            (values["block_size"] != self.group, f"needs block_size={self.group} (one tile per block), got "
                                                 f"{values['block_size']}"),
            (values["kv_sharing"] != "none" and backend != "torch",
             f"with kv_sharing={values['kv_sharing']!r} runs on attention='torch' only (the Triton KVarN "
             f"kernels do not read generated pages yet), got attention={attention!r}"),
            (policy.can_exit, f"cannot be combined with exit_policy={str(policy)!r} (copy-forward of packed "
                              "tiles)"),
            (values.get("kv_layout") is not None
             and parse_kv_layout(values["kv_layout"]).compress is not None,
             f"cannot be combined with kv_layout={values.get('kv_layout')!r} (a ring rewrites a slot's "
             f"packed tiles within a step)"),
            (speculative is not None, f"cannot be combined with speculative={speculative!r}"),
            (not values["kv_rotation"] and backend != "torch",
             f"with kv_rotation=False runs on attention='torch' only (the Triton KVarN kernels rotate), got "
             f"attention={attention!r}"),
        ]
        for bad, why in refused:
            if bad:
                raise ValueError(f"{name} {why}")

    def deterministic_refusal(self, backend: str) -> str | None:
        if backend == "triton":
            return (f"cannot be combined with kv_cache_dtype={self.name!r} on attention='triton' yet (its "
                    f"KVarN kernels are not batch-invariant; the torch backend's tiles are)")
        return None

    def side_rows(self, shape: PoolShape) -> SideRows:
        """The pool's high-precision rows: the sink, tail and unfilled tile of max_num_seqs sequences."""
        return SideRows(shape.max_num_seqs, shape.block_size, shape.sink_tokens, shape.tail_tokens,
                        generated_apart=shape.generated_apart)

    def make_pool(self, shape: PoolShape, num_blocks: int, side_rows: SideRows | None,
                  device: torch.device) -> KVarNPool:
        """With side_rows: one side block more than they hand out, the scratch side block that graph padding
        rows write (and, under kv_sharing="last", their generated side tiles)."""
        side_blocks, generated_side_tiles = self._side_planes(side_rows)
        return KVarNPool(self, shape.slot_map, num_blocks, shape.kv_heads, shape.head_dim, shape.dtype,
                         device, shape.sink_tokens, shape.tail_tokens, side_blocks,
                         generated_side_tiles=generated_side_tiles, rotate=shape.rotate,
                         batch_invariant=shape.batch_invariant)

    def side_bytes(self, probe: KVarNPool, side_rows: SideRows | None) -> int:
        return probe.side_bytes_for(*self._side_planes(side_rows))

    def scratch_side_block(self, side_rows: SideRows | None) -> int | None:
        return None if side_rows is None else side_rows.capacity

    def bind(self, backend: AttentionBackend, pool: KVarNPool, scale: float) -> None:
        backend.bind_packed(pool, scale)

    @staticmethod
    def _side_planes(side_rows: SideRows | None) -> tuple[int, int]:
        """Side blocks (the rows' and the scratch one) and generated side tiles of a pool for side_rows."""
        if side_rows is None:
            return 0, 0
        return side_rows.capacity + 1, side_rows.generated_capacity
