"""Continuous depth batching (Engine(depth_batching=True), docs/looped_controls.md) against lockstep early
exit and full depth: decode output tok/s when each generated token's exit loop follows a fixed, seeded
distribution of a given mean, in one run.

    python -m benchmarks.depth_batching --preset ouro-1.4b --out benchmarks/results/depth_batching.json
    python -m benchmarks.depth_batching --device cpu --preset tiny --batches 1 4 --prompt 32  # smoke run

The distribution is the model's own exit gate under early:Q (a generated checkpoint's gate has seeded random
weights) on seeded random prompts; only the gate's bias is changed, in place. For each --mean-loops target a
bisection on an engine of its own (lockstep early:Q, eager, prefix caching: --calibration-batch prompts of
--prompt tokens, prefilled once, --calibration-tokens tokens each) finds the bias at which lockstep runs that
many loops per decode token, within --tolerance. The weight stays, so tokens exit at different loops (the
calibration's histogram says which). Then per target and batch, on the same prompts: (a) full depth (CUDA
graphs), (b) lockstep early:Q (per-loop graphs), (c) early:Q with depth batching and the same bias. A row is
timed over --steps steps (steps x target loop passes under depth batching) once every row has its first token
and untimed warm-up steps have run (Triton compiles stay out; under depth batching the rows spread over their
loops). It reports output tok/s, TPOT (batch / tok/s), the loops a token ran in the window, GB/s (the bytes
its tokens need when each loop's weights are read once for the whole batch, over the time), the speed-up over
(a) beside its bound T / (loops a token), and whether (c)'s tokens equal (b)'s. 64 rows of 2K need about
110 GB of KV (an 80 GB card holds about 38): a row that does not fit is recorded as such, and one whose rows
outgrew the pool (a preemption) says so beside its numbers. The engines admit greedily (admission="greedy"):
a batch's rows must all be resident at once, and a budget that covers every token exiting at loop 0 (16 a
chained step) is far above what a row needs, so the default's reserve for the budgets held rows back.

Self-speculation's rows (d = 2, k = 4, acceptance forced to 100% and 0%), the speculative step's and
pipelined in depth-batched passes (depth_batching=True with speculative), are benchmarks/speculative.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from pathlib import Path

import torch

from benchmarks.common import (BATCHED_TOKENS, add_random_prompts, checkpoint, copy_bandwidth, environment,
                               head_start, kv_bytes_read_per_token, loop_and_step_weight_bytes,
                               prefill_until_first_tokens, sync, write_results)
from engine import Engine, SamplingParams
from engine_config import CHAIN_PASSES_PER_LOOP
from model.registry import read_config

CALIBRATION_SEED = 1_000_003  # other prompts than the timed rows' (seeded by their batch size)
BIAS_SPAN = 16.0  # the bisection's bracket: the checkpoint's bias +- this (the gate saturates inside)
FULL, LOCKSTEP, DEPTH = "full depth", "lockstep early exit", "depth batching"


@dataclasses.dataclass(frozen=True, slots=True)
class Costs:
    """What a token's bytes are counted from: one loop's weights, the weights a step reads once (norm, gate,
    head), the KV a full-depth token reads per context token, and the loop count T."""

    loop_bytes: int
    step_bytes: int
    kv_token_bytes: float
    loops: int

    def bytes_per_token(self, batch: int, context: float, loops_per_token: float) -> float:
        """The bytes a generated token needs when each loop's weights (and the once-a-step ones) are read once
        for the whole batch: its loops' share of them, and its loops' slots of its context's K/V."""
        weights = (loops_per_token * self.loop_bytes + self.step_bytes) / batch
        return weights + loops_per_token / self.loops * self.kv_token_bytes * context


def set_gate_bias(engine: Engine, bias: float) -> float:
    """The exit gate's bias, set in place (CUDA graphs read the same storage); returns the value stored, in
    the model's dtype."""
    with torch.no_grad():
        engine.model.early_exit_gate.bias.fill_(bias)
    return engine.model.early_exit_gate.bias.item()


