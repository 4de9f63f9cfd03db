"""Deterministic mode's GEMM past MAX_SKINNY_M rows (model/kernels/gemv.py: tiled_linear under
invariant_config) against cuBLAS F.linear, at Ouro-1.4B's projection shapes in bf16: the row counts of
large decode batches (128-512) and of prompt chunks (2K-8K). Each candidate tile (TiledTile: tile, K block,
warps, stages, a program per split or not) must give the skinny kernel's bits (checked on the first
MAX_SKINNY_M rows: "other bits" where not); then the fastest per row count can be taken freely.

    python -m benchmarks.invariant_gemm --out /tmp/invariant_gemm.json

Times: event-timed µs a call, the median of --repeats calls walking through enough weight copies (256 MB)
that no call finds its weight in L2; TFLOP/s beside them.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import environment, write_results
from model.kernels import gemv
from model.kernels.gemv import TiledTile

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048)}
T = TiledTile
CANDIDATES = {
    "64x64 w4 s4 split": T(64, 64, 4, 4, split_programs=True),
    "64x128 w4 s3 split": T(64, 128, 4, 3, split_programs=True),
    "128x64 w4 s3 split": T(128, 64, 4, 3, split_programs=True),
    "128x128 w8 s3 split": T(128, 128, 8, 3, split_programs=True),
    "64x128 w4 s4": T(64, 128, 4, 4),
    "128x128 w8 s3": T(128, 128, 8, 3),
    "128x128 w8 s4": T(128, 128, 8, 4),
    "128x256 w8 s3": T(128, 256, 8, 3),
    "256x128 w8 s3": T(256, 128, 8, 3),
    "128x128 k64 w8 s4": T(128, 128, 8, 4, block_k=64),
    "128x128 k64 w4 s4": T(128, 128, 4, 4, block_k=64),
    "128x256 k64 w8 s3": T(128, 256, 8, 3, block_k=64),
    "128x256 k64 w8 s4": T(128, 256, 8, 4, block_k=64),
    "256x128 k64 w8 s3": T(256, 128, 8, 3, block_k=64),
    "256x128 k64 w8 s4": T(256, 128, 8, 4, block_k=64),
    "128x64 k64 w4 s4 split": T(128, 64, 4, 4, split_programs=True, block_k=64),
    "128x128 k64 w8 s4 split": T(128, 128, 8, 4, split_programs=True, block_k=64),
}
ROTATE_BYTES = 256 << 20


def time_us(call, copies: int, repeats: int) -> float:
    """Median event-timed µs of call(i), i walking through the weight copies."""
    for i in range(copies):
        call(i)
    torch.cuda.synchronize()
    times = []
    for r in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(r % copies)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", type=int, nargs="+", default=[128, 256, 512, 2048, 8192])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(1, ROTATE_BYTES // (n * k * 2))
        weights = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        config = gemv.invariant_config(n, k, torch.bfloat16, sms)
        splits = gemv.k_splits(k, config)[2]
        for m in args.ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            reference = F.linear(x, weights[0])
            skinny = gemv.skinny_linear(x[:gemv.MAX_SKINNY_M], weights[0], config=config)
            flops = 2 * m * n * k
            row = {"shape": name, "m": m, "config": str(config),
                   "cublas_us": round(time_us(lambda i: F.linear(x, weights[i]), copies, args.repeats), 2)}
            for label, tile in CANDIDATES.items():
                tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
                partial_bytes = tiles * tile.block_m * tile.block_n * splits * 4
                if tile.split_programs and splits > 1 and partial_bytes > 64 << 20:
                    continue  # its partials would take more than 64 MB
                try:
                    y = gemv.tiled_linear(x, weights[0], config, tile=tile)
                    if not torch.allclose(y.float(), reference.float(), rtol=2e-2, atol=2e-2):
                        row[label] = "wrong"
                        continue
                    if not torch.equal(y[:gemv.MAX_SKINNY_M], skinny):
                        row[label] = "other bits"  # than the skinny kernel's: not batch-invariant
                        continue
                    row[label] = round(time_us(lambda i: gemv.tiled_linear(x, weights[i], config, tile=tile),
                                               copies, args.repeats), 2)
                except Exception as error:  # noqa: BLE001 - a tile that does not compile is reported
                    row[label] = f"{type(error).__name__}"
            timed = {label: us for label, us in row.items() if label in CANDIDATES and isinstance(us, float)}
            best = min(timed, key=timed.get)
            row.update(best=best, best_us=timed[best], engine_tile=str(gemv.tiled_tile(m, splits)),
                       best_over_cublas=round(timed[best] / row["cublas_us"], 3),
                       best_tflops=round(flops / timed[best] / 1e6, 1))
            rows.append(row)
            print(row, flush=True)
    env = environment()
    lines = [f"Deterministic mode's tiled GEMM against cuBLAS, bf16, {env['device']}, torch {env['torch']}, "
             f"triton {env['triton']}, commit {env['commit']}; µs a call (median), cold L2.", "",
             "| shape | M | cuBLAS µs | best tile | µs | / cuBLAS | TFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['m']} | {r['cublas_us']} | {r['best']} | {r['best_us']} | "
              f"{r['best_over_cublas']} | {r['best_tflops']} |" for r in rows]
    table = "\n".join(lines)
    write_results(args.out, {**env, "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
