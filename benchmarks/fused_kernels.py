"""The fused elementwise kernels (model/kernels/fused.py) against the torch ops they replace, on CUDA:
device µs per call, GPU kernels per call (counted by the profiler), and host µs per eager call held
against a bare Triton launch measured in the same run.

    python -m benchmarks.fused_kernels --out benchmarks/results/fused_kernels.json

Ouro-1.4B shapes (hidden 2048, intermediate 5632, 16 heads x 128), bf16, at 1, 16 and 64 rows. Device
times come from CUDA-graph replays of many calls, so host launch cost is not in them. Inputs are not
rotated: in a step these activations were just written by the projection before, so they sit in L2.
The floor is the bytes moved at the device-to-device copy rate; at these sizes the kernels are bound by
latency, not bandwidth, and the figure that matters is µs and kernels per layer application.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton

import benchmarks.common as common
from benchmarks.common import commit as common_commit

from model.kernels.fused import add_rmsnorm, add_rmsnorm_rmsnorm, rmsnorm, rope_qkv, silu_mul
from model.ouro import RMSNorm, Rotary, apply_rope

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM, EPS = 2048, 5632, 16, 128, 1e-6
LAYER_APPLICATIONS = 96  # Ouro-1.4B: 24 layers x 4 loops per token
ROWS = (1, 16, 64)
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 32
BLOCK_SIZE = 16


def graph_time_us(fn: Callable[[], object], calls: int = CALLS_PER_GRAPH, replays: int = 20) -> float:
    """Mean device µs per call of `fn`, captured `calls` times in one CUDA graph and replayed."""
    return common.graph_time_us([fn] * calls, replays)


def host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    return common.host_us(lambda i: fn(), calls)


def kernels_per_call(fn: Callable[[], object]) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def copy_bandwidth_gbps() -> float:
    """Event-timed large device-to-device copy, bytes read + written (benchmarks/common.py); a copy
    captured in a graph runs as a memcpy node at about two thirds of that rate, so it is not used."""
    from benchmarks.common import copy_bandwidth

    return copy_bandwidth() / 1e9


def torch_norm(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(HIDDEN, EPS).to(device="cuda", dtype=DTYPE)
    norm.weight.data.copy_(weight)
    norm.requires_grad_(False)
    return norm


class Inputs:
    """One layer application's activations and weights at `rows` rows, with a one-slot KV plane."""

    def __init__(self, rows: int) -> None:
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", dtype=DTYPE)

        self.rows = rows
        self.h, self.o, self.d = randn(rows, HIDDEN), randn(rows, HIDDEN), randn(rows, HIDDEN)
        self.weights = [1 + 0.1 * randn(HIDDEN) for _ in range(4)]
        self.norms = [torch_norm(w) for w in self.weights]
        self.gate_up = randn(rows, 2 * INTERMEDIATE)
        self.qkv = randn(rows, 3 * HEADS * HEAD_DIM)
        positions = torch.randint(0, 4096, (rows,), device="cuda")
        self.cos, self.sin = Rotary(HEAD_DIM, 1e6).to("cuda")(positions, DTYPE)
        num_blocks = rows * 8
        self.key_cache = randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
        self.value_cache = torch.empty_like(self.key_cache)
        self.slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:rows]


def torch_rope(x: Inputs, store: bool = False):
    q, k, v = x.qkv.split([HEADS * HEAD_DIM] * 3, -1)
    q = apply_rope(q.view(x.rows, HEADS, HEAD_DIM), x.cos, x.sin)
    k = apply_rope(k.view(x.rows, HEADS, HEAD_DIM), x.cos, x.sin)
    v = v.view(x.rows, HEADS, HEAD_DIM)
    if store:
        x.key_cache.view(-1, HEADS, HEAD_DIM)[x.slot_mapping] = k
        x.value_cache.view(-1, HEADS, HEAD_DIM)[x.slot_mapping] = v
    return q, k, v