def lockstep_loops(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, list[float]]:
    """Greedy decode of `prompts`, `tokens` tokens each: the loops a decode token ran (LoopStats), and the
    share of decode tokens that ran 1, 2, ..., T loops (their loop traces; the first token is the prompt's,
    left out)."""
    stats = engine.loop_stats
    tokens0, loops0 = stats.decode_tokens, stats.decode_loops
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, loop_trace=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    exits = [trace.exit_loop for out in outputs for trace in out.outputs[0].traces[1:]]
    histogram = [round(exits.count(t) / len(exits), 4) for t in range(engine.loops)]
    return (stats.decode_loops - loops0) / (stats.decode_tokens - tokens0), histogram


def calibrate(engine: Engine, target: float, start: float, prompts: list[list[int]],
              args: argparse.Namespace) -> dict:
    """Bisect the gate bias from start +- BIAS_SPAN until lockstep early:Q runs `target` loops per decode
    token (within args.tolerance) on `prompts`; the loops fall as the bias rises. Leaves the gate at the
    closest bias found and returns it with the loops measured there."""
    if not 1 < target < engine.loops:
        raise ValueError(f"--mean-loops {target} must lie strictly between 1 and the model's {engine.loops} "
                         "loops")
    low, high = start - BIAS_SPAN, start + BIAS_SPAN  # loops(low) >= target >= loops(high)
    best = None
    for iteration in range(1, args.calibration_iterations + 1):
        bias = set_gate_bias(engine, (low + high) / 2)
        loops, histogram = lockstep_loops(engine, prompts, args.calibration_tokens)
        if best is None or abs(loops - target) < abs(best["loops_per_token"] - target):
            best = {"gate_bias": bias, "loops_per_token": round(loops, 4), "histogram": histogram}
        if abs(loops - target) <= args.tolerance:
            break
        low, high = (bias, high) if loops > target else (low, bias)
    set_gate_bias(engine, best["gate_bias"])
    return {"target_loops": target, **best, "hit": abs(best["loops_per_token"] - target) <= args.tolerance,
            "tolerance": args.tolerance, "iterations": iteration}


