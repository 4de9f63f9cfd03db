"""TTFT and TPOT of the whole engine over prompt 512 / 2K / 8K x batch 1 / 16 / 64, with CUDA graphs and
eager, held against the decode bandwidth floor (weights read T times per token plus the KV bytes,
over a copy bandwidth measured in this run).

    python -m benchmarks.latency --preset ouro-1.4b --out benchmarks/results/latency-<date>.json
"""

from __future__ import annotations

import argparse
import random
import time


from benchmarks.common import (BATCHED_TOKENS, add_random_prompts, checkpoint, copy_bandwidth, environment,
                               head_start, kv_bytes_read_per_token, prefill_until_first_tokens, sync,
                               weight_bytes_per_step, write_results)
from cache.kv_formats import FORMATS
from cache.kvarn_format import KVARN_PRESETS
from engine import Engine, SamplingParams


def time_batch(engine: Engine, batch: int, prompt: int, decode_steps: int, head: int,
         rng: random.Random) -> tuple[float, float]:
    """TTFT: until every row's first token is on the host. TPOT: the next decode_steps steps, every row in
    each of them: rows whose prefill finished early have been decoding beside the later rows' chunks, so
    their budgets leave room for that head start (were they to finish inside the timed steps, those steps
    would carry fewer rows than `batch` and the time per step would come out low). The requests are then
    aborted, untimed. head: head_start(batch, prompt, the engine's max_num_batched_tokens). Under async
    scheduling the next step already runs when the first tokens arrive, so the time is not cut at a device
    sync there."""
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1 + head, ignore_eos=True)
    sync(engine.device)
    start = time.perf_counter()
    request_ids = add_random_prompts(engine, batch, prompt, params, rng)
    prefill_until_first_tokens(engine, batch)
    first = time.perf_counter()
    for _ in range(decode_steps):
        outputs = engine.step()
        assert not any(o.finished for o in outputs), "a row finished inside the timed steps"
    sync(engine.device)
    tpot = (time.perf_counter() - first) * 1e3 / decode_steps
    for request_id in request_ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return (first - start) * 1e3, tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or hub id")
    parser.add_argument("--preset", default="ouro-1.4b", help="generated random-weight shape if no --model")
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--modes", nargs="+", default=["graph", "eager"], choices=["graph", "eager"])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                        choices=list(FORMATS),
                        help="one engine per format (auto: the model's bf16; KVarN: with --block-size of its "
                             "tile)")
    parser.add_argument("--block-size", type=int, default=16, help="64 for the KVarN g64 formats")
    parser.add_argument("--kv-sink-tokens", type=int, default=0, help="KVarN formats: kv_sink_tokens")
    parser.add_argument("--kv-tail-tokens", type=int, default=0, help="KVarN formats: kv_tail_tokens")
    parser.add_argument("--async-scheduling", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                        help="one engine per value (default: auto, the engine's choice: on where the exit "
                             "policy and options allow)")
    parser.add_argument("--exit-policies", nargs="+", default=["full"],
                        help="one engine per exit policy (e.g. kl:1e30,min=7: every generated token stops "
                             "after 8 loops, paying its check)")
    parser.add_argument("--kv-layout", default=None, help="the engines' kv_layout (e.g. compress:16)")
    parser.add_argument("--loops", type=int, default=None, help="the engines' loop count (default: the "
                                                                 "checkpoint's)")
    parser.add_argument("--out", default=f"benchmarks/results/latency-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    bandwidth = copy_bandwidth()
    rows = []
    runs = [(m, kv, a, p) for m in args.modes for kv in args.kv_cache_dtypes for a in args.async_scheduling
            for p in args.exit_policies]
    for mode, kv_cache_dtype, overlap, policy in runs:
        longest = max(args.prompts) + args.decode_steps + 1 + max(
            head_start(batch, prompt, BATCHED_TOKENS) for batch in args.batches for prompt in args.prompts)
        window = ({"kv_sink_tokens": args.kv_sink_tokens, "kv_tail_tokens": args.kv_tail_tokens}
                  if kv_cache_dtype in KVARN_PRESETS else {})
        with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches),
                    max_model_len=longest, max_num_batched_tokens=BATCHED_TOKENS, enable_prefix_caching=False,
                    enforce_eager=(mode == "eager"), kv_cache_dtype=kv_cache_dtype,
                    block_size=args.block_size, async_scheduling={"on": True, "off": False}.get(overlap),
                    verbose=True,
                    exit_policy=policy, kv_layout=args.kv_layout, loops=args.loops, **window) as engine:
            weights = weight_bytes_per_step(engine)
            kv_token = kv_bytes_read_per_token(engine)
            capacity = engine.block_manager.num_blocks * engine.kv_pool.block_size
            rng = random.Random(0)
            for prompt in args.prompts:
                for batch in args.batches:
                    # The mean context of a timed step, short of the tokens early rows decoded beside the
                    # prefill (a lower floor: the ratio errs high)
                    context = prompt + args.decode_steps // 2
                    floor_ms = (weights + kv_token * batch * context) / bandwidth * 1e3
                    overlapped = "on" if engine.engine_config.overlaps_steps else "off"
                    row = {"mode": mode, "kv_cache_dtype": kv_cache_dtype, "async_scheduling": overlapped,
                           "exit_policy": policy, "kv_layout": engine.engine_config.layout_name,
                           "loops": engine.engine_config.loops, "batch": batch, "prompt": prompt,
                           "floor_ms": round(floor_ms, 3), **window}
                    head = head_start(batch, prompt, BATCHED_TOKENS)
                    needed = batch * (prompt + args.decode_steps + 1 + head)
                    if needed > capacity:
                        row.update(ttft_ms=None, tpot_ms=None,
                                   note=f"does not fit: needs {needed} KV tokens, the pool holds {capacity}")
                    else:
                        ttft, tpot = time_batch(engine, batch, prompt, args.decode_steps, head, rng)
                        achieved = (weights + kv_token * batch * context) / (tpot / 1e3) / 1e9
                        row.update(ttft_ms=round(ttft, 2), tpot_ms=round(tpot, 3),
                                   gbps=round(achieved, 1), ratio=round(tpot / floor_ms, 2))
                    rows.append(row)
                    print(row, flush=True)
                    _write(args.out, path, bandwidth, rows)
    _write(args.out, path, bandwidth, rows)


