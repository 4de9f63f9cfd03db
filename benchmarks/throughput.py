"""nano-vllm's throughput workload: 256 requests, prompt and output lengths uniform in [100, 1024],
ignore_eos, seed 0. Reports output and total tok/s, and the roofline of the batches actually run: per
step, max(bytes / copy bandwidth, FLOPs / matmul rate), where a step reads the weights T times plus
every row's KV, and does 2 x params x T FLOPs per token.

    python -m benchmarks.throughput --preset ouro-1.4b --out benchmarks/results/throughput-<date>.json
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import (checkpoint, copy_bandwidth, environment, matmul_rate,
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
    parser.add_argument("--out", default=f"benchmarks/results/throughput-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    bandwidth, flops_rate = copy_bandwidth(), matmul_rate()
    rng = random.Random(0)
    with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                max_model_len=2 * args.max_len + 8, admission=args.admission) as engine:
        vocab = engine.config.vocab_size
        weights = weight_bytes_per_step(engine)
        kv_token = engine.kv_pool.bytes_per_token
        flops_per_token = 2 * engine.config.total_ut_steps * sum(
            p.numel() for p in engine.model.layers.parameters()) + 2 * engine.model.lm_head.weight.numel()
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(100, args.max_len))]
                   for _ in range(args.num_requests)]
        params = [SamplingParams(temperature=0.6, seed=i, ignore_eos=True,
                                 max_tokens=rng.randint(100, args.max_len))
                  for i in range(args.num_requests)]
        roofline = [0.0]
        steps: list[tuple[bool, float, torch.cuda.Event, torch.cuda.Event]] = []
        run, forward = engine.runner.run, engine.runner.forward
        first_kernel: list[torch.cuda.Event] = []

        def timed_forward(inputs):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            first_kernel.append(event)
            return forward(inputs)

        def timed_run(batch):
            tokens = batch.num_tokens
            kv = sum(r.num_computed_tokens + n
                     for r, n in zip(batch.requests, batch.num_new_tokens)) * kv_token
            roofline[0] += max((weights + kv) / bandwidth, tokens * flops_per_token / flops_rate)
            mixed = any(r.num_computed_tokens < r.num_prompt_tokens for r in batch.requests)
            first_kernel.clear()
            began = time.perf_counter()
            result = run(batch)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            steps.append((mixed, time.perf_counter() - began, first_kernel[0], end))
            return result

        engine.runner.run, engine.runner.forward = timed_run, timed_forward
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
           "admission": args.admission, "kv_blocks": kv_blocks, **timeline}
    env = environment()
    table = (f"Throughput, {path} (bf16) on {env['device']}, "
             f"torch {env['torch']}, triton {env['triton']}, commit "
             f"{env['commit']}; copy {bandwidth / 1e12:.2f} TB/s, "
             f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s\n\n"
             "| requests | admission | KV blocks | preemptions | output tok/s | total tok/s | time s | "
             "roofline s | fraction of roofline |\n|---|---|---|---|---|---|---|---|---|\n"
             f"| {row['requests']} | {row['admission']} | {kv_blocks} | {preemptions} | "
             f"{row['output_tok_s']} | {row['total_tok_s']} | {row['seconds']} | {row['roofline_seconds']} | "
             f"{row['fraction_of_roofline']} |\n\n"
             "| steps | mixed steps | s in mixed steps | s in decode steps | GPU idle between steps s | "
             "idle fraction |\n|---|---|---|---|---|---|\n"
             f"| {row['steps']} | {row['mixed_steps']} | {row['mixed_step_seconds']} | "
             f"{row['decode_step_seconds']} | {row['idle_between_steps_seconds']} | {row['idle_fraction']} |")
    write_results(args.out, {**env, "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops_rate,
                             "model": path, "rows": [row]}, table)


def step_timeline(steps: list[tuple[bool, float, torch.cuda.Event, torch.cuda.Event]],
                  elapsed: float) -> dict:
    """Where the run's time went. Per step (mixed: some row still in its prompt): the wall time of the
    runner's run, and two events: before its first kernel (the forward's start; the step's uploads precede
    it) and after its last (the run returns once its tokens are on the host). The GPU idles between one
    step's last event and the next one's first: the host's scheduling, commit and step preparation."""
    idle = sum(max(0.0, end.elapsed_time(nxt) / 1e3)
               for (_, _, _, end), (_, _, nxt, _) in zip(steps, steps[1:]))
    mixed = [wall for is_mixed, wall, _, _ in steps if is_mixed]
    decode = [wall for is_mixed, wall, _, _ in steps if not is_mixed]
    return {"steps": len(steps), "mixed_steps": len(mixed), "mixed_step_seconds": round(sum(mixed), 2),
            "decode_step_seconds": round(sum(decode), 2), "idle_between_steps_seconds": round(idle, 2),
            "idle_fraction": round(idle / elapsed, 3)}


if __name__ == "__main__":
    main()
