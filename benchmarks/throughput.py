"""nano-vllm's throughput workload: 256 requests, prompt and output lengths uniform in [100, 1024],
ignore_eos, seed 0. Reports output and total tok/s, and the roofline of the batches actually run: per
step, max(bytes / copy bandwidth, FLOPs / matmul rate), where a step reads the weights T times plus
every row's KV, and does 2 x params x T FLOPs per token. With the GPU time of mixed and decode steps and the
GPU's idle time between steps, from events around each step; --async-scheduling on off runs it both ways.

    python -m benchmarks.throughput --preset ouro-1.4b --out benchmarks/results/throughput-<date>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import time

import torch

from benchmarks.common import (checkpoint, copy_bandwidth, environment, kv_bytes_read_per_token, matmul_rate,
                               weight_bytes_per_step, write_results)
from engine import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--admission", default="reserve", choices=["reserve", "greedy"])
    parser.add_argument("--async-scheduling", nargs="+", default=["on"], choices=["on", "off"],
                        help="one run per value, in order (default: on)")
    parser.add_argument("--deterministic", nargs="+", default=["off"], choices=["on", "off"],
                        help="Engine(deterministic=...), one run per value for each --async-scheduling value")
    parser.add_argument("--out", default=f"benchmarks/results/throughput-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    bandwidth, flops_rate = copy_bandwidth(), matmul_rate()
    rows = [run_workload(path, args, mode == "on", bandwidth, flops_rate, deterministic == "on")
            for mode in args.async_scheduling for deterministic in args.deterministic]
    env = environment()
    table = (f"Throughput, {path} (bf16) on {env['device']}, "
             f"torch {env['torch']}, triton {env['triton']}, commit "
             f"{env['commit']}; copy {bandwidth / 1e12:.2f} TB/s, "
             f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s\n\n"
             "| requests | admission | async scheduling | deterministic | KV blocks | preemptions | "
             "output tok/s | total tok/s | time s | roofline s | fraction of roofline |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|\n"
             + "".join(f"| {r['requests']} | {r['admission']} | {r['async_scheduling']} | "
                       f"{r['deterministic']} | {r['kv_blocks']} | "
                       f"{r['preemptions']} | {r['output_tok_s']} | {r['total_tok_s']} | {r['seconds']} | "
                       f"{r['roofline_seconds']} | {r['fraction_of_roofline']} |\n" for r in rows)
             + "\nGPU time by step kind (from events around each step), and between steps:\n\n"
             "| async scheduling | deterministic | steps | mixed steps | s in mixed steps (roofline, host) | "
             "s in decode steps (roofline, host) | GPU idle between steps s | idle fraction |\n"
             "|---|---|---|---|---|---|---|---|\n"
             + "".join(f"| {r['async_scheduling']} | {r['deterministic']} | {r['steps']} | "
                       f"{r['mixed_steps']} | "
                       f"{r['mixed_step_seconds']} ({r['mixed_roofline_seconds']}, "
                       f"{r['mixed_host_seconds']}) | {r['decode_step_seconds']} "
                       f"({r['decode_roofline_seconds']}, {r['decode_host_seconds']}) | "
                       f"{r['idle_between_steps_seconds']} | {r['idle_fraction']} |\n" for r in rows))
    write_results(args.out, {**env, "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops_rate,
                             "model": path, "rows": rows}, table)


def run_workload(path: str, args: argparse.Namespace, async_scheduling: bool, bandwidth: float,
                 flops_rate: float, deterministic: bool = False) -> dict:
    """The workload on a fresh engine: one result row."""
    gc.collect()  # the last run's engine and the instrumentation around its runner (a reference cycle)
    torch.cuda.empty_cache()
    rng = random.Random(0)
    with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                max_model_len=2 * args.max_len + 8, admission=args.admission,
                async_scheduling=async_scheduling, deterministic=deterministic) as engine:
        vocab = engine.config.vocab_size
        weights = weight_bytes_per_step(engine)
        kv_token = kv_bytes_read_per_token(engine)
        flops_per_token = 2 * engine.config.total_ut_steps * sum(
            p.numel() for p in engine.model.layers.parameters()) + 2 * engine.model.lm_head.weight.numel()
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(100, args.max_len))]
                   for _ in range(args.num_requests)]
        params = [SamplingParams(temperature=0.6, seed=i, ignore_eos=True,
                                 max_tokens=rng.randint(100, args.max_len))
                  for i in range(args.num_requests)]
        roofline = [0.0]
        steps: list[StepRecord] = []
        forward = engine.runner.forward
        first_kernel: list[torch.cuda.Event] = []

        def timed_forward(inputs, *args):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            first_kernel.append(event)
            return forward(inputs, *args)

        def timed(method):
            """The runner's run (a synchronous step) or launch (async), with the step's roofline and its
            events before its first kernel and after its last."""
            def wrapper(batch, *args):
                tokens = batch.num_tokens
                kv = sum(r.num_computed_tokens + n
                         for r, n in zip(batch.requests, batch.num_new_tokens)) * kv_token
                bound = max((weights + kv) / bandwidth, tokens * flops_per_token / flops_rate)
                roofline[0] += bound
                mixed = any(r.num_computed_tokens < r.num_prompt_tokens for r in batch.requests)
                first_kernel.clear()
                began = time.perf_counter()
                result = method(batch, *args)
                host = time.perf_counter() - began
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                steps.append(StepRecord(mixed, tokens, batch.num_seqs, bound, host, first_kernel[0], end))
                return result
            return wrapper

        engine.runner.forward = timed_forward
        engine.runner.run, engine.runner.launch = timed(engine.runner.run), timed(engine.runner.launch)
        engine.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        roofline[0] = 0.0
        steps.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        timeline = step_timeline(steps, elapsed)
        preemptions = engine.scheduler.num_preemptions
        kv_blocks = engine.block_manager.num_blocks
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total_tokens = out_tokens + sum(len(p) for p in prompts)
    row = {"requests": args.num_requests, "output_tokens": out_tokens, "total_tokens": total_tokens,
           "seconds": round(elapsed, 2), "output_tok_s": round(out_tokens / elapsed, 1),
           "total_tok_s": round(total_tokens / elapsed, 1), "roofline_seconds": round(roofline[0], 2),
           "fraction_of_roofline": round(roofline[0] / elapsed, 3), "preemptions": preemptions,
           "admission": args.admission, "async_scheduling": async_scheduling, "deterministic": deterministic,
           "kv_blocks": kv_blocks,
           **timeline}
    print(row, flush=True)
    return row


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One step as the benchmark saw it: mixed (some row still in its prompt), its tokens and rows, its
    roofline seconds, the host seconds its run or launch took, and events before its first kernel and
    after its last."""

    mixed: bool
    tokens: int
    rows: int
    roofline: float
    host: float
    first: torch.cuda.Event
    end: torch.cuda.Event