def torch_silu_mul(x: Inputs) -> torch.Tensor:
    gate, up = x.gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def cases(x: Inputs) -> dict[str, tuple[Callable, Callable, int]]:
    """name -> (fused call, torch call, bytes the fused kernel moves)."""
    n1, n2, n3, n4 = x.norms
    w1, w2, w3, w4 = x.weights
    row, weights, e = x.rows * HIDDEN * 2, HIDDEN * 2, 2
    qk = 2 * HEADS * HEAD_DIM * x.rows * e
    rope_bytes = 2 * qk + 2 * HEAD_DIM * x.rows * e
    store_args = (x.key_cache, x.value_cache, x.slot_mapping)

    def torch_layer():
        torch_rope(x)
        h = x.h + n1(x.o)
        n2(h)
        torch_silu_mul(x)
        h = h + n3(x.d)
        return n4(h)

    def fused_layer():
        rope_qkv(x.qkv, x.cos, x.sin, HEADS, HEADS, HEAD_DIM)
        h, _ = add_rmsnorm_rmsnorm(x.h, x.o, w1, w2, EPS)
        silu_mul(x.gate_up)
        return add_rmsnorm_rmsnorm(h, x.d, w3, w4, EPS)

    return {
        "rmsnorm": (lambda: rmsnorm(x.h, w1, EPS), lambda: n1(x.h), 2 * row + weights),
        "add_rmsnorm": (lambda: add_rmsnorm(x.h, x.o, w1, EPS), lambda: x.h + n1(x.o), 3 * row + weights),
        "add_rmsnorm_rmsnorm": (lambda: add_rmsnorm_rmsnorm(x.h, x.o, w1, w2, EPS),
                                lambda: n2(x.h + n1(x.o)), 4 * row + 2 * weights),
        "silu_mul": (lambda: silu_mul(x.gate_up), lambda: torch_silu_mul(x), 3 * x.rows * INTERMEDIATE * e),
        "rope_qkv": (lambda: rope_qkv(x.qkv, x.cos, x.sin, HEADS, HEADS, HEAD_DIM), lambda: torch_rope(x),
                     rope_bytes),
        "rope_qkv+kv_store": (lambda: rope_qkv(x.qkv, x.cos, x.sin, HEADS, HEADS, HEAD_DIM, *store_args),
                              lambda: torch_rope(x, store=True), rope_bytes + 3 * qk // 2),
        "layer (all of the above a layer needs)": (fused_layer, torch_layer,
                                                   rope_bytes + 2 * (4 * row + 2 * weights)
                                                   + 3 * x.rows * INTERMEDIATE * e),
    }


def measure(copy_gbps: float) -> list[dict]:
    results = []
    for rows in ROWS:
        x = Inputs(rows)
        for name, (fused, reference, nbytes) in cases(x).items():
            fused_us, torch_us = graph_time_us(fused), graph_time_us(reference)
            results.append({
                "kernel": name, "rows": rows, "bytes": nbytes, "floor_us": nbytes / copy_gbps / 1e3,
                "fused_us": fused_us, "torch_us": torch_us,
                "fused_kernels": kernels_per_call(fused), "torch_kernels": kernels_per_call(reference),
                "fused_host_us": host_us(fused), "torch_host_us": host_us(reference)})
    return results


def print_table(result: dict) -> None:
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}; copy "
          f"{result['copy_gbps']:.0f} GB/s; bare Triton launch {result['bare_launch_us']:.1f} µs host\n")
    print("| kernel | rows | fused µs | torch µs | speedup | kernels fused / torch | floor µs "
          "| fused / floor | host µs fused / torch | fused host / bare launch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['kernel']} | {r['rows']} | {r['fused_us']:.2f} | {r['torch_us']:.2f} | "
              f"{r['torch_us'] / r['fused_us']:.1f}x | {r['fused_kernels']} / {r['torch_kernels']} | "
              f"{r['floor_us']:.2f} | {r['fused_us'] / r['floor_us']:.1f} | "
              f"{r['fused_host_us']:.1f} / {r['torch_host_us']:.1f} | "
              f"{r['fused_host_us'] / result['bare_launch_us']:.2f} |")
    n = LAYER_APPLICATIONS
    print()
    for r in result["rows"]:
        if r["kernel"].startswith("layer"):
            print(f"per token at {r['rows']} rows ({n} layer applications): fused "
                  f"{r['fused_us'] * n / 1e3:.2f} ms in {r['fused_kernels'] * n} kernels, torch "
                  f"{r['torch_us'] * n / 1e3:.2f} ms in {r['torch_kernels'] * n} kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": common_commit(),
              "dtype": str(DTYPE), "copy_gbps": copy_gbps,
              "bare_launch_us": common.bare_launch_us(), "rows": measure(copy_gbps)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


if __name__ == "__main__":
    main()
