"""Decode attention on CUDA: the Triton backend per call, in µs and GB/s, held against the device-to-device
copy bandwidth measured in the same run, with torch SDPA over the gathered pages beside it (the gather
itself untimed); and the host µs per eager call, held against a bare Triton launch measured in the same run.

    python -m benchmarks.attention --out benchmarks/results/attention.json [--no-sweep | --configs JSON]

Device times come from CUDA-graph replays of many calls that walk through several KV slots, so neither
host launch cost nor L2 reuse flatters the small shapes. "eager" is the eager plan (grid sized to the
step's longest row, the workspace's buffers), "graph mode" the plan a captured decode step replays (grid
sized to the block table, as wide as 8K keys here, and the backend's own buffers); both are one launch per
call. Shapes are rows x context, bf16, 16 heads x 128 (Ouro), pages of 16 tokens in shuffled order.
--kv-cache-dtype fp8_e4m3 times an fp8 pool (half the KV bytes; SDPA then reads the pages widened to bf16,
so its column is the bf16 reference).

The sweep times graph mode over the decode tunables that one launch shares (key tile, warps, pipeline
stages) crossed with the split rule's short class (SplitRule: rows of at most short_context keys in splits
of short_split_keys), then the long class's keys per split and PDL off at the best of those, and prints
each configuration's time per shape next to the best time any configuration reached on that shape.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from benchmarks.common import bare_launch_us, graph_time_us, host_us
from benchmarks.common import commit as common_commit

from attention import fp8
from attention.base import AttentionMetadata
from attention.registry import select
from attention.torch_backend import gather_context

# 16 and 64 x 512: many short rows, where the short split class multiplies the programs of a batch that
# already fills the GPU.
SHAPES = [(1, 512), (16, 512), (64, 512), (1, 2048), (16, 2048), (64, 2048), (16, 8192)]
TARGETS = {(64, 2048): 0.85, (16, 8192): 0.85}  # fraction of copy bandwidth
LATENCY_TARGETS_US = {(1, 512): 6.0}  # graph mode, per call
# The sweep's launch-wide tunables (key tile, warps, stages) and short classes (short_context,
# short_split_keys); short_context 0 is the long rule alone. Splits are whole key tiles, so a class is tried
# only with tiles no longer than its splits.
SWEEP_TILES = [(128, 4, 2), (128, 8, 2), (128, 4, 3), (64, 4, 2), (64, 4, 3), (64, 2, 2)]
SWEEP_SHORT = [(0, 64), (512, 64), (1024, 64), (1024, 128), (2048, 128), (2048, 256)]
HOST_TARGET_US = 20.0
HEADS, HEAD_DIM, BLOCK_SIZE = 16, 128, 16
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 24
# Block tables as wide as an engine's for 8K-token sequences: graph mode sizes its grid to the table, so
# every row gets split_cap programs per head, as in a captured engine step.
TABLE_KEYS = 8192
TUNABLES = ("split_min_keys", "split_cap", "short_context", "short_split_keys", "decode_block_n",
            "decode_num_warps", "decode_num_stages", "pdl")
SLOT_BYTES_FLOOR = 256 << 20  # walk at least this many KV bytes per graph: several times the L2


class DecodeStep:
    """One decode step's pool, metadata and inputs for `rows` rows of `context` tokens each."""

    def __init__(self, rows: int, context: int, slots: int, kv_cache_dtype: str = "auto") -> None:
        pages = math.ceil(context / BLOCK_SIZE)
        num_blocks = rows * pages + 8
        shape = (slots, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
        quantized = kv_cache_dtype == "fp8_e4m3"
        cache_dtype = fp8.FP8_DTYPE if quantized else DTYPE
        self.key_cache = torch.randn(shape, device="cuda", dtype=DTYPE).to(cache_dtype)
        self.value_cache = torch.randn(shape, device="cuda", dtype=DTYPE).to(cache_dtype)
        self.kv_scales = torch.ones(slots, 2, HEADS, device="cuda") if quantized else None
        tables = torch.randperm(num_blocks, device="cuda")[:rows * pages].view(rows, pages).int()
        spare = max(0, TABLE_KEYS // BLOCK_SIZE - pages)  # columns past the context, never read
        tables = torch.cat([tables, tables[:, :1].expand(rows, spare)], 1).contiguous()
        last = context - 1
        self.meta = AttentionMetadata(
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
            context_lens=torch.full((rows,), context, dtype=torch.int32, device="cuda"),
            block_tables=tables,
            slot_mapping=(tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE),
            query_lens_cpu=[1] * rows, context_lens_cpu=[context] * rows, block_size=BLOCK_SIZE)
        qkv = torch.randn(rows, 3 * HEADS * HEAD_DIM, device="cuda", dtype=DTYPE)
        width = HEADS * HEAD_DIM
        self.q, self.k, self.v = (qkv[:, i * width:(i + 1) * width].view(rows, HEADS, HEAD_DIM)
                                  for i in range(3))
        self.rows, self.context, self.slots = rows, context, slots
        self.kv_bytes = 2 * rows * context * HEADS * HEAD_DIM * cache_dtype.itemsize
        self.bytes = self.kv_bytes + 2 * self.q.numel() * DTYPE.itemsize

    def backend(self, **tunables):
        backend = select("triton", torch.device("cuda"))
        backend.bind(self.key_cache, self.value_cache, HEAD_DIM ** -0.5, self.kv_scales)
        for name, value in tunables.items():
            setattr(backend, name, value)
        return backend

    def gathered(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """SDPA's inputs: each row's pages gathered into [rows, heads, context, D]."""
        tables = self.meta.block_tables
        keys = torch.stack([gather_context(self.key_cache[slot], table, self.context).to(DTYPE)
                            for table in tables])
        values = torch.stack([gather_context(self.value_cache[slot], table, self.context).to(DTYPE)
                              for table in tables])
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def copy_bandwidth_gbps() -> float:
    """Event-timed large device-to-device copy, bytes read + written (benchmarks/common.py); a copy
    captured in a graph runs as a memcpy node at about two thirds of that rate, so it is not used."""
    from benchmarks.common import copy_bandwidth

    return copy_bandwidth() / 1e9


def slot_walk(step: DecodeStep) -> list[int]:
    return [i % step.slots for i in range(CALLS_PER_GRAPH)]


def triton_us(step: DecodeStep, graph_mode: bool = False, **tunables) -> float:
    backend = step.backend(**tunables)
    if graph_mode:
        backend.capture_begin(step.rows)
    backend.prepare(step.meta)
    q, k, v = step.q, step.k, step.v
    return graph_time_us([lambda s=s: backend.forward(q, k, v, s) for s in slot_walk(step)])


def sdpa_us(step: DecodeStep) -> float:
    q = step.q.unsqueeze(2)  # [rows, heads, 1, D]
    gathered = [step.gathered(s) for s in range(step.slots)]
    return graph_time_us([lambda s=s: F.scaled_dot_product_attention(q, *gathered[s])
                          for s in slot_walk(step)])


def slots_for(rows: int, context: int, element_bytes: int = DTYPE.itemsize) -> int:
    per_slot = 2 * rows * context * HEADS * HEAD_DIM * element_bytes
    return max(2, min(32, math.ceil(SLOT_BYTES_FLOOR / per_slot)))


def host_costs(calls: int = 2000) -> dict:
    """Host µs per call, hot loop without syncs, on a shape whose kernel is shorter than its launch."""
    step = DecodeStep(1, 512, 8)
    backend = step.backend()
    backend.prepare(step.meta)
    q, k, v = step.q, step.k, step.v
    x = torch.randn(256, device="cuda")
    y = torch.empty_like(x)

    bare = bare_launch_us(calls)
    torch_add = host_us(lambda i: torch.add(x, 1.0, out=y), calls)
    forward = host_us(lambda i: backend.forward(q, k, v, i % 8), calls)
    in_step, prepare = engine_like_host_us(step, backend, x, y)
    return {"bare_triton_launch_us": bare, "torch_add_us": torch_add, "eager_forward_us": forward,
            "eager_forward_ratio_to_bare_launch": forward / bare, "in_step_forward_us": in_step,
            "in_step_forward_ratio_to_bare_launch": in_step / bare, "prepare_us": prepare}


def engine_like_host_us(step: DecodeStep, backend, x, y, steps: int = 30,
                        calls: int = 96) -> tuple[float, float]:
    """A decode step as the model makes it: prepare, then 96 forwards with other launches between them.
    Only the time inside prepare and forward is counted."""
    forward_s = prepare_s = 0.0
    q, k, v = step.q, step.k, step.v
    for n in range(steps + 2):
        t0 = time.perf_counter()
        backend.prepare(step.meta)
        t1 = time.perf_counter()
        inside = 0.0
        for i in range(calls):
            torch.add(x, 1.0, out=y)
            t = time.perf_counter()
            backend.forward(q, k, v, i % step.slots)
            inside += time.perf_counter() - t
            torch.add(y, 1.0, out=x)
        torch.cuda.synchronize()
        if n >= 2:  # the first steps compile and warm up
            forward_s += inside
            prepare_s += t1 - t0
    return forward_s * 1e6 / (steps * calls), prepare_s * 1e6 / steps


def sweep(steps: dict, copy_gbps: float, configs: list[dict] | None = None) -> list[dict]:
    """Graph-mode µs per shape for each configuration (module docstring), or for each of `configs` alone
    where given; each entry: shape, tunables, µs and fraction of copy BW, or the error of a configuration
    that does not compile or fit."""
    results = []

    def measure(tunables: dict) -> float:
        """The configuration's geometric mean over the shapes of time over the copy-rate floor."""
        total = 0.0
        for (rows, context), step in steps.items():
            try:
                us = triton_us(step, graph_mode=True, **tunables)
            except (OutOfResources, CompilationError, RuntimeError) as error:  # a config may not fit
                results.append({"rows": rows, "context": context, **tunables, "error": repr(error)[:200]})
                return math.inf
            fraction = step.bytes / us / 1e3 / copy_gbps
            results.append({"rows": rows, "context": context, **tunables, "us": us, "of_copy_bw": fraction})
            total += math.log(us / (step.bytes / copy_gbps / 1e3))
        return total / len(steps)

    if configs is not None:
        for tunables in configs:
            measure(tunables)
        return results
    configs = [{"decode_block_n": n, "decode_num_warps": w, "decode_num_stages": stages,
                "short_context": short, "short_split_keys": keys}
               for n, w, stages in SWEEP_TILES for short, keys in SWEEP_SHORT if short == 0 or keys >= n]
    best = min(configs, key=measure)
    for keys in (256, 1024):
        measure({**best, "split_min_keys": keys})
    measure({**best, "pdl": False})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tunables sweep")
    parser.add_argument("--configs", type=json.loads, default=None, metavar="JSON",
                        help='time these tunables only, a JSON list, e.g. \'[{}, {"decode_block_n": 64}]\'')
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                        help="the pool's format (auto: bf16)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="ROWSxCONTEXT",
                        help="a subset of the shapes, e.g. 64x2048 16x8192")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes is None else [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    rows_out, steps = [], {}
    element = 1 if args.kv_cache_dtype == "fp8_e4m3" else DTYPE.itemsize
    for rows, context in shapes:
        step = steps[rows, context] = DecodeStep(rows, context, slots_for(rows, context, element),
                                                 args.kv_cache_dtype)
        us, graph_us, sdpa = triton_us(step), triton_us(step, graph_mode=True), sdpa_us(step)
        gbps = step.bytes / us / 1e3
        rows_out.append({"rows": rows, "context": context, "kv_cache_dtype": args.kv_cache_dtype,
                         "slots": step.slots, "bytes": step.bytes,
                         "triton_us": us, "triton_gbps": gbps, "triton_of_copy_bw": gbps / copy_gbps,
                         "triton_graph_mode_us": graph_us, "sdpa_us": sdpa,
                         "sdpa_of_copy_bw": (step.bytes if element == DTYPE.itemsize else
                                             2 * step.kv_bytes + 2 * step.q.numel() * DTYPE.itemsize)
                         / sdpa / 1e3 / copy_gbps,
                         "target_of_copy_bw": TARGETS.get((rows, context)),
                         "target_graph_mode_us": LATENCY_TARGETS_US.get((rows, context))})
    host = host_costs()
    defaults = steps[shapes[0]].backend()
    tunables = {name: getattr(defaults, name) for name in TUNABLES}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": common_commit(),
              "copy_gbps": copy_gbps, "kv_cache_dtype": args.kv_cache_dtype, "rows": rows_out,
              "tunables": tunables, "host": host, "host_target_us": HOST_TARGET_US}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")  # the rows stay if the sweep is cut short
    if not args.no_sweep:
        result["sweep"] = sweep(steps, copy_gbps, args.configs)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def print_table(result: dict) -> None:
    copy = result["copy_gbps"]
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}, "
          f"kv_cache_dtype {result.get('kv_cache_dtype', 'auto')}; "
          f"device-to-device copy {copy:.0f} GB/s (the floor's rate); tunables {result['tunables']}\n")
    print("| rows x context | eager µs | GB/s | of copy BW | target | graph-mode µs | target | SDPA µs "
          "| SDPA of copy BW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        target, latency = r["target_of_copy_bw"], r.get("target_graph_mode_us")
        bandwidth = "" if target is None else \
            f"{target:.2f} {'met' if r['triton_of_copy_bw'] >= target else 'MISSED'}"
        graph = "" if latency is None else \
            f"<= {latency:.1f} {'met' if r['triton_graph_mode_us'] <= latency else 'MISSED'}"
        print(f"| {r['rows']} x {r['context']} | {r['triton_us']:.1f} | {r['triton_gbps']:.0f} | "
              f"{r['triton_of_copy_bw']:.2f} | {bandwidth} | {r['triton_graph_mode_us']:.1f} | {graph} | "
              f"{r['sdpa_us']:.1f} | {r['sdpa_of_copy_bw']:.2f} |")
    h = result["host"]
    print(f"\n| host cost | µs | ratio to a bare Triton launch ({h['bare_triton_launch_us']:.1f} µs) |")
    print("|---|---|---|")
    print(f"| eager forward, hot loop | {h['eager_forward_us']:.1f} | "
          f"{h['eager_forward_ratio_to_bare_launch']:.2f} |")
    print(f"| eager forward, 96 per step between other launches | {h['in_step_forward_us']:.1f} | "
          f"{h['in_step_forward_ratio_to_bare_launch']:.2f} |")
    print(f"| torch.add | {h['torch_add_us']:.1f} | {h['torch_add_us'] / h['bare_triton_launch_us']:.2f} |")
    print(f"| prepare, once per step | {h['prepare_us']:.1f} | |")
    verdict = "met" if h["in_step_forward_us"] <= result["host_target_us"] else "MISSED"
    print(f"\nhost target: <= {result['host_target_us']:.0f} µs per eager call: {verdict}")
    if "sweep" in result:
        print_sweep(result["sweep"])


def print_sweep(sweep: list[dict], top: int = 12) -> None:
    """Graph-mode µs of each configuration per shape, the best first (by the geometric mean of its time over
    the best time on each shape), then the best time any configuration reached per shape."""
    ok = [s for s in sweep if "us" in s]
    shapes = sorted({(s["rows"], s["context"]) for s in ok})
    best = {shape: min(s["us"] for s in ok if (s["rows"], s["context"]) == shape) for shape in shapes}
    configs: dict[tuple, dict] = {}
    for s in ok:
        config = tuple((k, v) for k, v in s.items() if k in TUNABLES)
        configs.setdefault(config, {})[s["rows"], s["context"]] = s["us"]
    complete = {c: times for c, times in configs.items() if len(times) == len(shapes)}

    def regret(times: dict) -> float:
        return math.exp(sum(math.log(times[shape] / best[shape]) for shape in shapes) / len(shapes))

    print(f"\nsweep, graph mode: {len(ok)} measurements, {len(sweep) - len(ok)} failed; µs per call, "
          f"best {top} configurations by geometric-mean time over the per-shape best (unset: the default):")
    header = list(TUNABLES) + [f"{rows} x {context}" for rows, context in shapes] + ["over best"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * (len(TUNABLES) + len(shapes) + 1))
    for config, times in sorted(complete.items(), key=lambda item: regret(item[1]))[:top]:
        values = dict(config)
        cells = [str(values.get(name, "")) for name in TUNABLES] + [f"{times[shape]:.1f}" for shape in shapes]
        print("| " + " | ".join(cells) + f" | {regret(times):.3f} |")
    cells = ["best per shape"] + [""] * (len(TUNABLES) - 1) + [f"{best[shape]:.1f}" for shape in shapes]
    print("| " + " | ".join(cells) + " | 1.000 |")


if __name__ == "__main__":
    main()
