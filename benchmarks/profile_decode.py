"""Where a graph-replayed decode step spends its time: torch.profiler over replays of the captured
batch-1 step, kernels grouped by what they do, with the kernel count per step and per layer application
(a step applies loops x layers of them; kernels outside the layers, such as the embedding, lm_head and
the per-loop first norm, count in the step's total only as a fraction).

    python -m benchmarks.profile_decode --preset ouro-1.4b --out benchmarks/results/profile_decode-<date>.json
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import checkpoint, environment, write_results
from engine import Engine, SamplingParams

GROUPS = [("attention", ("decode_split", "decode_merge", "prefill", "kv_store")),
          ("projections (skinny GEMM, with or without an epilogue)", ("skinny_gemm",)),
          ("norms, RoPE, SiLU (fused)", ("rmsnorm", "silu_mul", "rope")),
          ("cuBLAS GEMM", ("gemm", "gemv", "cutlass", "sm90", "nvjet")),
          ("embedding, gate, copies, other torch", ("",))]


def group_of(name: str) -> str:
    lowered = name.lower()
    return next(group for group, keys in GROUPS if any(key in lowered for key in keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=f"benchmarks/results/profile_decode-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batch, 8),
                max_model_len=args.prompt + 4 * args.steps + 8, enable_prefix_caching=False) as engine:
        params = SamplingParams(temperature=0, max_tokens=4 * args.steps, ignore_eos=True)
        for _ in range(args.batch):
            engine.add_request(list(range(3, 3 + args.prompt)), params)
        for _ in range(args.steps):  # prefill, then warm decode steps
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = event.self_cuda_time_total
        if device_us <= 0:
            continue
        group = group_of(event.key)
        totals[group] += device_us / args.steps
        counts[group] += event.count // args.steps
    applications = engine.engine_config.loops * engine.config.num_hidden_layers
    step_us = sum(totals.values())
    rows = [{"group": g, "us_per_step": round(totals[g], 1), "kernels_per_step": counts[g],
             "kernels_per_layer_application": round(counts[g] / applications, 2),
             "share": round(totals[g] / step_us, 3)} for g, _ in GROUPS if g in totals]
    env = environment()
    lines = [f"Decode step profile, {path} (bf16), batch {args.batch}, prompt {args.prompt}, CUDA graphs, "
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}", "",
             "| kernels | µs per step | share | kernels per step | per layer application |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['group']} | {r['us_per_step']} | {r['share']:.0%} | {r['kernels_per_step']} | "
              f"{r['kernels_per_layer_application']} |" for r in rows]
    total = sum(counts.values())
    lines.append(f"| total kernel time | {step_us:.1f} | | {total} | {total / applications:.2f} |")
    write_results(args.out, {**env, "model": path, "batch": args.batch, "prompt": args.prompt,
                             "kernel_us_per_step": step_us, "kernels_per_step": total,
                             "layer_applications_per_step": applications,
                             "kernels_per_layer_application": round(total / applications, 2),
                             "rows": rows}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
