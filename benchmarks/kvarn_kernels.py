"""The KVarN Triton kernels timed on CUDA at Ouro-1.4B's attention shape.

Decode attention over a packed history (attention/kernels/kvarn_decode.py), prefill attention over one
(attention/kernels/kvarn_prefill.py) and tile packing (cache/kvarn_pack_kernel.py), at 16 query heads, 16 kv
heads, head_dim 128, with a bf16 side pool.

    python -m benchmarks.kvarn_kernels --out benchmarks/results/kvarn_kernels.json [--reps 50]

Decode: rows x context 16 x 8192, 64 x 2048 and 1 x 2048, per format (kvarn_k4v2_g64, kvarn_k4v4_g64,
kvarn_k5v5_g64) and per high-precision window (sink, tail), each row's tiles in shuffled blocks of a pool
that holds exactly them. Each call is timed two ways: as the engine makes it ("engine": fp32 queries, the
side rows unrotated, so the split kernel keeps a second output and the packed share is rotated back after
the merge; the engine's register cap, attention/triton_kvarn.py's decode_maxnreg) and over one basis ("one
basis": the bf16 query, side rows taken as rotated; the split kernel and, with several splits, the merge).
The two compile differently (k5v5 at 2 warps, bf74d5a, no register cap: 128 registers against 167, and
value loads issued later in the tile loop), which is why both are kept. Until bf74d5a the benchmark timed
only the one-basis call. Each call is timed with CUDA
events after a write of 256 MiB that evicts the L2, median over --reps; its bytes are what it must read once
(packed tiles with their fp16 scales, side rows, queries, tables) and its output, and GB/s is their rate. The
Triton backend's dense decode kernel runs at the same shapes as the baseline, over a bf16 and an fp8_e4m3
pool (pages of 16, its default tunables), timed the same way. Prefill: one call over rows x (prefix + new)
positions (fresh prompts of 2K and 8K, one and 16 rows; a 2K chunk after 6K stored positions), every full
tile packed, per format, window and work-item size (128 queries and 8 warps, the engine's; 64 and 4), in ms,
causal attention TFLOP/s and tokens/s, against the Triton backend's bf16 paged prefill (its KV store
included) at the same shapes. Pack: one launch over N tiles x 16 kv heads from a bf16 source, µs per call
and per (tile, kv head).

Writes the JSON and a markdown table beside it, with the device, torch and triton versions and the commit.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks.common import environment, write_results
from cache import kvarn
from cache.kv_format import high_precision_rows, parse_kv_cache_dtype

HEADS, KV_HEADS, HEAD_DIM = 16, 16, 128  # Ouro-1.4B (model/tiny.py: the ouro-1.4b preset)
SIDE_DTYPE = torch.bfloat16
FORMATS = ["kvarn_k4v2_g64", "kvarn_k4v4_g64", "kvarn_k5v5_g64"]
SHAPES = [(16, 8192), (64, 2048), (1, 2048)]  # rows x context
WINDOWS = [(0, 0), (64, 64)]  # (sink, tail) high-precision positions
NUM_WARPS = [2, 4]  # the decode kernel splits a tile into 4 warp slots (8 warps would repeat work)
PACK_TILES = [16, 64, 1024]
# Prefill calls: (rows, prefix, new): fresh prompts, and a chunk after stored positions.
PREFILL_SHAPES = [(1, 0, 2048), (1, 0, 8192), (16, 0, 2048), (16, 0, 8192), (1, 6144, 2048)]
PREFILL_BLOCK_M = [128, 64]
FLUSH_BYTES = 256 << 20  # several times the H200's L2


class EventTimer:
    """Median device µs of fn(), each call after a write that evicts the L2."""

    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.flush.zero_()
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) * 1e3 for start, end in events)
        return times[len(times) // 2]


def high_precision_tiles(length: int, group: int, sink: int, tail: int) -> tuple[int, int]:
    """(tiles with a packed position, tiles with a side row) of a row of `length` positions."""
    side_from = length - max(tail, length % group)
    packed = side = 0
    for tile in range(math.ceil(length / group)):
        first, stop = tile * group, min((tile + 1) * group, length)
        packed += max(first, sink) < min(stop, side_from)
        side += first < sink or stop > side_from
    return packed, side


class PackedStep:
    """One decode step's packed pool, side pool, tables and queries: `rows` rows of `context` positions.
    Codes and scales are random (timing does not depend on them; the scales stay finite)."""

    def __init__(self, name: str, rows: int, context: int, sink: int, tail: int,
                 device: str = "cuda") -> None:
        fmt = parse_kv_cache_dtype(name)
        g, d = fmt.group, HEAD_DIM
        self.fmt, self.rows, self.context, self.sink, self.tail = fmt, rows, context, sink, tail
        tiles = math.ceil(context / g)
        packed_tiles, side_tiles = high_precision_tiles(context, g, sink, tail)
        num_blocks, num_side = rows * (context // g), rows * side_tiles
        self.key_codes = torch.randint(0, 256, (num_blocks, KV_HEADS, g, d * fmt.key_bits // 8),
                                       dtype=torch.uint8, device=device)
        self.value_codes = torch.randint(0, 256, (num_blocks, KV_HEADS, g, d * fmt.value_bits // 8),
                                         dtype=torch.uint8, device=device)
        self.key_scales = (torch.rand(num_blocks, KV_HEADS, 2 * d + g, device=device) * 0.1).half()
        self.value_scales = (torch.rand(num_blocks, KV_HEADS, d + 2 * g, device=device) * 0.1).half()
        self.side_k = torch.randn(max(num_side, 1), g, KV_HEADS, d, dtype=SIDE_DTYPE, device=device)
        self.side_v = torch.randn_like(self.side_k)
        full = context // g
        self.block_tables = torch.full((rows, tiles), -1, dtype=torch.int32, device=device)
        self.block_tables[:, :full] = torch.randperm(num_blocks, device=device).view(rows, full).int()
        side_from = context - max(tail, context % g)
        needs_side = torch.tensor([t * g < sink or min((t + 1) * g, context) > side_from
                                   for t in range(tiles)], device=device)
        self.side_tables = torch.full((rows, tiles), -1, dtype=torch.int32, device=device)
        side_ids = torch.randperm(max(num_side, 1), device=device)[:num_side].view(rows, side_tiles).int()
        self.side_tables[:, needs_side] = side_ids
        self.context_lens = torch.full((rows,), context, dtype=torch.int32, device=device)
        self.q = torch.randn(rows, HEADS, d, dtype=SIDE_DTYPE, device=device)
        self.out = torch.empty(rows, HEADS, d, dtype=torch.float32, device=device)
        # The engine's call (attention/triton_kvarn.py): fp32 queries, the rotated one and the model's own
        # (the side rows' basis), and the rotation that turns the packed tiles' share back.
        self.rotation = kvarn.hadamard(d, device=device)
        self.q_model = self.q.float()
        self.q_rotated = self.q_model @ self.rotation
        side_rows = high_precision_rows(context, g, sink, tail)
        self.bytes = {
            "packed": rows * packed_tiles * KV_HEADS * fmt.tile_bytes(d),
            "side": rows * side_rows * KV_HEADS * d * 2 * SIDE_DTYPE.itemsize,
            "other": (self.q.numel() * self.q.element_size() + self.out.numel() * 4
                      + 2 * self.block_tables.numel() * 4 + rows * 4),
        }

    def __call__(self, num_warps: int = 4, engine_call: bool = True) -> torch.Tensor:
        """engine_call: as the engine calls it (two bases, the packed share rotated back); else one basis,
        over the bf16 query as given (side rows in the rotated basis), into a preallocated output."""
        from attention.kernels.kvarn_decode import kvarn_decode
        from attention.triton_kvarn import decode_maxnreg

        pools = (self.key_codes, self.value_codes, self.key_scales, self.value_scales, self.side_k,
                 self.side_v, self.block_tables, self.side_tables, self.context_lens, self.fmt.key_bits,
                 self.fmt.value_bits)
        if engine_call:
            return kvarn_decode(self.q_rotated, *pools, sink=self.sink, tail=self.tail,
                                max_context_len=self.context, num_warps=num_warps, q=self.q_model,
                                rotation=self.rotation,
                                maxnreg=decode_maxnreg(self.fmt.key_bits, self.fmt.value_bits))
        return kvarn_decode(self.q, *pools, sink=self.sink, tail=self.tail, max_context_len=self.context,
                            out=self.out, num_warps=num_warps)


def decode_rows(timer: EventTimer, formats: list[str]) -> list[dict]:
    results = []
    for rows, context in SHAPES:
        for name in formats:
            for sink, tail in WINDOWS:
                step = PackedStep(name, rows, context, sink, tail)
                if not torch.isfinite(step()).all():
                    raise RuntimeError(f"{name} {rows} x {context}: the decode output is not finite")
                total = sum(step.bytes.values())
                for engine_call in (True, False):
                    for num_warps in NUM_WARPS:
                        us = timer(lambda: step(num_warps, engine_call))
                        call = "engine" if engine_call else "one basis"
                        print(f"decode {name} {rows} x {context} ({sink}, {tail}) {call} "
                              f"num_warps={num_warps}: {us:.1f} µs", file=sys.stderr, flush=True)
                        results.append({"kv_cache_dtype": name, "rows": rows, "context": context,
                                        "sink": sink, "tail": tail,
                                        "call": "engine" if engine_call else "one basis",
                                        "num_warps": num_warps, "us": us, "bytes": total,
                                        "bytes_by_kind": step.bytes, "gbps": total / us / 1e3})
    return results


def dense_rows(timer: EventTimer) -> list[dict]:
    """The Triton backend's paged decode (which also stores the new token) at the same shapes, over a bf16
    and an fp8_e4m3 pool (benchmarks/attention.py's DecodeStep: pages of 16, shuffled)."""
    from benchmarks.attention import DecodeStep

    results = []
    for rows, context in SHAPES:
        for name, kv_cache_dtype in (("bf16", "auto"), ("fp8_e4m3", "fp8_e4m3")):
            step = DecodeStep(rows, context, 1, kv_cache_dtype)
            backend = step.backend()
            backend.prepare(step.meta)
            us = timer(lambda: backend.forward(step.q, step.k, step.v, 0))
            results.append({"kv_cache_dtype": name, "rows": rows, "context": context, "us": us,
                            "bytes": step.bytes, "gbps": step.bytes / us / 1e3})
    return results


def causal_flops(rows: int, prefix: int, new: int) -> float:
    """QK^T and PV of a prefill call: 2 x 2 x head_dim FLOPs per (query, visible key) per head."""
    return 4 * HEADS * HEAD_DIM * rows * sum(prefix + i + 1 for i in range(new))


class PackedPrefill:
    """One prefill call over a packed pool: `rows` rows of `new` tokens after `prefix` stored positions each,
    every full tile packed (random codes, finite scales) in a shuffled block, every tile with a side block
    (random rows), the chunks' own K/V in k, v."""

    def __init__(self, name: str, rows: int, prefix: int, new: int, sink: int, tail: int) -> None:
        fmt = parse_kv_cache_dtype(name)
        g, d, context = fmt.group, HEAD_DIM, prefix + new
        self.fmt, self.sink, self.tail = fmt, sink, tail
        tiles, full = math.ceil(context / g), context // g
        num_blocks = rows * full
        self.key_codes = torch.randint(0, 256, (num_blocks, KV_HEADS, g, d * fmt.key_bits // 8),
                                       dtype=torch.uint8, device="cuda")
        self.value_codes = torch.randint(0, 256, (num_blocks, KV_HEADS, g, d * fmt.value_bits // 8),
                                         dtype=torch.uint8, device="cuda")
        self.key_scales = (torch.rand(num_blocks, KV_HEADS, 2 * d + g, device="cuda") * 0.1).half()
        self.value_scales = (torch.rand(num_blocks, KV_HEADS, d + 2 * g, device="cuda") * 0.1).half()
        self.side_k = torch.randn(rows * tiles, g, KV_HEADS, d, dtype=SIDE_DTYPE, device="cuda")
        self.side_v = torch.randn_like(self.side_k)
        self.block_tables = torch.full((rows, tiles), -1, dtype=torch.int32, device="cuda")
        self.block_tables[:, :full] = torch.randperm(num_blocks, device="cuda").view(rows, full).int()
        self.side_tables = torch.randperm(rows * tiles, device="cuda").view(rows, tiles).int()
        self.query_start_loc = torch.arange(0, rows * new + 1, new, dtype=torch.int32, device="cuda")
        self.context_lens = torch.full((rows,), context, dtype=torch.int32, device="cuda")
        self.q, self.k, self.v = (torch.randn(rows * new, n, d, dtype=SIDE_DTYPE, device="cuda")
                                  for n in (HEADS, KV_HEADS, KV_HEADS))
        self.out = torch.empty_like(self.q)
        self.rotation = kvarn.hadamard(d, device="cuda")
        self.rows, self.new = rows, new

    def __call__(self, block_m: int) -> torch.Tensor:
        from attention.kernels.kvarn_prefill import kvarn_prefill

        work = torch.tensor([(row, m0) for row in range(self.rows) for m0 in range(0, self.new, block_m)],
                            dtype=torch.int32, device="cuda")
        return kvarn_prefill(self.q, self.k, self.v, self.key_codes, self.value_codes, self.key_scales,
                             self.value_scales, self.side_k, self.side_v, self.block_tables, self.side_tables,
                             self.query_start_loc, self.context_lens, work, self.fmt.key_bits,
                             self.fmt.value_bits, self.rotation, self.sink, self.tail, block_m=block_m,
                             out=self.out)


class DensePrefill:
    """The Triton backend's prefill over a bf16 paged pool (pages of 16, shuffled) at the same shape: its
    forward (the KV store, then the prefill kernel) for `rows` rows of `new` tokens after `prefix`."""

    def __init__(self, rows: int, prefix: int, new: int) -> None:
        from attention.base import AttentionMetadata
        from attention.registry import select

        context, page = prefix + new, 16
        pages = math.ceil(context / page)
        shape = (1, rows * pages, page, KV_HEADS, HEAD_DIM)
        key_cache = torch.randn(shape, dtype=SIDE_DTYPE, device="cuda")
        value_cache = torch.randn_like(key_cache)
        tables = torch.randperm(rows * pages, device="cuda").view(rows, pages).int()
        positions = torch.arange(prefix, context, device="cuda")
        slots = tables[:, positions // page].long() * page + positions % page
        meta = AttentionMetadata(
            query_start_loc=torch.arange(0, rows * new + 1, new, dtype=torch.int32, device="cuda"),
            context_lens=torch.full((rows,), context, dtype=torch.int32, device="cuda"), block_tables=tables,
            slot_mapping=slots.flatten(), query_lens_cpu=[new] * rows, context_lens_cpu=[context] * rows,
            block_size=page)
        self.backend = select("triton", torch.device("cuda"))
        self.backend.bind(key_cache, value_cache, HEAD_DIM ** -0.5)
        self.backend.prepare(meta)
        self.q, self.k, self.v = (torch.randn(rows * new, n, HEAD_DIM, dtype=SIDE_DTYPE, device="cuda")
                                  for n in (HEADS, KV_HEADS, KV_HEADS))

    def __call__(self) -> torch.Tensor:
        return self.backend.forward(self.q, self.k, self.v, 0)


def prefill_rows(timer: EventTimer, formats: list[str]) -> list[dict]:
    """Per shape: the bf16 prefill, then each KVarN format, window and work-item size, with its time over
    the bf16 call's."""
    results = []
    for rows, prefix, new in PREFILL_SHAPES:
        flops, tokens = causal_flops(rows, prefix, new), rows * new
        dense = DensePrefill(rows, prefix, new)
        dense_ms = timer(dense) / 1e3
        shape = {"rows": rows, "prefix": prefix, "new": new}
        results.append({"kv_cache_dtype": "bf16", **shape, "ms": dense_ms, "tflops": flops / dense_ms / 1e9,
                        "tokens_per_s": tokens / dense_ms * 1e3, "x_bf16": 1.0})
        for name in formats:
            for sink, tail in WINDOWS:
                call = PackedPrefill(name, rows, prefix, new, sink, tail)
                for block_m in PREFILL_BLOCK_M:
                    if not torch.isfinite(call(block_m)).all():
                        raise RuntimeError(f"{name} {rows} x ({prefix} + {new}): the prefill output is not "
                                           "finite")
                    ms = timer(lambda: call(block_m)) / 1e3
                    results.append({"kv_cache_dtype": name, **shape, "sink": sink, "tail": tail,
                                    "block_m": block_m, "ms": ms, "tflops": flops / ms / 1e9,
                                    "tokens_per_s": tokens / ms * 1e3, "x_bf16": ms / dense_ms})
    return results


def pack_rows(timer: EventTimer, formats: list[str]) -> list[dict]:
    from cache.kvarn_pack_kernel import pack_tiles

    results = []
    for name in formats:
        fmt = parse_kv_cache_dtype(name)
        g, d = fmt.group, HEAD_DIM
        for tiles in PACK_TILES:
            src_k = torch.randn(tiles * g, KV_HEADS, d, dtype=SIDE_DTYPE, device="cuda")
            src_v = torch.randn_like(src_k)
            src_rows = torch.arange(tiles * g, device="cuda").view(tiles, g)
            dst_blocks = torch.randperm(tiles, device="cuda").int()
            codes = [torch.empty(tiles, KV_HEADS, g, d * bits // 8, dtype=torch.uint8, device="cuda")
                     for bits in (fmt.key_bits, fmt.value_bits)]
            scales = [torch.empty(tiles, KV_HEADS, size, dtype=torch.float16, device="cuda")
                      for size in (2 * d + g, d + 2 * g)]
            pool = (*codes, *scales)
            us = timer(lambda: pack_tiles(src_k, src_v, src_rows, dst_blocks, *pool, fmt.key_bits,
                                          fmt.value_bits))
            results.append({"kv_cache_dtype": name, "tiles": tiles, "kv_heads": KV_HEADS, "us": us,
                            "us_per_tile_head": us / (tiles * KV_HEADS)})
    return results


def table(payload: dict) -> str:
    lines = [f"{payload['device']}, torch {payload['torch']}, triton {payload['triton']}, commit "
             f"{payload['commit']}; heads {HEADS}, kv heads {KV_HEADS}, head_dim {HEAD_DIM}, bf16 side pool",
             "",
             "| kv_cache_dtype | rows x context | sink, tail | call | num_warps | µs | MB read | GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in payload["dense"] + payload["decode"]:
        window = f"{r['sink']}, {r['tail']}" if "sink" in r else "-"
        lines.append(f"| {r['kv_cache_dtype']} | {r['rows']} x {r['context']} | {window} | "
                     f"{r.get('call', 'engine')} | {r.get('num_warps', '-')} | {r['us']:.1f} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['gbps']:.0f} |")
    lines += ["", "Prefill (one call; bf16: the Triton backend's paged prefill, its KV store included)", "",
              "| kv_cache_dtype | rows x (prefix + new) | sink, tail | block_m | ms | TFLOP/s | tokens/s | "
              "x bf16 time |", "|---|---|---|---|---|---|---|---|"]
    for r in payload["prefill"]:
        window = f"{r['sink']}, {r['tail']}" if "sink" in r else "-"
        lines.append(f"| {r['kv_cache_dtype']} | {r['rows']} x ({r['prefix']} + {r['new']}) | {window} | "
                     f"{r.get('block_m', '-')} | {r['ms']:.2f} | {r['tflops']:.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['x_bf16']:.2f} |")
    lines += ["", "| kv_cache_dtype | tiles x kv heads | µs per call | µs per (tile, kv head) |",
              "|---|---|---|---|"]
    for r in payload["pack"]:
        lines.append(f"| {r['kv_cache_dtype']} | {r['tiles']} x {r['kv_heads']} | {r['us']:.1f} | "
                     f"{r['us_per_tile_head']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results (and a .md beside it)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per case (the median is kept)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated KVarN formats")
    parser.add_argument("--no-dense", action="store_true", help="skip the bf16 and fp8 decode baselines")
    parser.add_argument("--decode-only", action="store_true", help="time decode only (no prefill, no pack)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kvarn_kernels times CUDA kernels, and torch sees no CUDA device here")
    torch.manual_seed(0)
    formats = args.formats.split(",")
    timer = EventTimer(args.reps)
    payload = {**environment(), "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                          "side_dtype": str(SIDE_DTYPE)},
               "reps": args.reps, "l2_flush_bytes": FLUSH_BYTES,
               "dense": [] if args.no_dense else dense_rows(timer),
               "decode": decode_rows(timer, formats),
               "prefill": [] if args.decode_only else prefill_rows(timer, formats),
               "pack": [] if args.decode_only else pack_rows(timer, formats)}
    text = table(payload)
    write_results(args.out, payload, text)
    print(text)


if __name__ == "__main__":
    main()
