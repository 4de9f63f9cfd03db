"""What deterministic mode costs: decode TPOT with CUDA graphs of Engine(deterministic=True) against the
default, batch 1 / 16 / 64 x prompt 512 and 2K, in ABBA order (two engines alive in one process, their
passes interleaved so that drift cancels), held against the decode floor; then prefill MFU at 1 x 8K, both
ways. The throughput workload runs through benchmarks/throughput.py --deterministic on off.

    python -m benchmarks.deterministic --preset ouro-1.4b --out benchmarks/results/deterministic.json
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from benchmarks.common import (BATCHED_TOKENS, checkpoint, copy_bandwidth, environment, head_start,
                               kv_bytes_read_per_token, matmul_rate, weight_bytes_per_step, write_results)
from benchmarks.latency import time_batch
from benchmarks.prefill import prefill_flops, time_prefill
from engine import Engine

MODES = {"default": False, "deterministic": True}


def abba(engines: dict[str, Engine], batch: int, prompt: int, steps: int, rounds: int) -> dict[str, list]:
    """TPOT (ms) of each engine over `rounds` ABBA rounds at one shape."""
    head = head_start(batch, prompt, BATCHED_TOKENS)
    rng = random.Random(batch * 7919 + prompt)
    times: dict[str, list] = {name: [] for name in engines}
    for name in engines:  # warm-up: compiles and the first replays of this shape
        time_batch(engines[name], batch, prompt, 4, head, rng)
    order = list(engines)
    for _ in range(rounds):
        for name in order + order[::-1]:
            times[name].append(time_batch(engines[name], batch, prompt, steps, head, rng)[1])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or hub id")
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps a pass")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds a shape")
    parser.add_argument("--prefill", type=int, default=8192, help="prefill MFU's prompt (0: skip)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="each engine's KV pool (default: 40%% of the GPU's free memory, as the two "
                             "engines share the GPU)")
    parser.add_argument("--out", default=f"benchmarks/results/deterministic-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    bandwidth, flops_rate = copy_bandwidth(), matmul_rate()
    longest = max(max(args.prompts) + args.steps + 1 + head_start(b, p, BATCHED_TOKENS)
                  for b in args.batches for p in args.prompts)
    longest = max(longest, args.prefill + 8)
    pool_gib = args.kv_cache_gib or 0.4 * torch.cuda.mem_get_info()[0] / 2**30
    engines = {name: Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches),
                            max_model_len=longest, max_num_batched_tokens=BATCHED_TOKENS,
                            enable_prefix_caching=False, deterministic=on, kv_cache_gib=pool_gib,
                            verbose=False)
               for name, on in MODES.items()}
    weights = weight_bytes_per_step(engines["default"])
    kv_token = kv_bytes_read_per_token(engines["default"])
    capacity = min(e.block_manager.num_blocks * e.kv_pool.block_size for e in engines.values())
    rows = []
    for prompt in args.prompts:
        for batch in args.batches:
            needed = batch * (prompt + args.steps + 1 + head_start(batch, prompt, BATCHED_TOKENS))
            if needed > capacity:
                rows.append({"batch": batch, "prompt": prompt,
                             "note": f"does not fit: {needed} tokens of KV, each engine's pool holds "
                                     f"{capacity} (--kv-cache-gib)"})
                print(rows[-1], flush=True)
                continue
            times = abba(engines, batch, prompt, args.steps, args.rounds)
            # the mean context of a timed step, as benchmarks/latency.py takes it
            floor_ms = (weights + batch * (prompt + args.steps // 2) * kv_token) / bandwidth * 1e3
            default, deterministic = (statistics.median(times[name]) for name in MODES)
            rows.append({"batch": batch, "prompt": prompt, "floor_ms": round(floor_ms, 3),
                         "default_ms": round(default, 3), "deterministic_ms": round(deterministic, 3),
                         "ratio": round(deterministic / default, 3), "passes": times})
            print(rows[-1], flush=True)
    prefill = []
    if args.prefill:
        for name, engine in engines.items():
            rng = random.Random(1)
            time_prefill(engine, 1, args.prefill, rng)  # warm-up
            seconds = min(time_prefill(engine, 1, args.prefill, rng) for _ in range(3))
            flops = prefill_flops(engine, args.prefill)
            prefill.append({"mode": name, "prompt": args.prefill, "seconds": round(seconds, 4),
                            "mfu": round(flops / seconds / flops_rate, 3)})
            print(prefill[-1], flush=True)
    for engine in engines.values():
        engine.close()
    env = environment()
    lines = [f"Deterministic mode against the default, {path} (random weights, bf16), CUDA graphs, "
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}; copy "
             f"{bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s. TPOT: median of "
             f"{2 * args.rounds} ABBA passes of {args.steps} steps each.", "",
             "| batch x prompt | floor ms | default ms | deterministic ms | deterministic / default |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} x {r['prompt']} | {r['floor_ms']} | {r['default_ms']} | "
              f"{r['deterministic_ms']} | {r['ratio']} |" if "note" not in r else
              f"| {r['batch']} x {r['prompt']} | {r['note']} | | | |" for r in rows]
    if prefill:
        lines += ["", "| prefill | seconds | MFU |", "|---|---|---|"]
        lines += [f"| 1 x {p['prompt']}, {p['mode']} | {p['seconds']} | {p['mfu']} |" for p in prefill]
    table = "\n".join(lines)
    write_results(args.out, {**env, "checkpoint": path, "copy_bytes_per_s": bandwidth,
                             "matmul_flops_per_s": flops_rate, "tpot": rows, "prefill": prefill}, table)
    print(table)


if __name__ == "__main__":
    main()
