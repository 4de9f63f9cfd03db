"""Where a graph-replayed decode step spends its time: torch.profiler over replays of the captured
batch-1 step, kernels grouped by what they do, with the kernel count per step and per layer application
(a step applies loops x layers of them; kernels outside the layers, such as the embedding, lm_head and
the per-loop first norm, count in the step's total only as a fraction).

Kernels overlap under Programmatic Dependent Launch: a kernel starts while its predecessor runs and waits
for it, so summed kernel durations exceed the step. Each kernel is therefore charged the time from its
predecessor's end (or its own start, if later) to its own end: the device timeline split between the
kernels, and the gap time, when no kernel runs (launch latency between graph nodes, whatever the host leaves
idle), apart. The step's device time is also timed with CUDA events around as many steps, without the
profiler. Each group's byte floor, at the copy bandwidth measured in the same run: the projections read every
linear weight once per loop plus lm_head once, attention reads the rows' past K/V in every (loop, layer)
slot. "Of floor" is floor / charged time (1.0 would run at copy bandwidth).

    python -m benchmarks.profile_decode --preset ouro-1.4b --out benchmarks/results/profile_decode-<date>.json
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import (BATCHED_TOKENS, checkpoint, copy_bandwidth, environment, head_start,
                               kv_bytes_read_per_token, prefill_until_first_tokens, write_results)
from cache.kv_formats import FORMATS
from engine import Engine, SamplingParams

TOP_KERNELS = 12
ATTENTION, PROJECTIONS = "attention", "projections (skinny GEMM, with or without an epilogue)"
GROUPS = [(ATTENTION, ("decode_split", "decode_merge", "prefill", "kv_store", "kvarn", "rotate", "pack")),
          (PROJECTIONS, ("skinny_gemm",)),
          ("norms, RoPE, SiLU (fused)", ("rmsnorm", "silu_mul", "rope")),
          ("cuBLAS GEMM", ("gemm", "gemv", "cutlass", "sm90", "nvjet")),
          ("embedding, gate, copies, other torch", ("",))]


def group_of(name: str) -> str:
    lowered = name.lower()
    return next(group for group, keys in GROUPS if any(key in lowered for key in keys))


def charged_time(prof, steps: int) -> tuple[dict[str, float], dict[str, int], float, float, dict[str, float]]:
    """Per group, the device µs a step charged to its kernels (each from its predecessor's end, or its own
    start if later, to its own end) and their count a step; the gap µs a step (no kernel running), the
    profiled span a step, and the µs a step charged per kernel name."""
    kernels = sorted((event for event in prof.events() if event.device_type == DeviceType.CUDA),
                     key=lambda event: event.time_range.start)
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    by_name: dict[str, float] = collections.defaultdict(float)
    gap, previous_end = 0.0, kernels[0].time_range.start
    for event in kernels:
        start, end = event.time_range.start, event.time_range.end
        gap += max(0.0, start - previous_end)
        group = group_of(event.name)
        charged = max(0.0, end - max(start, previous_end)) / steps
        totals[group] += charged
        by_name[event.name] += charged
        counts[group] += 1
        previous_end = max(previous_end, end)
    span = previous_end - kernels[0].time_range.start
    return (totals, {group: count // steps for group, count in counts.items()}, gap / steps, span / steps,
            by_name)


def projection_bytes(engine) -> int:
    """Bytes of the linear weights a decode step reads: the layers' once per loop, lm_head once."""
    model = engine.model
    layers = sum(module.weight.numel() * module.weight.element_size() for module in model.layers.modules()
                 if isinstance(module, torch.nn.Linear))
    head = model.lm_head.weight
    return engine.engine_config.loops * layers + head.numel() * head.element_size()


