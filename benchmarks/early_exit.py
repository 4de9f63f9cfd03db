"""early:Q against full: loops run per generated token and TPOT, on a real-shape random-weight checkpoint.

    python benchmarks/early_exit.py --preset ouro-1.4b --out benchmarks/results/early_exit.json

Random weights exit arbitrarily, so the exit pattern is forced: the gate weight is zeroed and its bias set
(model.early_exit.force_exit_loop) so that every generated token's exit CDF first reaches Q after loop k,
for k = 0, 1, 2 (1, 2, 3 of 4 loops). One more row keeps the random gate (an arbitrary mix), and one forces
no exit at all, which measures what the loop-by-loop driver itself costs. Baselines: full with CUDA graphs
(the default) and full eager; early:Q always runs eagerly (its batch shrinks loop by loop).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import checkpoint, environment, write_results  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from model.early_exit import force_exit_loop  # noqa: E402

Q = 0.5


def decode_run(engine: Engine, batch: int, prompt: int, steps: int, seed: int) -> dict:
    """TPOT over `steps` decode steps of `batch` rows (timed after every row has its first token), and the
    loops the early-exit driver ran per decode token in that time."""
    if steps > 4:  # warm-up on the same shapes: Triton compiles stay out of the timed loop
        decode_run(engine, batch, prompt, 4, seed + 1)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, engine.config.vocab_size) for _ in range(prompt)], params)
    produced = 0
    while produced < batch:
        produced += sum(1 for out in engine.step() if len(out.outputs[0].token_ids) == 1)
    early = engine.runner.early_exit
    tokens0, loops0 = (early.stats.decode_tokens, early.stats.decode_loops) if early else (0, 0)
    _sync(engine)
    start, count = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        count += 1
    _sync(engine)
    tpot = (time.perf_counter() - start) * 1e3 / max(count, 1)
    loops = engine.config.total_ut_steps
    if early is not None:
        loops = (early.stats.decode_loops - loops0) / max(early.stats.decode_tokens - tokens0, 1)
    return {"tpot_ms": round(tpot, 3), "loops_per_token": round(loops, 3)}


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


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
    rows = []
    for name, engine_args in (("full, CUDA graphs", {}), ("full, eager", {"enforce_eager": True})):
        with Engine(path, **common, **engine_args) as engine:
            for batch in args.batches:
                rows.append({"policy": "full", "mode": name, "exit": "-", "batch": batch,
                             **decode_run(engine, batch, args.prompt, args.steps, seed=batch)})
                print(rows[-1], flush=True)
    with Engine(path, exit_policy=f"early:{Q}", **common) as engine:
        gate = {k: v.clone() for k, v in engine.model.early_exit_gate.state_dict().items()}
        loops = engine.config.total_ut_steps
        # exit_loop T-1: CDF first reaches Q after the last loop, so no token stops early.
        patterns = [(f"forced after loop {k}", k) for k in range(loops - 1)]
        patterns += [("random gate (arbitrary mix)", None), ("forced: none (driver overhead)", loops - 1)]
        for label, exit_loop in patterns:
            engine.model.early_exit_gate.load_state_dict(gate)
            if exit_loop is not None:
                force_exit_loop(engine.model, exit_loop, Q)
            for batch in args.batches:
                rows.append({"policy": f"early:{Q}", "mode": "eager", "exit": label, "batch": batch,
                             **decode_run(engine, batch, args.prompt, args.steps, seed=batch)})
                print(rows[-1], flush=True)
    for row in rows:
        base = {r["mode"]: r["tpot_ms"] for r in rows if r["policy"] == "full" and r["batch"] == row["batch"]}
        row["speedup_vs_full_eager"] = round(base["full, eager"] / row["tpot_ms"], 2)
        row["speedup_vs_full_graphs"] = round(base["full, CUDA graphs"] / row["tpot_ms"], 2)
    env = environment()
    lines = [f"early:Q vs full, {path} (random weights, {args.dtype}), prompt {args.prompt}, "
             f"{args.steps} decode steps, {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"commit {env['commit']}.",
             "The exit pattern is forced by zeroing the gate weight and setting its bias (random weights "
             "exit arbitrarily); 'loops/token' is what the engine measured.", "",
             "| policy | mode | exit pattern | batch | loops/token | TPOT ms | x full eager "
             "| x full graphs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['mode']} | {r['exit']} | {r['batch']} | {r['loops_per_token']} | "
                     f"{r['tpot_ms']} | {r['speedup_vs_full_eager']} | {r['speedup_vs_full_graphs']} |")
    table = "\n".join(lines)
    write_results(args.out, {**env, "checkpoint": path, "q": Q, "prompt": args.prompt, "steps": args.steps,
                             "gate": "weight zeroed, bias forced per row (model.early_exit.force_exit_loop)",
                             "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
