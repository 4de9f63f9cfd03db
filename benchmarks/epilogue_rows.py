"""The norm epilogue of the o and down projections (model/kernels/gemv_epilogues.py, linear_add_norms) by row
count, against the same GEMM followed by a separate norm kernel: where does one program norming every row
stop paying for the launch it saves?

    python -m benchmarks.epilogue_rows --out benchmarks/results/epilogue_rows.json

For Ouro-1.4B's o (2048 x 2048) and down (2048 x 5632) shapes in bf16 and M = 1, 2, 4, 8, 16 rows, in-graph
µs per call of: the plain skinny GEMM; the GEMM then fused.add_rmsnorm_rmsnorm (the unfused composition,
one launch more); and linear_add_norms, whose last tile's program norms every row. Calls walk
through copies of the weight (at least 256 MB, several times the 60 MB L2), as benchmarks/gemv.py does,
and run back to back in one CUDA graph with PDL, as in a decode step.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import environment, graph_time_us, write_results
from benchmarks.gemv import CALLS_PER_GRAPH, DTYPE, ROTATE_BYTES
from model.kernels.fused import add_rmsnorm_rmsnorm
from model.kernels.gemv import reserve_workspace, skinny_linear
from model.kernels.gemv_epilogues import linear_add_norms

HIDDEN, INTERMEDIATE, EPS = 2048, 5632, 1e-6
SHAPES = {"o": HIDDEN, "down": INTERMEDIATE}  # name -> K (N = HIDDEN)
ROWS = (1, 2, 4, 8, 16)


def rows_for(name: str, k: int, m: int, replays: int) -> list[dict]:
    weight_bytes = HIDDEN * k * DTYPE.itemsize
    copies = max(2, math.ceil(ROTATE_BYTES / weight_bytes))
    weights = torch.empty((copies, HIDDEN, k), dtype=DTYPE, device="cuda").normal_(0, 0.02)
    walk = [i % copies for i in range(CALLS_PER_GRAPH)]
    x = torch.randn(m, k, dtype=DTYPE, device="cuda")
    residual = torch.randn(m, HIDDEN, dtype=DTYPE, device="cuda")
    norm_weight, next_weight = (1 + 0.1 * torch.randn(2, HIDDEN, device="cuda")).to(DTYPE)

    def unfused(i: int):
        return add_rmsnorm_rmsnorm(residual, skinny_linear(x, weights[i]), norm_weight, next_weight, EPS)

    def epilogue(i: int):
        return linear_add_norms(x, weights[i], residual, norm_weight, next_weight, EPS)

    cases = {"gemm": lambda i: skinny_linear(x, weights[i]), "gemm + norm kernel": unfused,
             "norm epilogue": epilogue}
    results = []
    for case, fn in cases.items():
        us = graph_time_us([lambda i=i: fn(i) for i in walk], replays, median=True)
        row = {"shape": name, "m": m, "case": case, "us": us, "weight_gbps": weight_bytes / us / 1e3}
        results.append(row)
        print(f"{name} M={m} {case}: {us:.2f} µs", flush=True)
    return results


def table(payload: dict) -> str:
    lines = [f"{payload['device']}, torch {payload['torch']}, triton {payload['triton']}, commit "
             f"{payload['commit']}; bf16, N = {HIDDEN}, weights walked over {ROTATE_BYTES >> 20} MB", "",
             "| shape | M | case | µs | weight GB/s |", "|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['shape']} | {r['m']} | {r['case']} | {r['us']:.2f} | {r['weight_gbps']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results (and a .md beside it)")
    parser.add_argument("--replays", type=int, default=15)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.epilogue_rows times CUDA kernels, and torch sees no CUDA device here")
    torch.manual_seed(0)
    reserve_workspace("cuda")
    rows = [r for name, k in SHAPES.items() for m in ROWS for r in rows_for(name, k, m, args.replays)]
    payload = {**environment(), "rows": rows}
    text = table(payload)
    write_results(args.out, payload, text)
    print(text)


if __name__ == "__main__":
    main()
