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

from benchmarks.common import (checkpoint, copy_bandwidth, environment,
                               weight_bytes_per_step, write_results)
from engine import Engine, SamplingParams


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start)


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
        run = engine.runner.run

        def timed_run(batch):
            tokens = batch.num_tokens
            kv = sum(r.num_computed_tokens + n
                     for r, n in zip(batch.requests, batch.num_new_tokens)) * kv_token
            roofline[0] += max((weights + kv) / bandwidth, tokens * flops_per_token / flops_rate)
            return run(batch)

        engine.runner.run = timed_run
        engine.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        roofline[0] = 0.0
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        preemptions = engine.scheduler.num_preemptions
        kv_blocks = engine.block_manager.num_blocks
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total_tokens = out_tokens + sum(len(p) for p in prompts)
    row = {"requests": args.num_requests, "output_tokens": out_tokens, "total_tokens": total_tokens,
           "seconds": round(elapsed, 2), "output_tok_s": round(out_tokens / elapsed, 1),
           "total_tok_s": round(total_tokens / elapsed, 1), "roofline_seconds": round(roofline[0], 2),
           "fraction_of_roofline": round(roofline[0] / elapsed, 3), "preemptions": preemptions,
           "admission": args.admission, "kv_blocks": kv_blocks}
    env = environment()
    table = (f"Throughput, {path} (bf16) on {env['device']}, "
             f"torch {env['torch']}, triton {env['triton']}, commit "
             f"{env['commit']}; copy {bandwidth / 1e12:.2f} TB/s, "
             f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s\n\n"
             "| requests | admission | KV blocks | preemptions | output tok/s | total tok/s | time s | "
             "roofline s | fraction of roofline |\n|---|---|---|---|---|---|---|---|---|\n"
             f"| {row['requests']} | {row['admission']} | {kv_blocks} | {preemptions} | "
             f"{row['output_tok_s']} | {row['total_tok_s']} | {row['seconds']} | {row['roofline_seconds']} | "
             f"{row['fraction_of_roofline']} |")
    write_results(args.out, {**env, "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops_rate,
                             "model": path, "rows": [row]}, table)


if __name__ == "__main__":
    main()
