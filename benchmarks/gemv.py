"""Skinny GEMM at decode (model/kernels/gemv.py) against cuBLAS F.linear, at Ouro-1.4B's projection shapes
(or, named by --shapes, Huginn-0125's) in bf16, held against the device-to-device copy bandwidth measured in
the same run.

    python -m benchmarks.gemv --out benchmarks/results/gemv.json [--ms 1,4,16,64] [--jobs 12]

For each shape (qkv, o, gate_up, down, lm_head) and row count M, a handful of candidate configs (tile,
stages, FMA or tl.dot) are timed at every useful split-K. Times are in-graph µs per call: a CUDA graph of
about 48 calls that walk through copies of the weight (at least 256 MB of them, several times the 60 MB
L2), replayed; so neither host launch cost nor L2 reuse flatters the small shapes. Every config is checked
first against an fp32 reference (poisoned output, relative error), twice for bitwise determinism, and
its graph replay against its eager result. Kernel variants are compiled up front in parallel worker
processes (Triton's disk cache carries them over). The run stops timing new configs after --budget s.

Prints a table per shape and M, the per-token projection time (96 layer applications), the host cost
per eager call as a ratio to a bare Triton launch, and a TUNED table to paste into model/kernels/gemv.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import benchmarks.common as common
from model.kernels import gemv
from model.kernels.gemv import GemvConfig
from triton_runtime.pdl import pdl_supported

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048),
          # Huginn-0125's (model/huginn_fused.py), timed only where --shapes names them
          "huginn_qkv": (15840, 5280), "huginn_proj": (5280, 5280), "huginn_fc": (35840, 5280),
          "huginn_mlp_proj": (5280, 17920), "huginn_adapter": (5280, 10560), "huginn_head": (65536, 5280)}
OURO_SHAPES = ("qkv", "o", "gate_up", "down", "lm_head")
LAYER = ("qkv", "o", "gate_up", "down")
LAYER_APPLICATIONS = 96  # 24 layers x 4 loops per token
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20  # weight copies walked per graph: several times the L2
CALLS_PER_GRAPH = 48

# Candidates per M bucket (split_k is swept separately). FMA configs keep the fp32 [BLOCK_N, BLOCK_K]
# accumulator at <= 64 registers a thread.
C = GemvConfig
CANDIDATES: dict[int, list[GemvConfig]] = {
    1: [C(16, 512, use_dot=False), C(32, 256, use_dot=False), C(8, 512, num_stages=4, use_dot=False),
        C(16, 256, num_stages=4, use_dot=False), C(16, 512), C(32, 256), C(64, 256)],
    4: [C(16, 512), C(32, 256), C(32, 256, num_stages=4), C(64, 256), C(32, 512, num_stages=2),
        C(64, 128, num_stages=4)],
    16: [C(16, 512), C(32, 256), C(64, 256), C(64, 128, num_stages=4), C(128, 128), C(32, 512, num_stages=2)],
    64: [C(32, 128), C(64, 128), C(64, 64, num_stages=4), C(128, 128), C(128, 64, num_warps=8, num_stages=4),
         C(64, 256, num_stages=2)],
}


def candidates_for(m: int) -> list[GemvConfig]:
    bucket = gemv.m_bucket(m)
    keys = [b for b in CANDIDATES if b >= bucket]
    return CANDIDATES[min(keys) if keys else max(CANDIDATES)]


def splits_for(config: GemvConfig, n: int, k: int, sms: int) -> list[int]:
    """Distinct effective split counts whose grid has 0.75 to 6 programs per SM (else the one nearest)."""
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    tiles, k_blocks = triton.cdiv(n, config.block_n), triton.cdiv(k, block_k)
    options = sorted({triton.cdiv(k_blocks, triton.cdiv(k_blocks, s)) for s in (1, 2, 4, 8, 16)
                      if s <= k_blocks})
    fits = [s for s in options if 0.75 * sms <= tiles * s <= 6 * sms]
    return fits or [min(options, key=lambda s: abs(math.log(tiles * s / (2 * sms))))]


def jobs(ms: list[int], sms: int) -> list[tuple[str, int, GemvConfig]]:
    """(shape, M, config) in timing order; the default config of each case comes first."""
    out = []
    for name, (n, k) in SHAPES.items():
        for m in ms:
            seen = set()
            default = gemv.default_config(m, n, k, DTYPE, sms)
            configs = [default] + [dataclasses.replace(c, split_k=s) for c in candidates_for(m)
                                   for s in splits_for(c, n, k, sms)]
            for config in configs:
                if config not in seen:
                    seen.add(config)
                    out.append((name, m, config))
    return out


# --- compiling up front ---------------------------------------------------------------------------


def variant_key(m: int, n: int, k: int, config: GemvConfig) -> tuple:
    grid, tail = gemv.kernel_args(m, n, k, k, k, n, DTYPE, config)
    # N, K and the strides are multiples of 16 at every Ouro shape, so Triton specializes them alike;
    # M and k_iters are not specialized.
    return (tail[7:], config.num_warps, config.num_stages)


def _warm(batch: list[tuple[int, int, int, dict]]) -> list[str]:
    """Worker: compile each variant into Triton's disk cache, launching nothing."""
    errors = []
    for m, n, k, fields in batch:
        config = GemvConfig(**fields)
        try:
            # The variant skinny_linear launches: PDL on where the device has it (compiled with it).
            pdl = pdl_supported(torch.device("cuda"))
            grid, tail = gemv.kernel_args(m, n, k, k, k, n, DTYPE, config, pdl)
            gemv.skinny_gemm_kernel.warmup(DTYPE, DTYPE, DTYPE, torch.float32, torch.int32, *tail, grid=grid,
                                           num_warps=config.num_warps, num_stages=config.num_stages,
                                           **({"launch_pdl": True} if pdl else {}))
        except Exception as error:  # noqa: BLE001 - reported, and the main process retries
            errors.append(f"{config}: {type(error).__name__}: {str(error)[:200]}")
    return errors