def _write(out: str, path: str, bandwidth: float, rows: list[dict]) -> None:
    """Rewritten after every row, so a run cut short still leaves its numbers."""
    lines = ["| mode | kv_cache_dtype | async | exit policy | KV layout | loops | batch | prompt | TTFT ms "
             "| TPOT ms | floor ms | TPOT / floor | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sink, tail = r.get("kv_sink_tokens", 0), r.get("kv_tail_tokens", 0)
        window = f" (sink {sink}, tail {tail})" if sink or tail else ""
        lines.append(f"| {r['mode']} | {r.get('kv_cache_dtype', 'auto')}{window} | {r['async_scheduling']} | "
                     f"{r.get('exit_policy', 'full')} | {r.get('kv_layout', 'full')} | {r.get('loops', '')} "
                     "| "
                     f"{r['batch']} | {r['prompt']} | "
                     f"{r.get('ttft_ms')} | {r.get('tpot_ms')} | "
                     f"{r['floor_ms']} | {r.get('ratio', r.get('note'))} | {r.get('gbps', '')} |")
    env = environment()
    table = (f"Latency, {path} (bf16) on {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"commit {env['commit']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s\n\n" + "\n".join(lines))
    write_results(out, {**env, "copy_bandwidth_bytes_per_s": bandwidth, "model": path, "rows": rows}, table)


if __name__ == "__main__":
    main()
