"""Steps with prompt tokens at small token counts, piecewise CUDA graphs against eager: B rows decoding at a
fixed context, then one new prompt of P tokens per step (max_tokens=1, so it finishes in its own mixed
step). Reports ms per mixed step, the speedup, the step's floor (weights read T times plus every row's KV
bytes, over the copy bandwidth; or its FLOPs over the bf16 matmul rate, whichever is larger), and whether
the decode rows' greedy tokens agree between the two engines.

    python -m benchmarks.mixed_steps --preset ouro-1.4b --out benchmarks/results/mixed_steps-<date>.json
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from benchmarks.common import (add_random_prompts, checkpoint, copy_bandwidth, environment,
                               kv_bytes_read_per_token, matmul_rate, prefill_until_first_tokens,
                               weight_bytes_per_step, write_results)
from engine import Engine, SamplingParams


def time_mixed_steps(engine: Engine, batch: int, context: int, prompt: int, steps: int,
                     rng: random.Random) -> tuple[float, list[list[int]]]:
    """Median ms of `steps` mixed steps (each one P-token prompt beside the B decode rows), and the decode
    rows' tokens."""
    decode = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    add_random_prompts(engine, batch, context, decode, rng)
    prefill_until_first_tokens(engine, batch)
    engine.step()  # one plain decode step
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, tokens = [], {}
    for _ in range(steps):
        add_random_prompts(engine, 1, prompt, once, rng)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        for out in outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    decode_rows = [ids for ids in tokens.values() if len(ids) > 1]
    return sorted(times)[len(times) // 2], decode_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batches", type=int, nargs="+", default=[0, 1, 16])
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 500])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--out", default=f"benchmarks/results/mixed_steps-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    bandwidth, flops_rate = copy_bandwidth(), matmul_rate()
    combos = [(batch, prompt) for batch in args.batches for prompt in args.prompts]
    timed: dict[str, list[tuple[float, list[list[int]]]]] = {}
    for mode, graph_tokens in (("piecewise", 512), ("eager", 0)):
        gc.collect()
        torch.cuda.empty_cache()
        with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches) + 1,
                    max_model_len=args.context + args.steps + 16, kv_cache_gib=16.0,
                    enable_prefix_caching=False, async_scheduling=False, piecewise_graph_tokens=graph_tokens,
                    verbose=False) as engine:
            timed[mode] = [time_mixed_steps(engine, batch, args.context, prompt, args.steps, random.Random(0))
                           for batch, prompt in combos]
            weights, kv_token = weight_bytes_per_step(engine), kv_bytes_read_per_token(engine)
            flops_per_token = 2 * engine.config.total_ut_steps * sum(
                p.numel() for p in engine.model.layers.parameters())
    rows = []
    for (batch, prompt), (graph_ms, graph_tokens), (eager_ms, eager_tokens) in zip(combos, timed["piecewise"],
                                                                                    timed["eager"]):
        kv = kv_token * (batch * (args.context + args.steps) + prompt)
        floor = max((weights + kv) / bandwidth, flops_per_token * (batch + prompt) / flops_rate) * 1e3
        row = {"decode_rows": batch, "context": args.context, "prompt_tokens": prompt,
               "piecewise_ms": round(graph_ms, 3), "eager_ms": round(eager_ms, 3),
               "speedup": round(eager_ms / graph_ms, 2), "floor_ms": round(floor, 3),
               "piecewise_over_floor": round(graph_ms / floor, 2),
               "decode_tokens_agree": graph_tokens == eager_tokens}
        print(row, flush=True)
        rows.append(row)
    env = environment()
    table = (f"Mixed steps (B decode rows at {args.context} context + one P-token prompt), {path} (bf16) on "
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}; copy "
             f"{bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s; median of "
             f"{args.steps} steps\n\n"
             "| B | P | piecewise ms | eager ms | speedup | floor ms | piecewise / floor | tokens agree |\n"
             "|---|---|---|---|---|---|---|---|\n"
             + "".join(f"| {r['decode_rows']} | {r['prompt_tokens']} | {r['piecewise_ms']} | "
                       f"{r['eager_ms']} | {r['speedup']} | {r['floor_ms']} | {r['piecewise_over_floor']} | "
                       f"{r['decode_tokens_agree']} |\n" for r in rows))
    write_results(args.out, {**env, "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops_rate,
                             "model": path, "rows": rows}, table)


if __name__ == "__main__":
    main()