def calibration_prompts(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    """args.calibration_batch seeded random prompts of args.calibration_prompt token ids (3 and up)."""
    rng = random.Random(CALIBRATION_SEED)
    return [[rng.randrange(3, engine.config.vocab_size) for _ in range(args.calibration_prompt)]
            for _ in range(args.calibration_batch)]


def calibrations(path: str, common: dict, args: argparse.Namespace) -> list[dict]:
    """The gate bias of each target, found on an engine of its own: lockstep early:Q, eager, with prefix
    caching, so that the bisection's runs prefill the calibration prompts once (a prompt runs every loop
    whatever the gate says, so its K/V does not depend on the bias)."""
    settings = {**common, "enforce_eager": True, "enable_prefix_caching": True}
    with Engine(path, exit_policy=f"early:{args.q}", **settings) as engine:
        if getattr(engine.model, "early_exit_gate", None) is None:
            raise ValueError(f"{path}: the model has no exit gate (early_exit_gate) to calibrate; the "
                             "benchmark needs an Ouro checkpoint")
        prompts = calibration_prompts(engine, args)
        start = engine.model.early_exit_gate.bias.item()
        found = []
        for target in args.mean_loops:
            found.append(calibrate(engine, target, start, prompts, args))
            print(found[-1], flush=True)
        return found


def timed_window(engine: Engine, batch: int, prompt: int, warm: int, window: int, seed: int) -> dict:
    """`batch` seeded random prompts, prefilled until each has its first token; `warm` steps untimed, then
    `window` timed steps: output tokens, seconds, loops per token, the mean context and each request's tokens.
    Budgets outlast the window (a step emits at most step_passes tokens a row); the requests are aborted
    afterwards, untimed."""
    budget = token_budget(engine, batch, prompt, warm + window)
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    ids = add_random_prompts(engine, batch, prompt, params, random.Random(seed))
    prefill_until_first_tokens(engine, batch)
    latest = {}
    for _ in range(warm):
        latest.update((out.request_id, out) for out in engine.step())
    generated0 = sum(len(latest[i].outputs[0].token_ids) if i in latest else 1 for i in ids)
    stats = engine.loop_stats
    tokens0, loops0 = stats.decode_tokens, stats.decode_loops
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(window):
        latest.update((out.request_id, out) for out in engine.step())
    sync(engine.device)
    seconds = time.perf_counter() - start
    ended = [f"{out.request_id}: {len(c.token_ids)} tokens, {c.finish_reason} ({c.stop_reason or c.error})"
             for out in latest.values() if out.finished for c in out.outputs[:1]]
    if ended:
        raise RuntimeError(f"{len(ended)} rows finished in the timed steps (budget {budget}): {ended[:4]}")
    token_ids = [list(latest[i].outputs[0].token_ids) for i in ids]
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    tokens = stats.decode_tokens - tokens0
    generated1 = sum(len(t) for t in token_ids)
    return {"tokens": tokens, "seconds": seconds, "loops_per_token": (stats.decode_loops - loops0) / tokens,
            "context": prompt + (generated0 + generated1) / (2 * batch), "token_ids": token_ids}


def token_budget(engine: Engine, batch: int, prompt: int, steps: int) -> int:
    """Tokens a request may generate so that it outlasts its head start and `steps` steps (a step, prompt
    chunks beside it or not, appends at most step_passes tokens a row)."""
    return (head_start(batch, prompt, BATCHED_TOKENS) + steps) * engine.engine_config.step_passes + 2


def row(engine: Engine, label: str, target: float | None, batch: int, args: argparse.Namespace,
        costs: Costs) -> dict:
    """One row: `batch` rows at --prompt, timed over --steps steps (under depth batching the steps of --steps
    x target passes, after those of --warm x T warm-up passes, P passes a step; --warm steps otherwise)."""
    config = engine.engine_config
    depth, passes = config.depth_batching, config.step_passes
    window = max(1, round(args.steps * target / passes)) if depth else args.steps
    warm = -(-args.warm * engine.loops // passes) if depth else args.warm
    out = {"row": label, "exit_policy": str(engine.exit_policy), "depth_batching": depth,
           "mode": "CUDA graphs" if engine.uses_cuda_graphs else "eager",
           "async_scheduling": engine.engine_config.overlaps_steps,
           "dtype": str(engine.dtype).removeprefix("torch."), "kv_format": config.kv_format.name,
           "kv_slot_token_bytes": engine.kv_pool.slot_token_bytes, "target_loops": target,
           "gate_bias": engine.model.early_exit_gate.bias.item() if target is not None else None,
           "batch": batch, "prompt": args.prompt, "timed_steps": window, "passes_per_step": passes}
    # The budget bounds the worst case (head_start's steps, every token of a chain exiting at loop 0); the KV
    # a row is expected to need, by the steps its prompts take to prefill and the tokens a step appends at the
    # target loops (P / loops under depth batching), decides whether the batch fits; a run that outgrows the
    # pool anyway (a preemption) is noted.
    budget = token_budget(engine, batch, args.prompt, warm + window)
    per_step = math.ceil(passes / target) if depth else 1
    prefill_steps = -(-batch * args.prompt // BATCHED_TOKENS) + 1
    expected = (prefill_steps + warm + window) * per_step + 2
    if engine.max_concurrent_sequences(args.prompt, min(budget, expected)) < batch:
        return {**out, "note": f"does not fit: {batch} rows of {args.prompt} + {expected} tokens"}
    preemptions = engine.scheduler.num_preemptions
    run = timed_window(engine, batch, args.prompt, warm, window, seed=batch)
    if engine.scheduler.num_preemptions != preemptions:
        out["note"] = "preempted: the KV pool filled, the time includes recomputed prompts"
    tok_s = run["tokens"] / run["seconds"]
    loops = run["loops_per_token"]
    need = costs.bytes_per_token(batch, run["context"], loops)
    return {**out, "tokens": run["tokens"], "elapsed_ms": round(run["seconds"] * 1e3, 2),
            "loops_per_token": round(loops, 3), "context": round(run["context"], 1), "tok_s": round(tok_s, 1),
            "tpot_ms": round(batch / tok_s * 1e3, 3), "gbps": round(need * tok_s / 1e9, 1),
            "bound_vs_full": round(costs.loops / loops, 3), "token_ids": run["token_ids"]}


def compare(rows: list[dict]) -> None:
    """Per row: its speed-up over full depth at its batch; for depth batching, whether each request's tokens
    equal lockstep's (same target and batch) up to the shorter of the two."""
    full = {r["batch"]: r["tok_s"] for r in rows if r["row"] == FULL and "tok_s" in r}
    lockstep = {(r["target_loops"], r["batch"]): r["token_ids"] for r in rows
                if r["row"] == LOCKSTEP and "token_ids" in r}
    for r in rows:
        if "tok_s" in r and r["batch"] in full:
            r["speedup_vs_full"] = round(r["tok_s"] / full[r["batch"]], 3)
        if r["row"] == DEPTH and "token_ids" in r and (r["target_loops"], r["batch"]) in lockstep:
            pairs = list(zip(r["token_ids"], lockstep[(r["target_loops"], r["batch"])]))
            equal = sum(a[:len(b)] == b[:len(a)] for a, b in pairs)
            r.update(requests_equal=equal, tokens_compared=sum(min(len(a), len(b)) for a, b in pairs),
                     same_tokens_as_lockstep=equal == len(pairs))


def table(rows: list[dict], calibrations: list[dict], env: dict, args: argparse.Namespace, path: str,
          bandwidth: float | None) -> str:
    copy = f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""
    dtype = rows[0]["dtype"] if rows else args.dtype
    lines = [f"Depth batching against lockstep early exit and full depth, {path} ({dtype}, K/V "
             f"{args.kv_cache_dtype}), "
             f"early:{args.q}, prompt {args.prompt}, {args.steps} timed steps (x the target loops in passes "
             f"under depth batching); {env['device']}, torch {env['torch']}, triton {env['triton']}, commit "
             f"{env['commit']}{copy}.", "",
             f"Gate bias calibration (lockstep, {args.calibration_batch} x {args.calibration_prompt}, "
             f"{args.calibration_tokens} tokens each):", "",
             "| target loops | gate bias | loops/token | within ±tolerance | share of tokens by loops run |",
             "|---|---|---|---|---|"]
    for c in calibrations:
        shares = ", ".join(f"{t + 1}: {share:.2f}" for t, share in enumerate(c["histogram"]))
        lines.append(f"| {c['target_loops']} | {c['gate_bias']:.4g} | {c['loops_per_token']} | "
                     f"{c['hit']} (±{c['tolerance']}) | {shares} |")
    lines += ["", "| target loops | row | mode | batch | loops/token | TPOT ms | out tok/s | GB/s | x full "
              "| bound T/loops | same tokens as lockstep |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = (f"{r['requests_equal']}/{r['batch']} requests ({r['tokens_compared']} tokens)"
                if "requests_equal" in r else "")
        if "note" in r and "tok_s" in r:
            same += f" ({r['note']})"
        lines.append(f"| {r['target_loops'] or '-'} | {r['row']} | {r['mode']} | {r['batch']} | "
                     f"{r.get('loops_per_token', r.get('note'))} | {r.get('tpot_ms', '')} | "
                     f"{r.get('tok_s', '')} | "
                     f"{r.get('gbps', '')} | {r.get('speedup_vs_full', '')} | {r.get('bound_vs_full', '')} | "
                     f"{same} |")
    return "\n".join(lines)


def report(rows: list[dict], calibrations: list[dict], args: argparse.Namespace, path: str,
           bandwidth: float | None) -> None:
    """The JSON (rows without their token lists) and the table, rewritten after every row so that a run cut
    short still leaves its numbers."""
    compare(rows)
    env = environment()
    kept = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
    dtype = rows[0]["dtype"] if rows else args.dtype
    write_results(args.out, {**env, "checkpoint": path, "dtype": dtype, "q": args.q,
                             "kv_cache_dtype": args.kv_cache_dtype, "prompt": args.prompt,
                             "steps": args.steps, "warm": args.warm,
                             "copy_bandwidth_bytes_per_s": bandwidth,
                             "calibration": calibrations, "rows": kept},
                  table(rows, calibrations, env, args, path, bandwidth))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a generated --preset)")
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--mean-loops", type=float, nargs="+", default=[2.0, 3.0],
                        help="target loops per decode token, one calibration each")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32,
                        help="timed steps (x the target loops under depth batching)")
    parser.add_argument("--warm", type=int, default=4, help="untimed steps first (x T under depth batching)")
    parser.add_argument("--q", type=float, default=0.5, help="early:Q's threshold")
    parser.add_argument("--calibration-batch", type=int, default=32, help="calibration prompts")
    parser.add_argument("--calibration-prompt", type=int, default=None, help="their length (--prompt)")
    parser.add_argument("--calibration-tokens", type=int, default=4, help="tokens each generates")
    parser.add_argument("--calibration-iterations", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=0.05, help="calibration: |loops/token - target|")
    parser.add_argument("--deterministic", action="store_true",
                        help="every engine in deterministic mode (then (b) and (c) give the same bits)")
    parser.add_argument("--passes-per-step", type=int, default=None,
                        help="depth batching's passes a step (default: the engine's, four times the loops)")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the engines' K/V format (auto: the model's dtype; fp8_e4m3 halves the KV, so "
                             "that 64 x 2K of Ouro-1.4B fits an 80 GB GPU)")
    parser.add_argument("--device", default="cuda", help="cuda (cpu only to smoke-test with --preset tiny)")
    parser.add_argument("--dtype", default="auto",
                        help="auto: the checkpoint's (bf16 for --preset ouro-1.4b, fp32 for tiny)")
    parser.add_argument("--out", default=f"benchmarks/results/depth_batching-{environment()['date']}.json")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warm < 1 or args.calibration_tokens < 2:
        parser.error("--steps and --warm must be at least 1, --calibration-tokens at least 2")
    if args.calibration_prompt is None:
        args.calibration_prompt = args.prompt
    return args


