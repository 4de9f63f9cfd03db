"""early:Q and kv_sharing="last" against full: loops run per generated token and TPOT, on a real-shape
random-weight checkpoint, with CUDA graphs (per-loop graphs for early:Q) and eagerly.

    python -m benchmarks.early_exit --preset ouro-1.4b --out benchmarks/results/early_exit.json

Random weights exit arbitrarily, so the exit pattern is forced: the gate weight is zeroed and its bias set
(exit_policy.force_exit_loop) so that every generated token's exit CDF first reaches Q after loop k,
for k = 0, 1, 2 (1, 2, 3 of 4 loops). One more row keeps the random gate (an arbitrary mix), and one forces
no exit at all, which measures what the loop-by-loop driver itself costs. kv_sharing="last" rows run the
full policy (and one forced exit) on the shared-last KV layout. Every row records its kv_sharing.
"""

from __future__ import annotations

import argparse
import random


from benchmarks.common import (add_random_prompts, checkpoint, environment, prefill_until_first_tokens,
                               time_until_done, write_results)
from engine import Engine, SamplingParams
from exit_policy import force_exit_loop

Q = 0.5


def decode_run(engine: Engine, batch: int, prompt: int, steps: int, seed: int) -> dict:
    """TPOT over `steps` decode steps of `batch` rows (timed after every row has its first token), and the
    loops the engine ran per decode token in that time."""
    if steps > 4:  # warm-up on the same shapes: Triton compiles stay out of the timed loop
        decode_run(engine, batch, prompt, 4, seed + 1)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    add_random_prompts(engine, batch, prompt, params, random.Random(seed))
    prefill_until_first_tokens(engine, batch)
    stats = engine.loop_stats
    tokens0, loops0 = stats.decode_tokens, stats.decode_loops
    elapsed, count = time_until_done(engine)
    tpot = elapsed / max(count, 1)
    loops = (stats.decode_loops - loops0) / max(stats.decode_tokens - tokens0, 1)
    return {"tpot_ms": round(tpot, 3), "loops_per_token": round(loops, 3)}


def mode_name(engine: Engine) -> str:
    return "CUDA graphs" if engine.uses_cuda_graphs else "eager"


def exit_patterns(loops: int) -> list[tuple[str, int | None]]:
    """(label, forced exit loop): after loop k for each k < T-1, the random gate, and never (the last loop:
    the CDF first reaches Q after the last loop, so no token stops early)."""
    return ([(f"forced after loop {k}", k) for k in range(loops - 1)]
            + [("random gate (arbitrary mix)", None), ("forced: none (driver overhead)", loops - 1)])


def run_policy(path: str, common: dict, batches: list[int], prompt: int, steps: int, rows: list,
               kv_sharing: str, patterns: list[tuple[str, int | None]] | None = None, **engine_args) -> None:
    """Rows of one engine: the full policy (patterns None), or early:Q under each forced exit pattern."""
    policy = "full" if patterns is None else f"early:{Q}"
    with Engine(path, exit_policy=policy, kv_sharing=kv_sharing, **common, **engine_args) as engine:
        gate = {k: v.clone() for k, v in engine.model.early_exit_gate.state_dict().items()}
        for label, exit_loop in patterns or [("-", None)]:
            engine.model.early_exit_gate.load_state_dict(gate)
            if exit_loop is not None:
                force_exit_loop(engine.model, exit_loop, Q)
            for batch in batches:
                rows.append({"policy": policy, "mode": mode_name(engine), "kv_sharing": kv_sharing,
                             "exit": label, "batch": batch,
                             **decode_run(engine, batch, prompt, steps, seed=batch)})
                print(rows[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a generated --preset)")
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--device", default="cuda", help="cuda (cpu only to smoke-test with --preset tiny)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=f"benchmarks/results/early_exit-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    common = dict(device=args.device, dtype=args.dtype, attention=args.attention,
                  max_num_seqs=max(args.batches), max_model_len=args.prompt + args.steps + 8,
                  enable_prefix_caching=False)
    shape = (path, common, args.batches, args.prompt, args.steps)
    rows: list[dict] = []
    run_policy(*shape, rows, "none")
    if rows[-1]["mode"] != "eager":
        run_policy(*shape, rows, "none", enforce_eager=True)
    loops = Engine(path, device="cpu", num_kv_blocks=1, verbose=False).config.total_ut_steps
    run_policy(*shape, rows, "none", exit_patterns(loops))
    run_policy(*shape, rows, "last")
    run_policy(*shape, rows, "last", [("forced after loop 1", 1)])
    for row in rows:
        base = {r["mode"]: r["tpot_ms"] for r in rows
                if r["policy"] == "full" and r["kv_sharing"] == "none" and r["batch"] == row["batch"]}
        graphs = base.get("CUDA graphs")  # None off CUDA
        row["speedup_vs_full_eager"] = round(base["eager"] / row["tpot_ms"], 2)
        row["speedup_vs_full_graphs"] = round(graphs / row["tpot_ms"], 2) if graphs else None
        row["tpot_vs_full_graphs"] = round(row["tpot_ms"] / graphs, 3) if graphs else None
    env = environment()
    lines = [f"early:Q and kv_sharing vs full, {path} (random weights, {args.dtype}), prompt {args.prompt}, "
             f"{args.steps} decode steps, {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"commit {env['commit']}.",
             "The exit pattern is forced by zeroing the gate weight and setting its bias (random weights "
             "exit arbitrarily); 'loops/token' is what the engine measured.", "",
             "| policy | kv_sharing | mode | exit pattern | batch | loops/token | TPOT ms "
             "| TPOT / full graphs | x full eager |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['kv_sharing']} | {r['mode']} | {r['exit']} | {r['batch']} | "
                     f"{r['loops_per_token']} | {r['tpot_ms']} | {r['tpot_vs_full_graphs']} | "
                     f"{r['speedup_vs_full_eager']} |")
    table = "\n".join(lines)
    write_results(args.out, {**env, "checkpoint": path, "q": Q, "prompt": args.prompt, "steps": args.steps,
                             "gate": "weight zeroed, bias forced per row (exit_policy.force_exit_loop)",
                             "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
