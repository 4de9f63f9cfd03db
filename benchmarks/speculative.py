"""Self-speculative decoding (docs/speculative.md): how often the first d loops' drafts are accepted, and
what a step costs, on the speculative step and pipelined in depth-batched loop passes.

    python -m benchmarks.speculative --acceptance --out benchmarks/results/speculative_acceptance.json
    python -m benchmarks.speculative --preset ouro-1.4b --out benchmarks/results/speculative.json
    python -m benchmarks.speculative --paths pipelined --batches 1 16 --out speculative-pipelined.json
    python -m benchmarks.speculative --device cpu --dtype float32 --preset tiny --prompt 16 --tokens 8

--acceptance: the embedded tiny trained model on its own task (the addition prompts), greedy, for d = 1, 2,
3 and k = 2, 4, 8: acceptance overall and per draft position, tokens per step. Runs anywhere (CPU included).

Otherwise, on the GPU at a real shape with random weights, bf16, prompt 512: decode TPOT per generated
token at each batch size, non-speculative (the default whole-step CUDA graphs) against self-speculation with
the acceptance forced to 100% and to 0%, on the paths --paths names: `step`, the speculative step
(runner/speculative.py: k drafts, then one verify); `pipelined`, the same speculation pipelined in
depth-batched loop passes (depth_batching=True, runner/pipelined_speculation.py); `depth`, depth batching
without speculation at full depth (T passes a token, the pipelined path's passes without its drafts). Random
weights accept nothing on their own, so the forcing is what bounds the real speed-up from both sides:
`force_acceptance` below replaces the engine's greedy acceptance test (SelfSpeculation.accept, which both
paths ask) with a constant answer. It is a benchmark-only hook, defined here and used nowhere in the engine.

A row is timed from the step after which every row has its first token until every row has --tokens more (N):
TPOT is that time per row's token, step ms per engine step, which under depth batching is one loop pass (no
prompt is left to run), so passes per token is reported too (LoopStats.decode_passes). Forced 100%, the
pipelined path finishes a token every d passes once its first token's T passes are done: T + d(N - 1)
passes; forced 0%, or without speculation, T a token. The bound at forced 100% over the non-speculative row:
kT/(kd + T - d) for the speculative step, T/d pipelined (the same weights read per loop, d loops a token).
The projected TPOT at an acceptance profile is the speculative step's forced-100% step time over the tokens
per step that profile yields (tiny model's, from --acceptance-json); the pipelined path has no projection.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


from benchmarks.common import (ROOT, add_random_prompts, checkpoint, environment, prefill_until_first_tokens,
                               time_until_done, write_results)
from engine import DEFAULT_MODEL, Engine, SamplingParams

NON_SPECULATIVE, DEPTH_FULL = "non-speculative", "depth batching, full"
PATHS = ("step", "pipelined", "depth")  # --paths: the speculative step, pipelined, depth batching alone


def force_acceptance(engine: Engine, accept_all: bool) -> None:
    """Benchmark-only: every greedy draft is accepted (accept_all) or every one rejected, whatever the
    target says, in a speculative step and pipelined alike (both ask SelfSpeculation.accept). The tokens are
    then not the model's (an accepted draft is the token); only the timing means anything."""
    engine.runner.speculation.forced_acceptance = accept_all


def acceptance(ds: list[int], ks: list[int], num_prompts: int, max_tokens: int) -> list[dict]:
    task = ROOT / "benchmarks" / "tasks" / "addition.jsonl"
    rows = [json.loads(line) for line in task.read_text().splitlines()]
    prompts = [row["prompt"] for row in rows[:num_prompts]]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    results = []
    for d in ds:
        for k in ks:
            with Engine(DEFAULT_MODEL, device="cpu", dtype="float32", verbose=False,
                        speculative=f"loops:{d}", num_speculative_tokens=k) as engine:
                engine.generate(prompts, params, use_tqdm=False)
                stats = engine.speculative_stats
            results.append({"d": d, "k": k, "acceptance": round(stats.acceptance_rate, 4),
                            "by_position": [round(x, 4) for x in stats.acceptance_by_position],
                            "tokens_per_step": round(stats.tokens_per_step, 3), "steps": stats.steps,
                            "drafts": stats.num_drafted})
            print(results[-1], flush=True)
    return results


