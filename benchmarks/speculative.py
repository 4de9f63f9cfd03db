"""Self-speculative decoding (docs/speculative.md): how often the first d loops' drafts are accepted, and
what a step costs.

    python -m benchmarks.speculative --acceptance --out benchmarks/results/speculative_acceptance.json
    python -m benchmarks.speculative --preset ouro-1.4b --out benchmarks/results/speculative.json

--acceptance: the embedded tiny trained model on its own task (the addition prompts), greedy, for d = 1, 2,
3 and k = 2, 4, 8: acceptance overall and per draft position, tokens per step. Runs anywhere (CPU included).

Otherwise, on the GPU at a real shape with random weights, bf16, prompt 512: decode TPOT per generated
token at each batch size, non-speculative (the default whole-step CUDA graphs) against speculative with
the acceptance forced to 100% and to 0%. Random weights accept nothing on their own, so the forcing is what
bounds the real speed-up from both sides: `force_acceptance` below replaces the engine's greedy acceptance
test with a constant answer. It is a benchmark-only hook, defined here and used nowhere in the engine. The
projected TPOT at an acceptance profile is the measured step time over the tokens per step that profile
yields (tiny model's, from --acceptance-json).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


from benchmarks.common import (ROOT, add_random_prompts, checkpoint, environment, prefill_until_first_tokens,
                               time_until_done, write_results)
from engine import DEFAULT_MODEL, Engine, SamplingParams


def force_acceptance(engine: Engine, accept_all: bool) -> None:
    """Benchmark-only: every greedy draft is accepted (accept_all) or every one rejected, whatever the
    target says. The tokens are then not the model's; only the timing means anything."""
    engine.runner.speculation.accept = (lambda drafts, targets: len(drafts)) if accept_all else \
        (lambda drafts, targets: 0)


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
    """Per generated token: wall ms of the decode steps after every row has its first token; and the steps
    taken per row's token."""
    if tokens > 8:
        decode_tpot(engine, batch, prompt, 8, seed + 1)  # warm-up on the same shapes
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    add_random_prompts(engine, batch, prompt, params, random.Random(seed))
    prefill_until_first_tokens(engine, batch)
    elapsed, steps = time_until_done(engine)
    return {"tpot_ms": round(elapsed / tokens, 3), "step_ms": round(elapsed / steps, 3),
            "tokens_per_step": round(tokens / steps, 3)}


def project(rows: list[dict], args: argparse.Namespace) -> list[dict] | None:
    """TPOT at the tiny model's measured tokens per step: the step time of the forced-100% rows (steps that
    draft k tokens, as a well-accepted request's steps do) over those tokens per step."""
    measured = json.loads(Path(args.acceptance_json).read_text())["rows"]
    match = [m for m in measured if m["d"] == args.d and m["k"] == args.k]
    if not match:
        return None
    per_step = match[0]["tokens_per_step"]
    base = {r["batch"]: r["tpot_ms"] for r in rows if r["mode"] == "non-speculative"}
    projected = []
    for r in rows:
        if r["mode"].endswith("forced 100%"):
            tpot = r["step_ms"] / per_step
            projected.append({"batch": r["batch"], "tokens_per_step": per_step, "tpot_ms": round(tpot, 3),
                              "speedup": round(base[r["batch"]] / tpot, 3)})
    return projected


def main() -> None:
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
    parser.add_argument("--acceptance-json", default=None,
                        help="a --acceptance result whose (d, k) row gives the projection")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = environment()
    if args.acceptance:
        rows = acceptance([1, 2, 3], [2, 4, 8], num_prompts=64, max_tokens=48)
        lines = [f"Self-speculative acceptance, embedded tiny trained model ({DEFAULT_MODEL.name}), 64 "
                 f"addition prompts, greedy, at most 48 tokens; {env['device']}, torch {env['torch']}, "
                 f"commit {env['commit']}.", "", "| d | k | accepted | by draft position | tokens / step |",
                 "|---|---|---|---|---|"]
        for r in rows:
            by_position = ", ".join(f"{x:.2f}" for x in r["by_position"])
            lines.append(f"| {r['d']} | {r['k']} | {r['acceptance']:.3f} | {by_position} | "
                         f"{r['tokens_per_step']:.2f} |")
    else:
        path = checkpoint(args.model, args.preset)
        common = dict(device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches),
                      enable_prefix_caching=False, max_model_len=args.prompt + 2 * args.tokens + 64,
                      verbose=False)
        rows = []
        with Engine(path, **common) as engine:
            for batch in args.batches:
                rows.append({"mode": "non-speculative", "batch": batch,
                             **decode_tpot(engine, batch, args.prompt, args.tokens, seed=batch)})
                print(rows[-1], flush=True)
        spec = f"loops:{args.d}"
        with Engine(path, speculative=spec, num_speculative_tokens=args.k, **common) as engine:
            for accept_all, name in ((True, "forced 100%"), (False, "forced 0%")):
                force_acceptance(engine, accept_all)
                for batch in args.batches:
                    rows.append({"mode": f"{spec}, k={args.k}, acceptance {name}", "batch": batch,
                                 **decode_tpot(engine, batch, args.prompt, args.tokens, seed=batch)})
                    print(rows[-1], flush=True)
        base = {r["batch"]: r["tpot_ms"] for r in rows if r["mode"] == "non-speculative"}
        for r in rows:
            r["speedup"] = round(base[r["batch"]] / r["tpot_ms"], 3)
        projected = project(rows, args) if args.acceptance_json else None
        lines = [f"Self-speculative decode TPOT per generated token, {path} (random weights, bf16), "
                 f"prompt {args.prompt}, {args.tokens} tokens per row; {env['device']}, torch "
                 f"{env['torch']}, triton {env['triton']}, commit {env['commit']}.", "",
                 "| mode | batch | TPOT ms | step ms | tokens / step | speed-up |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['batch']} | {r['tpot_ms']} | {r['step_ms']} | "
                  f"{r['tokens_per_step']} | {r['speedup']} |" for r in rows]
        if projected:
            lines += ["", f"Projected at the tiny model's acceptance ({args.d}, {args.k}: "
                      f"{projected[0]['tokens_per_step']} tokens per step):", "",
                      "| batch | TPOT ms | speed-up |", "|---|---|---|"]
            lines += [f"| {p['batch']} | {p['tpot_ms']} | {p['speedup']} |" for p in projected]
        rows = {"measured": rows, "projected": projected}
    table = "\n".join(lines)
    if args.out:
        write_results(args.out, {**env, "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
