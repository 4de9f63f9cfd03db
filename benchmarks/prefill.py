"""Prefill MFU: the model FLOPs of a prefill over its time, as a fraction of the bf16 matmul rate measured in
the same run (issue 12's target: >= 0.50 at 8K tokens, one sequence and 16 x 8K).

Model FLOPs per prompt of n tokens, as PaLM's MFU counts them (appendix B of arXiv 2204.02311): 2 x the
layer parameters x T loops per token, plus attention's 4 x heads x head_dim x (keys each query sees) per
(loop, layer), causal, so n (n + 1) / 2 keys in all; plus lm_head for the one token that samples. The time
is from adding the requests until every one has its first token (TTFT of the last), synchronized.
A profile of one 8K prefill splits the GPU time by kernel, so the gap has a name.

    python -m benchmarks.prefill --preset ouro-1.4b --out benchmarks/results/prefill-<date>.json
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch

from benchmarks.common import (add_random_prompts, checkpoint, environment, matmul_rate,
                               prefill_until_first_tokens, sync, write_results)
from engine import Engine, SamplingParams


def prefill_flops(engine: Engine, prompt: int) -> float:
    """Model FLOPs of one prompt's prefill (see the module docstring)."""
    config = engine.config
    loops = engine.engine_config.loops
    layer_params = sum(p.numel() for p in engine.model.layers.parameters())
    linear = 2 * layer_params * loops * prompt + 2 * engine.model.lm_head.weight.numel()
    attention = 4 * config.num_attention_heads * config.head_dim * prompt * (prompt + 1) / 2
    return linear + attention * loops * config.num_hidden_layers


def time_prefill(engine: Engine, batch: int, prompt: int, rng: random.Random) -> float:
    """Seconds until `batch` fresh prompts of `prompt` tokens each have their first token."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    sync(engine.device)
    start = time.perf_counter()
    add_random_prompts(engine, batch, prompt, params, rng)
    prefill_until_first_tokens(engine, batch)
    sync(engine.device)
    return time.perf_counter() - start


def kernel_split(engine: Engine, prompt: int, rng: random.Random) -> list[dict]:
    """GPU time by kernel over one prefill of `prompt` tokens, largest first (the top 12, then the rest)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        add_random_prompts(engine, 1, prompt, params, rng)
        prefill_until_first_tokens(engine, 1)
        sync(engine.device)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    rows = [{"kernel": name[:90], "calls": counts[name], "ms": round(us / 1e3, 2)} for name, us in ranked[:12]]
    rest = sum(us for _, us in ranked[12:])
    rows.append({"kernel": "(the rest)", "calls": sum(counts[n] for n, _ in ranked[12:]),
                 "ms": round(rest / 1e3, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--out", default=f"benchmarks/results/prefill-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    rate = matmul_rate()
    rows = []
    rng = random.Random(0)
    with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches),
                max_model_len=args.prompt + 8, enable_prefix_caching=False,
                max_num_batched_tokens=args.max_num_batched_tokens) as engine:
        time_prefill(engine, 1, min(args.prompt, 1024), rng)  # warm-up: compiles the prefill kernels
        flops = prefill_flops(engine, args.prompt)
        for batch in args.batches:
            seconds = time_prefill(engine, batch, args.prompt, rng)
            rows.append({"batch": batch, "prompt": args.prompt, "seconds": round(seconds, 4),
                         "tflops": round(batch * flops / seconds / 1e12, 1),
                         "mfu": round(batch * flops / seconds / rate, 3)})
            print(rows[-1], flush=True)
        split = kernel_split(engine, args.prompt, rng)
    env = environment()
    lines = ["| batch | prompt | seconds | TFLOP/s | MFU |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prompt']} | {r['seconds']} | {r['tflops']} | {r['mfu']} |" for r in rows]
    lines += ["", f"GPU time of one {args.prompt}-token prefill by kernel:", "", "| kernel | calls | ms |",
              "|---|---|---|"]
    lines += [f"| `{r['kernel']}` | {r['calls']} | {r['ms']} |" for r in split]
    table = (f"Prefill, {path} (bf16) on {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"commit {env['commit']}; bf16 matmul {rate / 1e12:.0f} TFLOP/s; max_num_batched_tokens "
             f"{args.max_num_batched_tokens}\n\n" + "\n".join(lines))
    write_results(args.out, {**env, "matmul_flops_per_s": rate, "model": path, "rows": rows,
                             "kernels": split}, table)


if __name__ == "__main__":
    main()
