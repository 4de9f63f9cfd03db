"""What a KV cache format is (`kv_cache_dtype`): how K/V is stored and what a token costs, which options it
takes, the KV pool that holds it, and how an attention backend binds to that pool. Each format lives in a file
of its own (cache/dense_format.py, cache/kvarn_format.py) and is registered by name in cache/kv_formats.py;
the engine calls a format's methods and never asks which one it has.

A new format is a KVFormat subclass: make_pool and bind at least; side_rows, side_bytes and
scratch_side_block where its pool keeps rows apart from its blocks (as KVarN's high-precision rows).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import torch

from attention.base import AttentionBackend
from cache.side_rows import SideRows
from model.looped import SlotMap


@dataclasses.dataclass(frozen=True, slots=True)
class PoolShape:
    """What a KV pool is built from, besides its block count: the model's shape and the engine's options."""

    slot_map: SlotMap  # the model's (loop, layer) slots (model/looped.py)
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's
    max_num_seqs: int
    sink_tokens: int = 0  # KVarN: the first positions kept in high precision
    tail_tokens: int = 0  # KVarN: the newest positions kept in high precision
    rotate: bool = True  # KVarN: the Hadamard rotation before normalizing
    batch_invariant: bool = False  # deterministic mode
    generated_apart: bool = False  # kv_sharing="last": generated tokens keep their last loop's K/V only
    # K/V moves between the loops of a layer as bytes (copy-forward after an early exit, kv_sharing="last"),
    # so an fp8 pool's scales may not differ between them
    loop_uniform_scales: bool = False


class Pool(Protocol):
    """What the engine reads of any format's pool (cache/kv_pool.py: KVPool; cache/kvarn_pool.py:
    KVarNPool)."""

    block_size: int
    slot_token_bytes: float  # one token's K + V in one (loop, layer) slot

    @property
    def bytes_per_block(self) -> int: ...

    @property
    def num_bytes(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class KVFormat(ABC):
    name: str
    key_bits: int
    value_bits: int
    group: int | None = None  # tile tokens (KVarN); None: per-token storage
    kind: ClassVar[str]  # the family: "dense", "fp8" or "kvarn"

    def tile_bytes(self, head_dim: int) -> int:
        """Bytes of one packed tile (keys and values) of one kv head, scales included."""
        raise ValueError(f"kv_cache_dtype {self.name!r} has no tiles")

    @abstractmethod
    def packed_token_bytes(self, kv_heads: int, head_dim: int) -> float:
        """K + V bytes per token in one (loop, layer) slot, in packed storage (no side pool)."""

    def sequence_bytes(self, tokens: int, slots: int, kv_heads: int, head_dim: int, sink: int = 0,
                       tail: int = 0, high_precision_bytes: int = 2) -> int:
        """Bytes one sequence of `tokens` holds in `slots` (loop, layer) slots (sink, tail and
        high_precision_bytes: a format with high-precision rows)."""
        return int(slots * tokens * self.packed_token_bytes(kv_heads, head_dim))

    # -- the options it takes ------------------------------------------------------------------------

    def check_options(self, values: dict[str, Any]) -> None:
        """The plain options (engine_config.check_options' values) this format cannot take: ValueError naming
        them (fail-closed: never a silent fallback to another format). High-precision rows and their rotation
        are KVarN's: any other format refuses them."""
        for option in ("kv_sink_tokens", "kv_tail_tokens"):
            tokens = values.get(option, 0)
            if tokens:
                raise ValueError(f"{option}={tokens} applies to the KVarN formats only, not "
                                 f"kv_cache_dtype={self.name!r}")
        if not values.get("kv_rotation", True):
            raise ValueError(f"kv_rotation=False applies to the KVarN formats only, not "
                             f"kv_cache_dtype={self.name!r}")

    def check_engine(self, values: dict[str, Any], backend: str, head_dim: int) -> None:
        """The options, the attention backend (its resolved name) and the checkpoint's head_dim this format
        cannot serve: ValueError naming them."""

    def deterministic_refusal(self, backend: str) -> str | None:
        """Why deterministic mode cannot store K/V in this format on the backend (None: it can)."""
        return None

    # -- its pool, and a backend bound to it -----------------------------------------------------------

    def side_rows(self, shape: PoolShape) -> SideRows | None:
        """Who owns the pool's rows kept apart from its blocks (None: it keeps none)."""
        return None

    @abstractmethod
    def make_pool(self, shape: PoolShape, num_blocks: int, side_rows: SideRows | None,
                  device: torch.device) -> Pool:
        """A pool of num_blocks blocks (and, given side_rows, room for them and their scratch rows)."""

    def side_bytes(self, probe: Pool, side_rows: SideRows | None) -> int:
        """The bytes of the side rows a pool like `probe` (a one-block pool) needs beside its blocks."""
        return 0

    def scratch_side_block(self, side_rows: SideRows | None) -> int | None:
        """The side block that graph padding rows write (None: the pool keeps no side rows)."""
        return None

    @abstractmethod
    def bind(self, backend: AttentionBackend, pool: Pool, scale: float) -> None:
        """Hand the pool to the backend, which stores and reads K/V through it from then on."""


def high_precision_rows(tokens: int, group: int, sink: int, tail: int) -> int:
    """Tokens of a `tokens`-long sequence whose K/V the side pool holds: the first `sink`, the newest `tail`
    and the unfilled tile's, each counted once."""
    partial = tokens % group
    rows = set(range(min(sink, tokens)))
    rows.update(range(max(0, tokens - max(tail, partial)), tokens))
    return len(rows)


def check_tile_dims(group: int, head_dim: int) -> None:
    """A KVarN tile needs power-of-two dims: the Hadamard rotation is over head_dim, and codes pack whole
    bytes per token row."""
    for what, value in (("tile tokens (group)", group), ("head_dim", head_dim)):
        if value < 8 or value & (value - 1):
            raise ValueError(f"KVarN needs a power-of-two {what} of at least 8, got {value}")
