"""The attention backend interface (mini-sglang's hook shape) and what crosses it: Capabilities and the
step's AttentionMetadata. Backends by name, and their selection, are attention/registry.py's.

A backend is prepared once per step with `AttentionMetadata`, then called once per (loop, layer) with
the new tokens' q, k, v and the KV slot. Under depth batching (runner/depth_passes.py) the rows of one call
are at different loops: AttentionMetadata.slot_offsets moves each row from the call's slot to the same layer
of its own loop.
"""

from __future__ import annotations

import dataclasses
import itertools
from abc import ABC, abstractmethod
from typing import ClassVar

import torch


@dataclasses.dataclass(slots=True)
class Capabilities:
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    # Element dtypes of the KV pool it reads and writes (float8_e4m3fn: with one scale per slot and kv head)
    kv_cache_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16,
                                                torch.float8_e4m3fn)
    head_dims: tuple[int, ...] | None = None  # None: any head_dim
    devices: tuple[str, ...] = ("cpu", "cuda")
    kv_formats: tuple[str, ...] = ("paged",)
    cuda_graphs: bool = False
    packed_prefill: bool = False
    # False when prefill through the packed kernel is not bitwise equal to the decode path.
    packed_matches_decode: bool = True
    # Max |packed - per-row| the packed kernel promises, relative to max |reference| (None: exact).
    packed_prefill_tolerance: float | None = None
    # Attends over a KVarN pool (bind_packed): tiles and side rows, through the pool's own store and read.
    kvarn: bool = False
    # Engine(deterministic=True): a query's output has the same bits whatever else its step holds, and a
    # one-token row that is a prompt token takes the prompt path (AttentionMetadata.decode_rows).
    batch_invariant: bool = False
    # A prompt token's K/V and output are bitwise those of decoding it (so generated tokens' K/V may serve
    # as a cached prompt's); said by batch_invariant instances only.
    prefill_matches_decode: bool = False


@dataclasses.dataclass(slots=True)
class SharedKVMetadata:
    """Decode-time KV sharing (kv_sharing="last", arXiv 2510.25741 §5.4.2; cache/layout.py). Row i's first
    prompt_lens[i] context positions are prompt tokens, in the call's own (loop, layer) plane through
    block_tables. Position p >= prompt_lens[i] is generated token g = p - prompt_lens[i], stored once per
    layer: in page generated_block_tables[i, g // (loops * block_size)], plane
    (g % (loops * block_size)) // block_size * num_layers + layer, offset g % block_size. A generated row has
    one new token, its last position: stored there at every loop, so at loop t it attends to its own loop-t
    K/V and, once done, leaves its last loop's. Its slot_mapping entry is -1 (it is in no per-loop plane).
    """

    prompt_lens: torch.Tensor  # [B] int32
    generated_block_tables: torch.Tensor  # [B, max_pages] int32
    prompt_lens_cpu: list[int]
    loops: int
    num_layers: int  # slot = loop * num_layers + layer
    # A KVarN pool only: per row, the side tile of each generated tile (-1: none to read)
    generated_side_tables_cpu: list[list[int]] | None = None

    def select(self, rows: list[int], index: torch.Tensor) -> SharedKVMetadata:
        """The metadata of a subset of rows; index: the same rows as a device tensor."""
        side = self.generated_side_tables_cpu
        return SharedKVMetadata(self.prompt_lens[index], self.generated_block_tables[index],
                                [self.prompt_lens_cpu[r] for r in rows], self.loops, self.num_layers,
                                None if side is None else [side[r] for r in rows])


def side_table_tensor(tables: list[list[int]], width: int = 0) -> torch.Tensor:
    """Rows' side tables (block index -> side block) as one int32 [rows, max(width, longest)] host tensor
    (AttentionMetadata.side_tables), -1 past each table's end."""
    width = max(width, *(len(t) for t in tables), 1)
    return torch.tensor([table + [-1] * (width - len(table)) for table in tables],
                        dtype=torch.int32).view(len(tables), width)