def precompile(work: list[tuple[str, int, GemvConfig]], workers: int) -> dict:
    variants = {}
    for name, m, config in work:
        n, k = SHAPES[name]
        variants.setdefault(variant_key(m, n, k, config), (m, n, k, dataclasses.asdict(config)))
    start = time.perf_counter()
    errors: list[str] = []
    if workers > 1:
        batches = [list(variants.values())[i::workers] for i in range(workers)]
        try:
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
                for result in pool.map(_warm, batches, timeout=120):
                    errors.extend(result)
        except Exception as error:  # noqa: BLE001 - the main process compiles what is missing
            errors.append(f"pool: {type(error).__name__}: {error}")
    return {"variants": len(variants), "workers": workers, "seconds": time.perf_counter() - start,
            "errors": errors[:20]}


# --- timing ---------------------------------------------------------------------------------------


def graph_time_us(calls, replays: int) -> float:
    """Median µs per call over replays of one CUDA graph holding `calls` (a list of thunks)."""
    return common.graph_time_us(calls, replays, median=True)


def copy_bandwidth_gbps() -> float:
    """Event-timed large device-to-device copy, bytes read + written (benchmarks/common.py); a copy
    captured in a graph runs as a memcpy node at about two thirds of that rate, so it is not used."""
    from benchmarks.common import copy_bandwidth

    return copy_bandwidth() / 1e9


