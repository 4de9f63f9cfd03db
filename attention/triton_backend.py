"""The Triton backend, host side: per-step launch plans, the split rule, workspace use and launches.

A decode step costs one launch per (loop, layer) call: the decode kernel stores the new K/V, attends
over its split and merges the splits in the same launch, through a ticket per (row, head). A step with
prefill rows first stores every new token's K/V (kv_store), then runs the prefill kernel on rows with
several new tokens and the decode kernel on rows with one. An instance selected with packed_prefill sends
prefill rows that have no cached prefix to the packed kernel instead. Under CUDA-graph capture (decode steps
only) the decode launch is the same, over a partial buffer and tickets that this instance owns: the tickets
are made before the capture (by the warm-up run that precedes it) and the kernel leaves them at zero.
Kernels are in attention/kernels/. Where the GPU and Triton allow it (triton_runtime/pdl.py) every kernel is
launched with Programmatic Dependent Launch.

Split rule (SplitRule). A row of context c gets min(cap, max(1, ceil(c / keys))) splits, each a multiple of
the key tile, where keys is short_split_keys for a row of at most short_context keys and split_min_keys
for a longer one; the grid is rows x heads x splits programs. cap = 2 * SMs / kv_heads, rounded down to a
power of two, so one long row alone gives about two programs per SM; with many rows, rows and heads fill the
SMs by themselves and split_min_keys (512) keeps each program streaming enough keys that merge traffic
stays small. A short row is latency-bound instead: smaller splits put more SMs on its few keys, each
program with fewer tiles in a row. Rows are deliberately left out of the count: it depends on the row's own
context only, so a row's output is the same bits in any batch and in eager and graph mode alike (the
graph's grid simply has room for every context its block table can hold).

A KVarN pool (bind_packed) takes attention/triton_kvarn.py's path instead: the KVarN pack, prefill and
decode kernels, with its step plan made on the device under CUDA-graph capture (decode steps only).

kv_sharing="last" (SharedKVMetadata): the decode kernel reads a row's generated tokens from their pages and
stores a generated token there (its slot mapping is -1, which kv_store skips); prefill rows hold prompt
tokens only, so the prefill kernels never see generated pages.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from attention.base import AttentionBackend, AttentionMetadata, Capabilities
from attention.kernels.decode import decode_split_kernel, host_split_count, split_cap
from attention.kernels.kv_store import kv_store_kernel
from attention.kernels.prefill import prefill_packed_kernel, prefill_paged_kernel
from attention.triton_kvarn import KVarNStep, kvarn_forward, prepare_kvarn_graph_step, prepare_kvarn_step
from triton_runtime.launch import INTERPRETED, CompiledLaunch
from triton_runtime.pdl import pdl_supported
from triton_runtime.stream import current_stream
from triton_runtime.workspace import Workspace

# Max |packed - per-row| / max |reference| that the packed prefill kernel promises (bf16 inputs; fp32
# inputs land near 1e-6).
PACKED_PREFILL_TOLERANCE = 2e-2

EAGER_WORKSPACE = Workspace()
# The head dims the dense kernels run: every multiple of 16 up to 256 (KVarN pools take powers of two only,
# which cache/kv_format.py checks).
HEAD_DIMS = tuple(range(16, 257, 16))


@dataclasses.dataclass(frozen=True, slots=True)
class SplitRule:
    """How many splits a decode row's context is cut into, from its own length only (the device twin is
    attention/kernels/decode.py's row_split_count): every short_split_keys keys for a row of at most
    short_context keys, every split_min_keys keys for a longer one, at least 1 and at most split_cap. A split
    is a whole number of decode key tiles (split_bounds), so keys per split below the tile leave splits
    empty."""

    split_min_keys: int
    split_cap: int
    short_context: int = 0
    short_split_keys: int = 1

    def __post_init__(self) -> None:
        for name in ("split_min_keys", "split_cap", "short_split_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.short_context < 0:
            raise ValueError(f"short_context must be at least 0, got {self.short_context}")

    def count(self, context_len: int) -> int:
        keys = self.short_split_keys if context_len <= self.short_context else self.split_min_keys
        return host_split_count(context_len, keys, self.split_cap)

    def grid_count(self, longest: int) -> int:
        """The most splits of any context up to `longest` (each class's count grows with the context)."""
        return max(self.count(min(longest, self.short_context)), self.count(longest))

    def constexprs(self) -> tuple[int, int, int, int]:
        """The decode kernel's SHORT_CONTEXT, SHORT_SPLIT_KEYS, SPLIT_MIN_KEYS, SPLIT_CAP."""
        return self.short_context, self.short_split_keys, self.split_min_keys, self.split_cap


@dataclasses.dataclass(slots=True)
class _Step:
    """Host facts of one step, from `prepare`."""

    meta: AttentionMetadata
    num_tokens: int
    decode_rows: int
    rule: SplitRule
    grid_splits: int
    row_map: torch.Tensor | None  # [decode rows, 2] (batch row, token); None when row r is token r
    prefill_work: torch.Tensor | None  # [items, 2] (row, first query) for the per-row prefill kernel
    packed: torch.Tensor | None  # [packed tokens, 2] (token, packed index of its row's start)
    capturing: bool


@dataclasses.dataclass(slots=True)
class _Plan:
    """A step's launches with their arguments, built at the step's first forward (they need q)."""

    key: tuple
    out: torch.Tensor
    in_capture: bool = False  # built inside a CUDA-graph capture, on the graph's buffers
    store: CompiledLaunch | None = None
    store_args: tuple = ()
    prefill: CompiledLaunch | None = None
    prefill_args: tuple = ()
    packed: CompiledLaunch | None = None
    packed_args: tuple = ()
    decode: CompiledLaunch | None = None
    decode_mid: tuple = ()
    decode_shared: tuple = ()  # kv_sharing="last"'s tables, then the rows' slot offsets (depth batching)
    shared_layers: int = 0  # kv_sharing="last": layers per loop, to pass each call its loop (slot // L)
    decode_tail: tuple = ()
    partials: torch.Tensor | None = None  # graph mode: this instance's; eager: from the workspace
    tickets: torch.Tensor | None = None
    workspace_size: tuple[int, int] | None = None  # eager multi-split decode: (partials, tickets)


class TritonBackend(AttentionBackend):
    name = "triton"
    # The kernels tile a head as the next power of two of head_dim, masked where wider (tl.arange needs a
    # power of two, tl.dot a multiple of 16); power-of-two head dims take the unmasked code.
    default_capabilities = Capabilities(head_dims=HEAD_DIMS, cuda_graphs=True,
                                        kv_formats=("paged", "shared-last"), kvarn=True)
    # batch_invariant: a one-token row of a prompt token goes to the prefill kernel, as the prompt's other
    # tokens do (AttentionMetadata.decode_rows), not to the decode kernel, whose split-KV sums differ.
    optional_capabilities = frozenset({"packed_prefill", "batch_invariant"})

    def __init__(self, capabilities: Capabilities) -> None:
        if capabilities.packed_prefill:
            capabilities = dataclasses.replace(capabilities, packed_matches_decode=False,
                                               packed_prefill_tolerance=PACKED_PREFILL_TOLERANCE)
        super().__init__(capabilities)
        self.workspace = EAGER_WORKSPACE
        self._step: _Step | None = None
        self._plan: _Plan | None = None
        self._capturing = False
        self._kvarn_step: KVarNStep | None = None
        # Captured graphs keep pointing at these, so they live as long as the instance.
        self._graph_buffers: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._graph_tickets: list[torch.Tensor] = []

    def bind(self, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
             kv_scales: torch.Tensor | None = None) -> None:
        same = key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype
        if key_cache.dim() != 5 or not same:
            raise ValueError("key_cache and value_cache must both be [num_slots, num_blocks, block_size, "
                             f"kv_heads, head_dim] of one dtype, got {tuple(key_cache.shape)} "
                             f"{key_cache.dtype} and {tuple(value_cache.shape)} {value_cache.dtype}")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the triton attention backend needs contiguous key_cache and value_cache")
        device = key_cache.device
        if device.type == "cpu" and not INTERPRETED:
            raise ValueError("the triton attention backend runs on CPU only under TRITON_INTERPRET=1")
        self.check(None, key_cache.shape[-1], device)  # the pool's dtype: super().bind checks it
        self.quantized = key_cache.dtype == torch.float8_e4m3fn
        if self.quantized and self.capabilities.packed_prefill:
            raise ValueError("packed_prefill reads new K/V from the step's inputs, not through the fp8 "
                             "cache, so it cannot be combined with kv_cache_dtype='fp8_e4m3'")
        if self.quantized and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("kv_cache_dtype='fp8_e4m3' with attention='triton' needs a GPU of compute "
                             "capability 8.9 or newer (Ada, Hopper), for Triton's fp8 conversions; "
                             "attention='torch' runs it anywhere")
        super().bind(key_cache, value_cache, scale, kv_scales)
        self._device = device
        self._key_slots = list(key_cache.unbind(0))
        self._value_slots = list(value_cache.unbind(0))
        _, _, self.block_size, self.kv_heads, self.head_dim = key_cache.shape
        # The kernels' head tile: a power of two (tl.arange), masked to head_dim where wider.
        self.block_d = triton.next_power_of_2(self.head_dim)
        self._dummy_f32 = torch.zeros(1, dtype=torch.float32, device=device)
        # Per slot, the fp8 key and value scales the kernels read (a dummy for other pools: never read).
        self._scale_slots = (list(kv_scales.unbind(0)) if self.quantized
                             else [self._dummy_f32] * key_cache.shape[0])
        self._dummy_i32 = torch.zeros(2, dtype=torch.int32, device=device)
        # Tunables (instance attributes, so tests and benchmarks may override them after bind).
        # Key tiles of about 16 KB each for K and V (64 keys x 128 dims in bf16); fp32 halves the keys.
        narrow = 2 if key_cache.element_size() == 4 else 1
        self.split_cap = split_cap(device, self.kv_heads)
        self.split_min_keys = 512
        # The short class (SplitRule): rows of up to 1K keys split every 128 keys. On an H200 with 3 stages
        # (benchmarks/results/attention-2026-12-02-c918a8a.md, graph mode, µs a call against 512-key
        # splits and 2 stages): 1 x 512 7.2 (12.4), 1 x 2K 15.2 (16.5), 16 x 2K 71.4 (73.8), 64 x 2K 251.5
        # (258.9), 16 x 8K 250.1 (255.7); only 64 x 512 pays, 97.6 (77.5), its 64 x 16 x 4 programs each
        # merging. A longer short class helps 1 x 2K and costs 64 x 2K more (the sweep's table).
        self.short_context = 1024
        self.short_split_keys = 128
        self.pdl = pdl_supported(device)
        # Decode key tiles of 32 KB for K and V (128 keys x 128 dims in bf16), fastest on an H200 with the
        # tensor-core loop (timed 2026-12-01 by a variants benchmark, now in git history); 64 keys for fp8
        # pools and head_dim 256.
        wide = self.head_dim <= 128 and key_cache.element_size() != 1
        self.decode_block_n = (128 if wide else 64) // narrow
        self.decode_num_warps = 4
        self.decode_num_stages = 3
        if self.quantized:
            # An fp8 pool: the best geometric mean over 1 x 512, 64 x 2K and 16 x 8K of the H200 sweep
            # (benchmarks/results/attention-fp8-2026-12-03-69b050d.md, graph mode, µs a call against the
            # bf16 defaults above): 5.4 (8.9), 227.7 (253.7), 217.4 (237.3). Each row still splits by its
            # own length only.
            self.split_min_keys, self.short_context, self.short_split_keys = 1024, 512, 64
            self.decode_num_stages = 2
        # Prefill: query tiles of 128 against key tiles of 64, 4 warps, 3 stages, the fastest at head_dim
        # 128 in bf16 on an H200 (346-351 TFLOP/s against 232-234 for 64 x 64 with 8 warps and 2 stages;
        # benchmarks/prefill.py --sweep); head_dim 256 keeps smaller tiles and 8 warps.
        self.prefill_block_m = (128 if self.head_dim <= 128 else 64) // narrow
        self.prefill_block_n = (64 if self.head_dim <= 128 else 32) // narrow
        self.prefill_num_warps = 4 if self.head_dim <= 128 else 8
        self.prefill_num_stages = 3

    def bind_packed(self, pool, scale: float) -> None:
        """A KVarN pool (attention/triton_kvarn.py), with no packed prefill (which reads new K/V from the
        step's inputs, not through the pool)."""
        device = pool.key_codes.device
        if device.type == "cpu" and not INTERPRETED:
            raise ValueError("the triton attention backend runs on CPU only under TRITON_INTERPRET=1")
        if self.capabilities.packed_prefill:
            raise ValueError("packed_prefill cannot be combined with a KVarN KV cache "
                             "(kv_cache_dtype='kvarn_*')")
        self.check(None, pool.head_dim, device)
        super().bind_packed(pool, scale)
        self._device, self.block_size, self.kv_heads = device, pool.block_size, pool.kv_heads
        self.split_cap = split_cap(device, pool.kv_heads)
        self.split_min_keys = 512  # a multiple of every KVarN tile (64, 128)

    # --- per step -------------------------------------------------------------------------------

    def capture_begin(self, max_rows: int) -> None:
        self._capturing = True
        self._step = self._plan = self._kvarn_step = None

    def capture_end(self) -> None:
        self._capturing = False
        self._step = self._plan = self._kvarn_step = None

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        if meta.block_size != self.block_size:
            raise ValueError(f"metadata block_size {meta.block_size} != the KV pool's {self.block_size}")
        if self.packed_pool is not None:
            if not self._capturing:
                self._kvarn_step = prepare_kvarn_step(meta, self.block_size, self._to_device)
            elif meta.is_decode:
                self._kvarn_step = prepare_kvarn_graph_step(meta, self.block_size)
            else:
                raise ValueError("only decode steps (one new token per row) can be graph-captured")
            return
        query_lens, context_lens = meta.query_lens_cpu, meta.context_lens_cpu
        starts = meta.query_starts_cpu
        decode = [row for row, n in enumerate(query_lens) if n == 1]
        if self.capabilities.batch_invariant and meta.decode_rows is not None:
            decode = meta.decode_rows
        if meta.slot_offsets is not None and len(decode) != meta.num_rows:
            raise ValueError("rows at their own loops (AttentionMetadata.slot_offsets, depth batching) must "
                             "all be decode rows: only the decode kernel reads per-row slots")
        if self._capturing:
            if len(decode) != meta.num_rows:
                raise ValueError("only decode steps (one new token per row) can be graph-captured")
            longest = meta.block_tables.shape[1] * self.block_size  # any context the table can hold
        else:
            longest = max((context_lens[row] for row in decode), default=0)
        rule = SplitRule(self.split_min_keys, self.split_cap, self.short_context, self.short_split_keys)
        grid_splits = rule.grid_count(longest)

        row_map = None
        if decode and len(decode) != meta.num_rows:
            row_map = self._int_tensor([(row, starts[row]) for row in decode])
        chosen = set(decode)
        many = [row for row in range(meta.num_rows) if row not in chosen]
        packing = self.capabilities.packed_prefill
        packed_rows = [row for row in many if packing and context_lens[row] == query_lens[row]]
        paged_rows = [row for row in many if row not in packed_rows]
        prefill_work = None
        if paged_rows:
            bm = self.prefill_block_m
            items = [(row, m0) for row in paged_rows for m0 in range(0, query_lens[row], bm)]
            # The most keys first, so the longest programs do not start last.
            items.sort(key=lambda item: context_lens[item[0]] - query_lens[item[0]] + item[1], reverse=True)
            prefill_work = self._int_tensor(items)
        packed = None
        if packed_rows:
            pairs = []
            for row in packed_rows:
                first = len(pairs)
                pairs.extend((token, first) for token in range(starts[row], starts[row + 1]))
            packed = self._int_tensor(pairs)
        self._step = _Step(meta, starts[-1], len(decode), rule, grid_splits, row_map, prefill_work, packed,
                           self._capturing)
        self._plan = None

    def _int_tensor(self, pairs: list[tuple[int, int]]) -> torch.Tensor:
        return self._to_device(torch.tensor(pairs, dtype=torch.int32))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cuda":  # pinned: the copy is queued, not waited for
            host = host.pin_memory()
        return host.to(self._device, non_blocking=True)

    # --- per call -------------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """Returns a per-step output buffer: the next forward of the step overwrites it."""
        if self.packed_pool is not None:
            if self._kvarn_step is None:
                raise RuntimeError("prepare(meta) must run before forward")
            return kvarn_forward(self._kvarn_step, self.meta, self.packed_pool, slot, q, k, v, self.scale,
                                 self.split_cap, self.split_min_keys)
        key = (q.dtype, q.shape, q.stride(), k.stride(), v.stride())
        plan = self._plan
        if plan is None or plan.key != key or (self._capturing and plan.in_capture != self._in_capture()):
            plan = self._plan = self._build_plan(key, q, k, v)
        out = plan.out
        key_cache, value_cache = self._key_slots[slot], self._value_slots[slot]
        scales = self._scale_slots[slot]
        stream = current_stream(self._device)
        if plan.store is not None:
            plan.store(stream, (k, v, key_cache, value_cache, scales) + plan.store_args)
        if plan.prefill is not None:
            plan.prefill(stream, (q, out, key_cache, value_cache, scales) + plan.prefill_args)
        if plan.packed is not None:
            plan.packed(stream, (q, k, v, out) + plan.packed_args)
        if plan.decode is not None:
            partials, tickets = plan.partials, plan.tickets
            if plan.workspace_size is not None:
                entry = self.workspace.get(self._device, stream, *plan.workspace_size)
                partials, tickets = entry.partials, entry.tickets
            plan.decode(stream, (q, k, v, out, key_cache, value_cache, scales) + plan.decode_mid
                        + (partials, tickets) + plan.decode_shared
                        + (slot // plan.shared_layers if plan.shared_layers else 0,)
                        + plan.decode_tail)
        return out

    def _build_plan(self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Plan:
        step = self._step
        if step is None:
            raise RuntimeError("prepare(meta) must run before forward")
        num_tokens, heads, head_dim = q.shape
        if num_tokens != step.num_tokens or heads % self.kv_heads or head_dim != self.head_dim:
            raise ValueError(f"q {tuple(q.shape)} does not fit this step ({step.num_tokens} tokens) and the "
                             f"KV pool ({self.kv_heads} kv heads x {self.head_dim})")
        if k.shape != (num_tokens, self.kv_heads, head_dim) or v.shape != k.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                             f"[{num_tokens}, {self.kv_heads}, {head_dim}]")
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("q, k and v need a contiguous last (head_dim) dimension")
        self.check(q.dtype, head_dim, q.device)
        meta, capturing = step.meta, step.capturing
        if capturing:
            out = self._graph_buffer("out", num_tokens * heads * head_dim, q.dtype).view(q.shape)
        else:
            out = torch.empty((num_tokens, heads, head_dim), dtype=q.dtype, device=q.device)
        plan = _Plan(key, out, capturing and self._in_capture())
        direct = not capturing
        pdl = self._pdl_options()
        dot_fp32 = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)
        if step.prefill_work is not None or step.packed is not None:
            plan.store = CompiledLaunch(kv_store_kernel, (num_tokens, 1, 1), 4, 1, direct, **pdl)
            plan.store_args = (meta.slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               self.kv_heads, head_dim, self.block_d, triton.next_power_of_2(self.kv_heads),
                               self.quantized, self.pdl)
        if step.prefill_work is not None:
            plan.prefill = CompiledLaunch(prefill_paged_kernel, (step.prefill_work.shape[0], heads, 1),
                                          self.prefill_num_warps, self.prefill_num_stages, direct, **pdl)
            plan.prefill_args = (meta.block_tables, meta.query_start_loc, meta.context_lens,
                                 step.prefill_work, self.scale, q.stride(0), q.stride(1),
                                 meta.block_tables.stride(0), heads, self.kv_heads, head_dim, self.block_d,
                                 self.block_size,
                                 self.prefill_block_m, self.prefill_block_n, dot_fp32, self.quantized,
                                 self.pdl)
        if step.packed is not None:
            num_packed = step.packed.shape[0]
            bm = self.prefill_block_m
            plan.packed = CompiledLaunch(prefill_packed_kernel, (triton.cdiv(num_packed, bm), heads, 1),
                                         self.prefill_num_warps, self.prefill_num_stages, direct, **pdl)
            plan.packed_args = (step.packed, num_packed, self.scale, q.stride(0), q.stride(1), k.stride(0),
                                k.stride(1), v.stride(0), v.stride(1), heads, self.kv_heads, head_dim,
                                self.block_d, bm,
                                self.prefill_block_n, dot_fp32, self.pdl)
        if step.decode_rows:
            self._plan_decode(plan, step, q, k, v, heads)
        return plan

    def _plan_decode(self, plan: _Plan, step: _Step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     heads: int) -> None:
        meta, splits, rows = step.meta, step.grid_splits, step.decode_rows
        # fp8 keys and values widen to fp16 for the dots where the model is half precision; the interpreter
        # multiplies half-precision dots in fp32 (its bf16 dot is wrong).
        fp16_dot = self.quantized and q.dtype != torch.float32
        dot_fp32 = q.dtype == torch.float32 or (INTERPRETED and (q.dtype == torch.bfloat16 or fp16_dot))
        plan.decode = CompiledLaunch(decode_split_kernel, (splits, heads, rows), self.decode_num_warps,
                                     self.decode_num_stages, not step.capturing, **self._pdl_options())
        row_map = step.row_map if step.row_map is not None else self._dummy_i32
        plan.decode_mid = (meta.block_tables, meta.context_lens, meta.slot_mapping, row_map)
        row_slots = meta.slot_offsets is not None
        shared = meta.shared_kv
        if shared is not None:
            plan.decode_shared = (shared.generated_block_tables, shared.prompt_lens)
            plan.shared_layers = shared.num_layers
            gen_stride = shared.generated_block_tables.stride(0)
            loops, layers = shared.loops, shared.num_layers
        else:
            plan.decode_shared = (self._dummy_i32, self._dummy_i32)
            gen_stride, loops, layers = 0, 1, 1
        plan.decode_shared += (meta.slot_offsets if row_slots else self._dummy_i32,)
        plan.decode_tail = (self._key_slots[0].numel(), self.scale, q.stride(0), q.stride(1), k.stride(0),
                            k.stride(1), v.stride(0), v.stride(1), meta.block_tables.stride(0), gen_stride,
                            heads, self.kv_heads, self.head_dim, self.block_d, self.block_size,
                            self.decode_block_n,
                            *step.rule.constexprs(), step.row_map is not None, shared is not None, loops,
                            layers, row_slots, self.quantized, dot_fp32, fp16_dot, self.pdl)
        plan.partials, plan.tickets = self._dummy_f32, self._dummy_i32
        if splits == 1:
            return
        partials = rows * heads * splits * (self.head_dim + 2)
        if not step.capturing:
            plan.workspace_size = (partials, rows * heads)
            return
        plan.partials = self._graph_buffer("partials", partials, torch.float32)
        plan.tickets = self._graph_ticket_buffer(rows * heads)

    def _pdl_options(self) -> dict:
        return {"launch_pdl": True} if self.pdl else {}

    def _graph_buffer(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for graph mode. Inside a capture it comes from the graph's pool and is kept: graphs
        replay one at a time, so they share one buffer per role, the largest asked for so far (capture the
        largest bucket first and there is just one). Outside a capture (the warm-up) it is temporary."""
        if not self._in_capture():
            return torch.empty(numel, dtype=dtype, device=self._device)
        buffers = self._graph_buffers.setdefault((role, dtype), [])
        if not buffers or buffers[-1].numel() < numel:
            buffers.append(torch.empty(numel, dtype=dtype, device=self._device))
        return buffers[-1][:numel]

    def _graph_ticket_buffer(self, numel: int) -> torch.Tensor:
        """Graph mode's split tickets: zeros made outside any capture, by the warm-up run before it (a zeroing
        op inside the capture would be one more launch per replay), and kept, since captured graphs point at
        them; the decode kernel leaves every ticket at zero. One buffer serves every graph, as replays run one
        at a time."""
        if self._graph_tickets and self._graph_tickets[-1].numel() >= numel:
            return self._graph_tickets[-1][:numel]
        if self._in_capture():
            raise RuntimeError(f"the decode kernel's graph-mode tickets ({numel}) must be made before "
                               "CUDA-graph capture: run the step once outside the capture first")
        self._graph_tickets.append(torch.zeros(numel, dtype=torch.int32, device=self._device))
        return self._graph_tickets[-1]

    def _in_capture(self) -> bool:
        return self._device.type == "cuda" and torch.cuda.is_current_stream_capturing()