def decode_tpot(engine: Engine, batch: int, prompt: int, tokens: int, seed: int) -> dict:
    """Per generated token: wall ms of the decode steps after every row has its first token (and the
    tokens that the step reading it ran on, under async scheduling: prefill_until_first_tokens); the steps
    taken per row's token; under depth batching the loop passes per row's token (a pass is a step here: no
    prompt is left; a lone row's token runs its loops in one step); under speculation the share of drafts
    accepted."""
    if tokens > 8:  # warm-up on the same shapes, untimed (a chain of passes may finish it in one step)
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        add_random_prompts(engine, batch, prompt, warm, random.Random(seed + 1))
        time_until_done(engine)
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    add_random_prompts(engine, batch, prompt, params, random.Random(seed))
    ahead = prefill_until_first_tokens(engine, batch)
    drafts = engine.speculative_stats.copy() if engine.speculative_stats is not None else None
    passes = engine.loop_stats.decode_passes
    elapsed, steps = time_until_done(engine)
    passes = engine.loop_stats.decode_passes - passes
    tokens -= ahead / batch  # a row's tokens in the timed steps
    if tokens <= 0:
        raise ValueError(f"--tokens {tokens + ahead / batch:g}: the first step's chain ran them all; ask for "
                         "more than a chain's tokens")
    accepted = None
    if drafts is not None and engine.speculative_stats.num_drafted > drafts.num_drafted:
        accepted = round((engine.speculative_stats.num_accepted - drafts.num_accepted)
                         / (engine.speculative_stats.num_drafted - drafts.num_drafted), 3)
    return {"tpot_ms": round(elapsed / tokens, 3), "step_ms": round(elapsed / steps, 3),
            "tokens_per_step": round(tokens / steps, 3),
            "passes_per_token": round(passes / tokens, 3) if engine.engine_config.depth_batching else None,
            "accepted": accepted}


def timed_rows(engine: Engine, mode: str, path: str, forced: float | None, args: argparse.Namespace
               ) -> list[dict]:
    """One row per --batches size on this engine, seeded by the batch size (every path times the same
    prompts)."""
    rows = []
    for batch in args.batches:
        rows.append({"mode": mode, "path": path, "forced_acceptance": forced, "batch": batch,
                     "cuda_graphs": engine.uses_cuda_graphs,
                     **decode_tpot(engine, batch, args.prompt, args.tokens, seed=batch)})
        print(rows[-1], flush=True)
    return rows


def tpot_rows(path: str, args: argparse.Namespace) -> tuple[list[dict], int]:
    """Every row --paths asks for, the non-speculative ones first (the speed-ups' base), and the model's
    loops T; each row's speed-up over the non-speculative row of its batch, and at forced 100% its bound."""
    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches),
                  enable_prefix_caching=False, max_model_len=args.prompt + 2 * args.tokens + 64,
                  verbose=False)
    with Engine(path, **common) as engine:
        loops = engine.loops
        rows = timed_rows(engine, NON_SPECULATIVE, "plain", None, args)
    if "depth" in args.paths:
        # a pass a step, as pipelined speculation's passes run (chained passes: benchmarks/depth_batching.py)
        with Engine(path, depth_batching=True, passes_per_step=1, **common) as engine:
            rows += timed_rows(engine, DEPTH_FULL, "depth", None, args)
    spec = f"loops:{args.d}"
    for name in ("step", "pipelined"):
        if name not in args.paths:
            continue
        label = f"{spec}, k={args.k}" if name == "step" else f"pipelined {spec}, k={args.k}"
        chain = dict(passes_per_step=args.passes_per_step) if name == "pipelined" else {}
        with Engine(path, depth_batching=name == "pipelined", speculative=spec,
                    num_speculative_tokens=args.k, **chain, **common) as engine:
            for accept_all, forced in ((True, "forced 100%"), (False, "forced 0%")):
                force_acceptance(engine, accept_all)
                rows += timed_rows(engine, f"{label}, acceptance {forced}", name, float(accept_all), args)
    base = {r["batch"]: r["tpot_ms"] for r in rows if r["mode"] == NON_SPECULATIVE}
    d, k = args.d, args.k
    bounds = {"step": k * loops / (k * d + loops - d), "pipelined": loops / d}
    for r in rows:
        r["speedup"] = round(base[r["batch"]] / r["tpot_ms"], 3)
        r["bound"] = round(bounds[r["path"]], 3) if r["forced_acceptance"] == 1 else None
    return rows, loops