def step_timeline(steps: list[StepRecord], elapsed: float) -> dict:
    """Where the run's time went on the GPU. Per step (mixed: some row still in its prompt), two events:
    before its first kernel (the forward's start; the step's uploads precede it) and after its last (recorded
    once the runner has queued the step: in stream order, so it marks the step's end on the device). A step's
    span is the time between them; the GPU idles between one step's end and the next one's start, waiting
    for the host (its scheduling, commit and the next step's preparation)."""
    idle = sum(max(0.0, step.end.elapsed_time(nxt.first) / 1e3) for step, nxt in zip(steps, steps[1:]))
    spans = [step.first.elapsed_time(step.end) / 1e3 for step in steps]

    def total(values, mixed: bool) -> float:
        return round(sum(v for v, step in zip(values, steps) if step.mixed == mixed), 2)

    roofline, host = [s.roofline for s in steps], [s.host for s in steps]
    slowest = sorted(range(len(steps)), key=lambda i: spans[i] - steps[i].roofline, reverse=True)[:8]
    return {"steps": len(steps), "mixed_steps": sum(s.mixed for s in steps),
            "mixed_step_seconds": total(spans, True), "decode_step_seconds": total(spans, False),
            "mixed_roofline_seconds": total(roofline, True),
            "decode_roofline_seconds": total(roofline, False),
            "mixed_host_seconds": total(host, True), "decode_host_seconds": total(host, False),
            "idle_between_steps_seconds": round(idle, 2), "idle_fraction": round(idle / elapsed, 3),
            # the steps furthest above their roofline: what to look at first
            "furthest_from_roofline": [{"mixed": steps[i].mixed, "tokens": steps[i].tokens,
                                        "rows": steps[i].rows, "gpu_ms": round(spans[i] * 1e3, 2),
                                        "roofline_ms": round(steps[i].roofline * 1e3, 2),
                                        "host_ms": round(steps[i].host * 1e3, 2)} for i in slowest]}


if __name__ == "__main__":
    main()
