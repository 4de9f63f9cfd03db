"""Admission policies on the throughput workload, scheduling only: the engine's scheduler and block manager
with a stand-in for the model, so the count of preemptions and recomputed tokens is exactly what a GPU run
of the same workload and pool would see (ignore_eos outputs of fixed length; the scheduler never looks at
the tokens). CPU, seconds.

    python -m benchmarks.admission --out benchmarks/results/admission.json

The workload is benchmarks/throughput.py's (nano-vllm's): 256 requests, prompt and output lengths uniform in
[100, 1024], seed 0. The pool is given in blocks of 16 tokens (--blocks; one H200 holds about 10,000 for
Ouro-1.4B in bf16 at gpu_memory_utilization 0.9, each block 12 MiB). Each step is also priced by the
throughput benchmark's roofline (max of bytes over bandwidth and FLOPs over the matmul rate, at Ouro-1.4B's
shape and the H200's measured rates), so a policy that admits too little shows up as a longer run.
"""

from __future__ import annotations

import argparse
import random

from benchmarks.common import environment, write_results
from cache.blocks import BlockManager
from request import ADMISSION, Request, SamplingParams
from scheduler.scheduler import Scheduler

# Ouro-1.4B in bf16 on the H200 (its throughput benchmark of 2026-11-30): weights read once per loop,
# 768 KiB of K/V per token, the copy bandwidth and the bf16 matmul rate measured there.
LOOPS = 4
WEIGHT_BYTES = 2.75e9
KV_TOKEN_BYTES = 768 * 1024
FLOPS_PER_TOKEN = 2 * 1.35e9 * LOOPS
BANDWIDTH = 4.07e12
MATMUL_RATE = 7.95e14


class Silent:
    """The scheduler's detokenizer: every token is empty text (no stop strings in this workload)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def stream(self, skip_special_tokens: bool = True):
        return lambda token: ""


def workload(num_requests: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    prompts = [rng.randint(100, max_len) for _ in range(num_requests)]
    return [(p, rng.randint(100, max_len)) for p in prompts]


def simulate(admission: str, blocks: int, requests: list[tuple[int, int]], max_num_seqs: int,
             max_num_batched_tokens: int) -> dict:
    manager = BlockManager(blocks, 16, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs, max_num_batched_tokens, 2 * 1024 + 8, Silent(),
                          admission=admission)
    for i, (prompt, output) in enumerate(requests):
        scheduler.add(Request(str(i), [5] * prompt, SamplingParams(max_tokens=output, ignore_eos=True)))
    steps = tokens = decode_rows = decode_steps = mixed_steps = 0
    seconds = 0.0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        if not batch.requests:
            scheduler.take_finished()
            continue
        steps += 1
        tokens += batch.num_tokens
        decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        if decodes == len(batch.requests):
            decode_steps += 1
            decode_rows += decodes
        elif decodes:
            mixed_steps += 1
        kv = sum(r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens))
        seconds += max((LOOPS * WEIGHT_BYTES + kv * KV_TOKEN_BYTES) / BANDWIDTH,
                       batch.num_tokens * FLOPS_PER_TOKEN / MATMUL_RATE)
        scheduler.update(batch, [5 if sample else None for sample in batch.sample])
        scheduler.take_finished()
    needed = sum(p + o - 1 for p, o in requests)  # every prompt token and every generated token but the last
    return {"admission": admission, "blocks": blocks, "steps": steps,
            "preemptions": scheduler.num_preemptions, "recomputed_tokens": tokens - needed,
            "mixed_steps": mixed_steps, "mean_decode_rows": round(decode_rows / max(decode_steps, 1), 1),
            "roofline_seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[6000, 8000, 10000, 12000])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    requests = workload(args.num_requests, args.max_len, 0)
    rows = []
    for blocks in args.blocks:
        for admission in ADMISSION:
            rows.append(simulate(admission, blocks, requests, args.max_num_seqs, args.max_num_batched_tokens))
            print(rows[-1], flush=True)
    results = {**environment(), "rows": rows,
               "workload": "throughput.py's: 256 requests, lengths in [100, 1024], seed 0"}
    if args.out:
        write_results(args.out, results, markdown(rows))
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    lines = ["Admission on the throughput workload (256 requests, prompt and output lengths uniform in "
             "[100, 1024]), scheduling only; roofline seconds at Ouro-1.4B's shape on the H200's measured "
             "rates.", "",
             "| blocks of 16 | admission | steps | preemptions | recomputed tokens | mixed prefill + decode "
             "steps | mean decode rows | roofline s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['blocks']} | {r['admission']} | {r['steps']} | {r['preemptions']} | "
                     f"{r['recomputed_tokens']} | {r['mixed_steps']} | {r['mean_decode_rows']} | "
                     f"{r['roofline_seconds']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