def main(argv: list[str] | None = None) -> dict:
    """Calibrates, then runs the three engines one after another (each sizes its KV pool to the device);
    returns the JSON written."""
    args = parse_args(argv)
    path = checkpoint(args.model, args.preset)
    bandwidth = copy_bandwidth() if args.device.startswith("cuda") else None
    loops = read_config(Path(path)).shape.loops
    # the longest a request may grow (token_budget at the most passes a step; it sizes block tables only)
    passes = args.passes_per_step or CHAIN_PASSES_PER_LOOP * loops
    longest = args.prompt + (head_start(max(args.batches), args.prompt, BATCHED_TOKENS) + args.warm * loops
                             + args.steps) * passes + 2
    common = dict(device=args.device, dtype=args.dtype, attention=args.attention,
                  max_num_seqs=max(*args.batches, args.calibration_batch),
                  max_model_len=max(longest, args.calibration_prompt + args.calibration_tokens) + 8,
                  max_num_batched_tokens=BATCHED_TOKENS, enable_prefix_caching=False, admission="greedy",
                  kv_cache_dtype=args.kv_cache_dtype,
                  deterministic=True if args.deterministic else None, verbose=False)
    found = calibrations(path, common, args)
    rows: list[dict] = []

    def add(new: dict) -> None:
        rows.append(new)
        print({k: v for k, v in new.items() if k != "token_ids"}, flush=True)
        report(rows, found, args, path, bandwidth)

    early = f"early:{args.q}"
    with Engine(path, exit_policy="full", **common) as engine:
        costs = Costs(*loop_and_step_weight_bytes(engine), kv_bytes_read_per_token(engine), engine.loops)
        for batch in args.batches:
            add(row(engine, FULL, None, batch, args, costs))
    for label, depth_batching in ((LOCKSTEP, False), (DEPTH, True)):
        chain = dict(passes_per_step=args.passes_per_step) if depth_batching else {}
        with Engine(path, exit_policy=early, depth_batching=depth_batching, **chain, **common) as engine:
            for calibration in found:
                set_gate_bias(engine, calibration["gate_bias"])
                for batch in args.batches:
                    add(row(engine, label, calibration["target_loops"], batch, args, costs))
    print(table(rows, found, environment(), args, path, bandwidth))
    return {"calibration": found, "rows": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]}


if __name__ == "__main__":
    main()
