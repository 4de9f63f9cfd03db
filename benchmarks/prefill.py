"""Prefill MFU: the model FLOPs of a prefill over its time, as a fraction of the bf16 matmul rate measured in
the same run (issue 12's target: >= 0.50 at 8K tokens, one sequence and 16 x 8K).

Model FLOPs per prompt of n tokens, as PaLM's MFU counts them (appendix B of arXiv 2204.02311): 2 x the
layer parameters x T loops per token, plus attention's 4 x heads x head_dim x (keys each query sees) per
(loop, layer), causal, so n (n + 1) / 2 keys in all; plus lm_head for the one token that samples. The time
is from adding the requests until every one has its first token (TTFT of the last), synchronized.
A profile of one 8K prefill splits the GPU time by kernel, so the gap has a name; --sweep times the Triton
prefill attention alone (one call per (loop, layer) slot) over its tiles, warps and pipeline stages, for a
fresh 8K prompt and a 4K chunk after a 4K cached prefix, in TFLOP/s of causal attention.

    python -m benchmarks.prefill --preset ouro-1.4b --out benchmarks/results/prefill-<date>.json
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from collections import defaultdict

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from benchmarks.common import (add_random_prompts, checkpoint, environment, matmul_rate,
                               prefill_until_first_tokens, sync, write_results)
from attention.base import AttentionMetadata
from attention.registry import select
from engine import Engine, SamplingParams

HEADS, HEAD_DIM, BLOCK_SIZE, SLOTS = 16, 128, 16, 4  # Ouro-1.4B's attention; a few slots, walked in turn


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
    rows = [{"kernel": name[:90], "calls": counts[name], "ms": round(us / 1e3, 2)}
            for name, us in ranked[:12]]
    rest = sum(us for _, us in ranked[12:])
    rows.append({"kernel": "(the rest)", "calls": sum(counts[n] for n, _ in ranked[12:]),
                 "ms": round(rest / 1e3, 2)})
    return rows


class PrefillCall:
    """One prefill attention call's pool, metadata and inputs: a row of `new` tokens after `prefix` cached
    ones, pages in shuffled order."""

    def __init__(self, prefix: int, new: int) -> None:
        context = prefix + new
        pages = math.ceil(context / BLOCK_SIZE)
        shape = (SLOTS, pages + 1, BLOCK_SIZE, HEADS, HEAD_DIM)
        self.key_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.value_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(pages + 1, device="cuda")[:pages].int()[None]
        positions = torch.arange(prefix, context, device="cuda")
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, new], dtype=torch.int32, device="cuda"),
            context_lens=torch.tensor([context], dtype=torch.int32, device="cuda"), block_tables=table,
            slot_mapping=table[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE,
            query_lens_cpu=[new], context_lens_cpu=[context], block_size=BLOCK_SIZE)
        self.q, self.k, self.v = (torch.randn(new, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                                  for _ in range(3))
        # QK^T and PV: 2 x 2 x head_dim FLOPs per (query, visible key) per head
        self.flops = 4 * HEADS * HEAD_DIM * sum(prefix + i + 1 for i in range(new))

    def ms(self, calls: int = 12, **tunables) -> float:
        backend = select("triton", torch.device("cuda"))
        backend.bind(self.key_cache, self.value_cache, HEAD_DIM ** -0.5)
        for name, value in tunables.items():
            setattr(backend, name, value)
        backend.prepare(self.meta)
        for slot in range(2):
            backend.forward(self.q, self.k, self.v, slot)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            backend.forward(self.q, self.k, self.v, i % SLOTS)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls


def attention_sweep() -> list[dict]:
    """Each (block_m, block_n, warps, stages) at both shapes: ms and TFLOP/s per call (the KV store
    included), or the error where a config does not fit."""
    calls = {"8192 fresh": PrefillCall(0, 8192), "4096 after 4096": PrefillCall(4096, 4096)}
    results = []
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        tunables = {"prefill_block_m": block_m, "prefill_block_n": block_n, "prefill_num_warps": warps,
                    "prefill_num_stages": stages}
        for shape, call in calls.items():
            entry = {"shape": shape, **tunables}
            try:
                ms = call.ms(**tunables)
                entry.update(ms=round(ms, 3), tflops=round(call.flops / ms / 1e9, 1))
            except (OutOfResources, CompilationError, RuntimeError) as error:
                entry["error"] = repr(error)[:160]
            results.append(entry)
            print(entry, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--sweep", action="store_true", help="also sweep the prefill attention's tunables")
    parser.add_argument("--out", default=f"benchmarks/results/prefill-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    rate = matmul_rate()
    sweep = attention_sweep() if args.sweep else None
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
    if sweep:
        best = {}
        for entry in sweep:
            if "tflops" in entry and entry["tflops"] > best.get(entry["shape"], {}).get("tflops", 0):
                best[entry["shape"]] = entry
        table += "\n\nPrefill attention alone, best tunables per shape:\n\n" + "\n".join(
            f"- {shape}: {e['tflops']} TFLOP/s ({e['ms']} ms), block_m {e['prefill_block_m']}, block_n "
            f"{e['prefill_block_n']}, {e['prefill_num_warps']} warps, {e['prefill_num_stages']} stages"
            for shape, e in best.items())
    write_results(args.out, {**env, "matmul_flops_per_s": rate, "model": path, "rows": rows,
                             "kernels": split, "sweep": sweep}, table)


if __name__ == "__main__":
    main()