def project(rows: list[dict], args: argparse.Namespace) -> list[dict] | None:
    """TPOT at the tiny model's measured tokens per step: the step time of the speculative step's forced-100%
    rows (steps that draft k tokens, as a well-accepted request's steps do) over those tokens per step."""
    measured = json.loads(Path(args.acceptance_json).read_text())["rows"]
    match = [m for m in measured if m["d"] == args.d and m["k"] == args.k]
    if not match:
        return None
    per_step = match[0]["tokens_per_step"]
    base = {r["batch"]: r["tpot_ms"] for r in rows if r["mode"] == NON_SPECULATIVE}
    projected = []
    for r in rows:
        if r["path"] == "step" and r["forced_acceptance"] == 1:
            tpot = r["step_ms"] / per_step
            projected.append({"batch": r["batch"], "tokens_per_step": per_step, "tpot_ms": round(tpot, 3),
                              "speedup": round(base[r["batch"]] / tpot, 3)})
    return projected


def acceptance_table(rows: list[dict], env: dict) -> list[str]:
    lines = [f"Self-speculative acceptance, embedded tiny trained model ({DEFAULT_MODEL.name}), 64 "
             f"addition prompts, greedy, at most 48 tokens; {env['device']}, torch {env['torch']}, "
             f"commit {env['commit']}.", "", "| d | k | accepted | by draft position | tokens / step |",
             "|---|---|---|---|---|"]
    for r in rows:
        by_position = ", ".join(f"{x:.2f}" for x in r["by_position"])
        lines.append(f"| {r['d']} | {r['k']} | {r['acceptance']:.3f} | {by_position} | "
                     f"{r['tokens_per_step']:.2f} |")
    return lines


def tpot_table(rows: list[dict], projected: list[dict] | None, loops: int, path: str, env: dict,
               args: argparse.Namespace) -> list[str]:
    def cell(value) -> str:
        return "-" if value is None else str(value)

    lines = [f"Self-speculative decode TPOT per generated token, {path} (random weights, {args.dtype}, T = "
             f"{loops} loops), prompt {args.prompt}, {args.tokens} tokens per row; a step under depth "
             f"batching is one loop pass; bound: T over the loops a token costs at forced 100% (a loop of "
             f"drafts or a pass costing a plain step's loop); {env['device']}, torch {env['torch']}, triton "
             f"{env['triton']}, commit {env['commit']}.",
             "", "| mode | batch | TPOT ms | step ms | tokens / step | passes / token | drafts accepted "
             "| speed-up | bound |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['batch']} | {r['tpot_ms']} | {r['step_ms']} | {r['tokens_per_step']} | "
              f"{cell(r['passes_per_token'])} | {cell(r['accepted'])} | {r['speedup']} | {cell(r['bound'])} |"
              for r in rows]
    if projected:
        lines += ["", f"Projected at the tiny model's acceptance ({args.d}, {args.k}: "
                  f"{projected[0]['tokens_per_step']} tokens per step), the speculative step:", "",
                  "| batch | TPOT ms | speed-up |", "|---|---|---|"]
        lines += [f"| {p['batch']} | {p['tpot_ms']} | {p['speedup']} |" for p in projected]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--acceptance", action="store_true", help="the tiny model's acceptance (any device)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--d", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64, help="timed tokens per row")
    parser.add_argument("--passes-per-step", type=int, default=None,
                        help="pipelined: passes a step (default: the engine's, chains of four times the "
                             "loops; 1: a pass a step, the host deciding after each)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                        help="beside the non-speculative rows: the speculative step's, pipelined, depth "
                             "batching's at full depth")
    parser.add_argument("--device", default="cuda", help="cuda (cpu only to smoke-test with --preset tiny)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--acceptance-json", default=None,
                        help="a --acceptance result whose (d, k) row gives the projection")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark --acceptance or the TPOT rows ask for; returns the JSON written (--out)."""
    args = parse_args(argv)
    env = environment()
    if args.acceptance:
        rows = acceptance([1, 2, 3], [2, 4, 8], num_prompts=64, max_tokens=48)
        lines = acceptance_table(rows, env)
    else:
        path = checkpoint(args.model, args.preset)
        rows, loops = tpot_rows(path, args)
        projected = project(rows, args) if args.acceptance_json else None
        lines = tpot_table(rows, projected, loops, path, env, args)
        rows = {"measured": rows, "projected": projected}
    table = "\n".join(lines)
    payload = {**env, "rows": rows}
    if args.out:
        write_results(args.out, payload, table)
    print(table)
    return payload


if __name__ == "__main__":
    main()