@dataclasses.dataclass(slots=True)
class AttentionMetadata:
    """One step's batch, flattened. Built once per step by the runner; shared by every (loop, layer).

    Row i owns new tokens query_start_loc[i]:query_start_loc[i+1]. It attends to context_lens[i] tokens:
    its cached prefix plus its new tokens, causally. Position p of row i lives in block
    block_tables[i, p // block_size] at offset p % block_size, in every slot.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [N] int64: block * block_size + offset of each new token (-1: see below)
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    block_size: int
    shared_kv: SharedKVMetadata | None = None  # kv_sharing="last" only
    # A KVarN pool only: per row, the side block of each block of its table (-1: none to read); on the
    # device as [B, max_blocks] int32 (-1 past a table's end), where the runner uploads it
    side_tables_cpu: list[list[int]] | None = None
    side_tables: torch.Tensor | None = None
    # The one-token rows whose token is a generated one (not a prompt's); None: every one-token row. A
    # batch_invariant backend attends these the decode way and every other row the prompt way.
    decode_rows: list[int] | None = None
    # Depth batching: row i stores and reads its K/V in slot `slot + slot_offsets[i]` of a call's `slot`
    # (the call's layer, at the row's own loop: runner/depth_passes.py); None: every row in the call's slot.
    # On the device [B] int32, and on the host.
    slot_offsets: torch.Tensor | None = None
    slot_offsets_cpu: list[int] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_cpu, default=0)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def query_starts_cpu(self) -> list[int]:
        """query_start_loc on the host: row i's new tokens are query_starts_cpu[i]:query_starts_cpu[i+1]."""
        return [0, *itertools.accumulate(self.query_lens_cpu)]

    def select(self, rows: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """The metadata of a subset of rows (in order), and the indices of their new tokens."""
        device = self.query_start_loc.device
        starts = self.query_starts_cpu
        tokens = torch.tensor([t for r in rows for t in range(starts[r], starts[r + 1])], dtype=torch.int64)
        query_lens = [self.query_lens_cpu[r] for r in rows]
        query_start = [0, *itertools.accumulate(query_lens)]
        index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        tokens = tokens.to(device, non_blocking=True)
        sub = AttentionMetadata(
            torch.tensor(query_start, dtype=self.query_start_loc.dtype).to(device, non_blocking=True),
            self.context_lens[index], self.block_tables[index], self.slot_mapping[tokens], query_lens,
            [self.context_lens_cpu[r] for r in rows], self.block_size,
            self.shared_kv.select(rows, index) if self.shared_kv is not None else None,
            None if self.side_tables_cpu is None else [self.side_tables_cpu[r] for r in rows],
            None if self.side_tables is None else self.side_tables[index],
            None if self.decode_rows is None else [i for i, r in enumerate(rows) if r in self.decode_rows],
            None if self.slot_offsets is None else self.slot_offsets[index],
            None if self.slot_offsets_cpu is None else [self.slot_offsets_cpu[r] for r in rows])
        return sub, tokens

    def row_slots(self, slot: int) -> list[int]:
        """Each row's slot for a call in `slot` (slot_offsets applied)."""
        if self.slot_offsets_cpu is None:
            return [slot] * self.num_rows
        return [slot + offset for offset in self.slot_offsets_cpu]


class AttentionBackend(ABC):
    """Stores new K/V into the paged pool and attends over each row's context."""

    name: ClassVar[str]
    default_capabilities: ClassVar[Capabilities]
    # Capabilities a requirement may switch on for one instance.
    optional_capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities
        self.meta: AttentionMetadata | None = None
        self.packed_pool = None

    def bind(self, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
             kv_scales: torch.Tensor | None = None) -> None:
        """key_cache / value_cache: [num_slots, num_blocks, block_size, kv_heads, head_dim]. An fp8 pool comes
        with kv_scales [num_slots, 2, kv_heads] fp32 (key, then value scales; attention/fp8.py), read at
        every call, so they may change between steps."""
        if key_cache.dtype not in self.capabilities.kv_cache_dtypes:
            raise ValueError(f"attention backend {self.name!r} does not store K/V as {key_cache.dtype} "
                             f"(kv_cache_dtype); it stores "
                             f"{', '.join(str(d) for d in self.capabilities.kv_cache_dtypes)}")
        quantized = key_cache.dtype == torch.float8_e4m3fn
        if quantized and (kv_scales is None or kv_scales.shape != (key_cache.shape[0], 2, key_cache.shape[3])
                          or kv_scales.dtype != torch.float32):
            raise ValueError(f"an fp8 KV pool needs kv_scales of shape ({key_cache.shape[0]}, 2, "
                             f"{key_cache.shape[3]}) fp32, got "
                             f"{None if kv_scales is None else (tuple(kv_scales.shape), kv_scales.dtype)}")
        if not quantized and kv_scales is not None:
            raise ValueError(f"kv_scales belong to an fp8 KV pool, not a {key_cache.dtype} one")
        self.key_cache = key_cache
        self.value_cache = value_cache
        self.scale = scale
        self.kv_scales = kv_scales

    def bind_packed(self, pool, scale: float) -> None:
        """A KVarN pool (cache/kvarn_pool.py) instead of key and value caches: the backend calls its
        pack_filled, read and write_side."""
        if not self.capabilities.kvarn:
            raise ValueError(f"attention backend {self.name!r} has no path for a KVarN KV pool "
                             "(kv_cache_dtype='kvarn_*'); attention='torch' and 'triton' have")
        self.packed_pool, self.scale = pool, scale

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step, before the first forward."""
        self.meta = meta

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """q: [N, heads, D]; k, v: [N, kv_heads, D]. Stores k, v in `slot`, returns [N, heads, D]."""

    def capture_begin(self, max_rows: int) -> None:
        """Before a CUDA-graph capture: switch to graph-safe kernels and graph-owned buffers."""

    def capture_end(self) -> None:
        """After a capture: back to eager behaviour."""

    def check(self, dtype: torch.dtype | None, head_dim: int, device: torch.device) -> None:
        """The model dtype (None: not checked), head_dim and device against the capabilities."""
        caps = self.capabilities
        if dtype is not None and dtype not in caps.dtypes:
            raise ValueError(f"attention backend {self.name!r} does not support dtype {dtype}")
        if caps.head_dims is not None and head_dim not in caps.head_dims:
            raise ValueError(f"attention backend {self.name!r} does not support head_dim {head_dim} (it "
                             f"supports {', '.join(map(str, caps.head_dims))}); attention='torch' runs any")
        if device.type not in caps.devices:
            raise ValueError(f"attention backend {self.name!r} does not run on device {device.type!r}")