def profiled_steps(path: str, args: argparse.Namespace, bandwidth: float):
    """Decode steps of `args.batch` rows after their prefill: the profiler's record of args.steps of them, the
    step time by CUDA events without the profiler (µs), the layer applications a step runs, and the byte
    floors (µs) of its projections and attention."""
    # Rows whose prefill ends early decode beside the later rows' chunks: their budgets leave room for that.
    budget = head_start(args.batch, args.prompt, BATCHED_TOKENS) + 3 * args.steps + 1
    with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batch, 8),
                max_model_len=args.prompt + budget + 8, max_num_batched_tokens=BATCHED_TOKENS,
                enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype,
                block_size=args.block_size) as engine:
        params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
        for _ in range(args.batch):
            engine.add_request(list(range(3, 3 + args.prompt)), params)
        prefill_until_first_tokens(engine, args.batch)  # every row decodes in the steps below
        for _ in range(args.steps):  # warm decode steps
            engine.step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.steps):
            engine.step()
        end.record()
        torch.cuda.synchronize()
        step_wall_us = start.elapsed_time(end) * 1e3 / args.steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        applications = engine.engine_config.loops * engine.config.num_hidden_layers
        # The mean context of the profiled steps, short of the tokens early rows decoded beside the
        # prefill (a lower floor: "of floor" errs low)
        context = args.prompt + 2.5 * args.steps
        floors_us = {PROJECTIONS: projection_bytes(engine) / bandwidth * 1e6,
                     ATTENTION: kv_bytes_read_per_token(engine) * args.batch * context / bandwidth * 1e6}
    return prof, step_wall_us, applications, floors_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(FORMATS))
    parser.add_argument("--block-size", type=int, default=16, help="64 for the KVarN g64 formats")
    parser.add_argument("--out", default=f"benchmarks/results/profile_decode-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    bandwidth = copy_bandwidth()
    prof, step_wall_us, applications, floors_us = profiled_steps(path, args, bandwidth)
    totals, counts, gap_us, span_us, by_name = charged_time(prof, args.steps)
    step_us = sum(totals.values())
    rows = [{"group": g, "us_per_step": round(totals[g], 1), "kernels_per_step": counts[g],
             "kernels_per_layer_application": round(counts[g] / applications, 2),
             "share": round(totals[g] / step_us, 3),
             "floor_us": round(floors_us[g], 1) if g in floors_us else None,
             "of_floor": round(floors_us[g] / totals[g], 2) if g in floors_us else None}
            for g, _ in GROUPS if g in totals]
    env = environment()
    lines = [f"Decode step profile, {path} (bf16, KV {args.kv_cache_dtype}), batch {args.batch}, prompt "
             f"{args.prompt}, CUDA graphs, {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"commit {env['commit']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s", "",
             "| kernels | µs per step | share | kernels per step | per layer application | byte floor µs "
             "| of floor |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['group']} | {r['us_per_step']} | {r['share']:.0%} | {r['kernels_per_step']} | "
              f"{r['kernels_per_layer_application']} | {r['floor_us'] or '-'} | {r['of_floor'] or '-'} |"
              for r in rows]
    total = sum(counts.values())
    lines.append(f"| kernels, charged | {step_us:.1f} | | {total} | {total / applications:.2f} | | |")
    in_layers = counts.get(ATTENTION, 0) + counts.get(PROJECTIONS, 0)
    lines.append(f"| of which in the layers (attention, projections) / outside | | | {in_layers} / "
                 f"{total - in_layers} | {in_layers / applications:.2f} / - | | |")
    lines.append(f"| gap (no kernel running) | {gap_us:.1f} | {gap_us / span_us:.0%} of the profiled step "
                 "| | | | |")
    lines.append(f"| step: profiled span / CUDA events, no profiler | {span_us:.1f} / {step_wall_us:.1f} "
                 "| | | | | |")
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    lines += ["", f"The {len(top)} kernels charged the most time", "", "| kernel | µs per step |",
              "|---|---|"]
    lines += [f"| `{name[:90]}` | {us:.1f} |" for name, us in top]
    write_results(args.out, {**env, "model": path, "kv_cache_dtype": args.kv_cache_dtype, "batch": args.batch,
                             "prompt": args.prompt, "copy_bandwidth_bytes_per_s": bandwidth,
                             "kernel_us_per_step": step_us, "gap_us": gap_us, "profiled_step_us": span_us,
                             "step_wall_us": step_wall_us,
                             "kernels_per_step": total, "layer_applications_per_step": applications,
                             "kernels_per_layer_application": round(total / applications, 2),
                             "layer_kernels_per_layer_application": round(in_layers / applications, 2),
                             "kernels_outside_layers_per_step": total - in_layers,
                             "rows": rows,
                             "top_kernels": [{"kernel": k, "us_per_step": round(us, 1)} for k, us in top]},
                  "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