class Case:
    """One projection shape: weight copies to walk, and per M an input, a reference and an output."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.weight_bytes = n * k * DTYPE.itemsize
        self.copies = max(2, math.ceil(ROTATE_BYTES / self.weight_bytes))
        self.weights = torch.empty((self.copies, n, k), dtype=DTYPE, device="cuda").normal_(0, 0.02)
        # A whole number of passes, so the last call uses the last copy (the one checked against eager).
        self.walk = [i % self.copies for i in range(self.copies * math.ceil(CALLS_PER_GRAPH / self.copies))]
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def input(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if m not in self.inputs:
            x = torch.randn((m, self.k), dtype=DTYPE, device="cuda")
            ref = F.linear(x.float(), self.weights[-1].float())
            self.inputs[m] = (x, ref, torch.empty((m, self.n), dtype=DTYPE, device="cuda"))
        return self.inputs[m]

    def replays(self) -> int:
        return 5 if self.weight_bytes > 100 << 20 else 15

    def bytes(self, m: int) -> int:
        return self.weight_bytes + (m * self.k + m * self.n) * DTYPE.itemsize

    def cublas_us(self, m: int) -> float:
        x, _, _ = self.input(m)
        w = self.weights
        return graph_time_us([lambda i=i: F.linear(x, w[i]) for i in self.walk], self.replays())

    def check(self, m: int, config: GemvConfig) -> dict:
        """Error against the fp32 reference, determinism, and graph replay against eager."""
        x, ref, y = self.input(m)
        w = self.weights[-1]
        y.fill_(float("nan"))
        gemv.skinny_linear(x, w, out=y, config=config)
        first = y.clone()
        y.fill_(float("nan"))
        gemv.skinny_linear(x, w, out=y, config=config)
        error = ((first.float() - ref).norm() / ref.norm()).item()
        return {"rel_error": error, "finite": bool(torch.isfinite(first).all()),
                "deterministic": bool(torch.equal(first, y)), "eager": first}

    def triton_us(self, m: int, config: GemvConfig) -> tuple[float, bool]:
        x, _, y = self.input(m)
        w = self.weights
        us = graph_time_us([lambda i=i: gemv.skinny_linear(x, w[i], out=y, config=config) for i in self.walk],
                           self.replays())
        return us, self.walk[-1] == self.copies - 1


def run_case(case: Case, name: str, m: int, config: GemvConfig, copy_gbps: float) -> dict:
    n, k = case.n, case.k
    grid, tail = gemv.kernel_args(m, n, k, k, k, n, DTYPE, config)
    row = {"shape": name, "N": n, "K": k, "M": m, "impl": "triton", "config": dataclasses.asdict(config),
           "splits": grid[1], "programs": grid[0] * grid[1]}
    try:
        check = case.check(m, config)
        eager = check.pop("eager")
        row.update(check)
        us, last_is_checked = case.triton_us(m, config)
        if last_is_checked:
            row["graph_equals_eager"] = bool(torch.equal(case.input(m)[2], eager))
    except Exception as error:  # noqa: BLE001 - a config that does not compile or fit is reported
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        return row
    ok = check["finite"] and check["rel_error"] < 1e-2 and check["deterministic"]
    row.update(ok=ok, us=us, gbps=case.bytes(m) / us / 1e3, frac_copy=case.bytes(m) / us / 1e3 / copy_gbps)
    return row


# --- host cost ------------------------------------------------------------------------------------


def host_costs(case: Case, calls: int = 2000) -> dict:
    """Host µs per eager call in a hot loop without syncs (the kernels are shorter than their launch)."""
    x, _, y = case.input(1)
    w = case.weights[0]
    a = torch.randn(256, device="cuda")
    b = torch.empty_like(a)

    def per_call(fn) -> float:
        return common.host_us(lambda i: fn(), calls)

    bare = common.bare_launch_us(calls)
    result = {"bare_triton_launch_us": bare, "torch_add_us": per_call(lambda: torch.add(a, 1.0, out=b)),
              "skinny_linear_out_us": per_call(lambda: gemv.skinny_linear(x, w, out=y)),
              "skinny_linear_alloc_us": per_call(lambda: gemv.skinny_linear(x, w)),
              "linear_dispatch_us": per_call(lambda: gemv.linear(x, w)),
              "f_linear_us": per_call(lambda: F.linear(x, w))}
    for key in ("skinny_linear_out_us", "skinny_linear_alloc_us", "linear_dispatch_us", "f_linear_us"):
        result[key.replace("_us", "_ratio_to_bare_launch")] = result[key] / bare
    return result


# --- report ---------------------------------------------------------------------------------------


def summarize(rows: list[dict], ms: list[int]) -> dict:
    best, summary = {}, {}
    for name in SHAPES:
        for m in ms:
            cases = [r for r in rows if r["shape"] == name and r["M"] == m]
            triton_rows = [r for r in cases if r["impl"] == "triton" and r.get("ok")]
            cublas = next((r for r in cases if r["impl"] == "cublas"), None)
            if not triton_rows or cublas is None:
                continue
            top = min(triton_rows, key=lambda r: r["us"])
            default = triton_rows[0] if triton_rows[0].get("default") else None
            best[f"{name}/{m}"] = {
                "shape": name, "M": m, "config": top["config"], "us": top["us"],
                "frac_copy": top["frac_copy"],
                "cublas_us": cublas["us"], "cublas_frac_copy": cublas["frac_copy"],
                "speedup_vs_cublas": cublas["us"] / top["us"],
                "default_us": default["us"] if default else None}
    for m in ms:
        keys = [f"{name}/{m}" for name in LAYER]
        if all(key in best for key in keys):
            layer_best = sum(best[key]["us"] for key in keys)
            layer_cublas = sum(best[key]["cublas_us"] for key in keys)
            summary[m] = {"layer_us": layer_best, "layer_cublas_us": layer_cublas,
                          "per_token_ms": layer_best * LAYER_APPLICATIONS / 1e3,
                          "per_token_cublas_ms": layer_cublas * LAYER_APPLICATIONS / 1e3}
    return {"best": best, "per_m": summary}


def tuned_table(best: dict) -> str:
    lines = ["TUNED: dict[tuple[int, int], dict[int, GemvConfig]] = {"]
    for name, (n, k) in SHAPES.items():
        entries = [item for item in best.values() if item["shape"] == name]
        if not entries:
            continue
        lines.append(f"    ({n}, {k}): {{  # {name}")
        for item in entries:
            c = item["config"]
            lines.append(f"        {gemv.m_bucket(item['M'])}: GemvConfig({c['block_n']}, {c['block_k']}, "
                         f"{c['split_k']}, {c['num_warps']}, {c['num_stages']}, {c['use_dot']}"
                         f"{', preload=True' if c.get('preload') else ''}),  "
                         f"# {item['us']:.1f} us, {item['frac_copy']:.2f} of copy")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def config_text(c: dict) -> str:
    path = "dot" if c["use_dot"] else "fma"
    return f"{path} n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}"


def print_report(result: dict) -> None:
    print(f"\ncopy bandwidth {result['copy_gbps']:.0f} GB/s; {result['env']['device']}, torch "
          f"{result['env']['torch']}, triton {result['env']['triton']}; {result['seconds']:.0f} s")
    print(f"precompile: {result['precompile']}")
    print(f"host: {json.dumps({k: round(v, 2) for k, v in result['host'].items()})}")
    bad = [r for r in result["rows"] if r["impl"] == "triton" and not r.get("ok")]
    for r in bad[:10]:
        print(f"NOT OK {r['shape']} M={r['M']} {config_text(r['config'])}: "
              f"{r.get('error') or {k: r.get(k) for k in ('rel_error', 'finite', 'deterministic')}}")
    mismatched = [r for r in result["rows"] if r.get("graph_equals_eager") is False]
    print(f"graph replay != eager in {len(mismatched)} configs")
    print("\n| shape | M | cuBLAS µs | frac | best µs | frac | x cuBLAS | default µs | best config | progs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for item in result["summary"]["best"].values():
        top = next(r for r in result["rows"] if r["impl"] == "triton" and r["shape"] == item["shape"]
                   and r["M"] == item["M"] and r["config"] == item["config"])
        default = f"{item['default_us']:.1f}" if item["default_us"] else "-"
        print(f"| {item['shape']} | {item['M']} | {item['cublas_us']:.1f} | {item['cublas_frac_copy']:.2f} | "
              f"{item['us']:.1f} | {item['frac_copy']:.2f} | {item['speedup_vs_cublas']:.2f} | {default} | "
              f"{config_text(item['config'])} | {top['programs']} |")
    print("\n| M | 4 projections µs (best) | cuBLAS | per token ms x96 (best) | cuBLAS |")
    print("|---|---|---|---|---|")
    for m, s in result["summary"]["per_m"].items():
        print(f"| {m} | {s['layer_us']:.1f} | {s['layer_cublas_us']:.1f} | {s['per_token_ms']:.2f} | "
              f"{s['per_token_cublas_ms']:.2f} |")
    print("\n" + result["tuned_table"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--ms", default="1,4,16,64", help="row counts M, comma-separated")
    parser.add_argument("--shapes", default=",".join(OURO_SHAPES),
                        help="shape names, comma-separated (default: Ouro-1.4B's)")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="worker processes compiling kernel variants up front (1: compile lazily)")
    parser.add_argument("--budget", type=float, default=80.0,
                        help="seconds after which no new config is timed")
    args = parser.parse_args()
    start = time.perf_counter()
    ms = [int(v) for v in args.ms.split(",")]
    for name in [n for n in SHAPES if n not in args.shapes.split(",")]:
        del SHAPES[name]
    from benchmarks.common import environment

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    work = jobs(ms, sms)
    compiled = precompile(work, args.jobs)
    print(f"{len(work)} configs, {compiled['variants']} kernel variants precompiled in "
          f"{compiled['seconds']:.1f} s", flush=True)
    copy_gbps = copy_bandwidth_gbps()
    gemv.reserve_workspace("cuda")
    rows, skipped, host = [], 0, {}
    for name, (n, k) in SHAPES.items():
        case = Case(n, k)
        for m in ms:
            cublas = case.cublas_us(m)
            rows.append({"shape": name, "N": n, "K": k, "M": m, "impl": "cublas", "us": cublas,
                         "gbps": case.bytes(m) / cublas / 1e3,
                         "frac_copy": case.bytes(m) / cublas / 1e3 / copy_gbps})
            timed = []
            for job_name, job_m, config in work:
                if job_name != name or job_m != m:
                    continue
                if timed and time.perf_counter() - start > args.budget:
                    skipped += 1
                    continue
                row = run_case(case, name, m, config, copy_gbps)
                row["default"] = not timed
                timed.append(row)
            rows.extend(timed)
            best = min((r["us"] for r in timed if r.get("ok")), default=float("nan"))
            print(f"{name} M={m}: cuBLAS {cublas:.1f} µs, best of {len(timed)} configs {best:.1f} µs "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        if name == "qkv":
            host = host_costs(case)
        del case
        torch.cuda.empty_cache()
    summary = summarize(rows, ms)
    result = {"env": environment(), "copy_gbps": copy_gbps, "sms": sms, "precompile": compiled,
              "host": host, "rows": rows, "skipped_for_budget": skipped,
              "summary": summary, "tuned_table": tuned_table(summary["best"]),
              "seconds": time.perf_counter() - start}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print_report(result)
    if skipped:
        print(f"\n{skipped} configs skipped: the {args.budget:.0f} s budget ran out")


if __name__ == "__main__":
    main()
