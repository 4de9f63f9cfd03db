"""Decode TPOT of two checkouts of this repository on the same GPU in one run, in ABBA order so that drift
on a shared machine cancels: the check that a change left the default path (full policy, CUDA graphs) no
slower. Each pass runs in its own process and uses only the public Engine API, which both sides share.

    python -m benchmarks.decode_ab --a /path/to/before --b . --out benchmarks/results/decode_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_pass(tree: str, model: str, batches: list[int], prompt: int, steps: int) -> dict[int, float]:
    """TPOT ms per batch size, in this process, whose engine is `tree`'s (its PYTHONPATH)."""
    import torch

    from engine import Engine, SamplingParams

    tpot = {}
    with Engine(model, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                max_model_len=prompt + steps + 8, enable_prefix_caching=False, verbose=False) as engine:
        for batch in batches:
            for timed_steps in (4, steps):  # the first round warms up the same shapes
                rng = random.Random(batch)
                params = SamplingParams(temperature=0, max_tokens=timed_steps + 1, ignore_eos=True)
                for _ in range(batch):
                    engine.add_request([rng.randrange(3, engine.config.vocab_size) for _ in range(prompt)],
                                       params)
                produced = 0
                while produced < batch:
                    produced += sum(1 for out in engine.step() if len(out.outputs[0].token_ids) == 1)
                torch.cuda.synchronize()
                start, count = time.perf_counter(), 0
                while engine.has_unfinished():
                    engine.step()
                    count += 1
                torch.cuda.synchronize()
            tpot[batch] = (time.perf_counter() - start) * 1e3 / count
    return tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="checkout A (e.g. the commit before a change)")
    parser.add_argument("--b", default=str(ROOT), help="checkout B (default: this one)")
    parser.add_argument("--labels", nargs=2, default=["before", "after"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    parser.add_argument("--out", default=None)
    parser.add_argument("--pass-tree", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pass_tree is not None:  # a child: one pass, its TPOTs as JSON on the last line
        print(json.dumps(one_pass(args.pass_tree, args.model, args.batches, args.prompt, args.steps)))
        return
    from benchmarks.common import checkpoint, environment, write_results

    model = checkpoint(args.model, args.preset)
    trees = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    label = dict(zip("AB", args.labels))
    passes = []
    for side in "ABBA" * args.rounds:
        # -P: neither this script's directory nor the working directory goes on sys.path, so the child
        # imports the engine from PYTHONPATH, the tree of its side (and this file, its pass, from here).
        command = [sys.executable, "-P", __file__, "--a", args.a, "--pass-tree", trees[side],
                   "--model", model, "--prompt", str(args.prompt), "--steps", str(args.steps), "--batches",
                   *map(str, args.batches)]
        result = subprocess.run(command, capture_output=True, text=True, cwd=trees[side],
                                env={**os.environ, "PYTHONPATH": trees[side]})
        if result.returncode != 0:
            raise SystemExit(f"pass {side} ({trees[side]}) failed:\n{result.stderr[-3000:]}")
        tpot = {int(k): v for k, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}
        passes.append({"side": side, "label": label[side], "tpot_ms": tpot})
        print(passes[-1], flush=True)
    rows = []
    key = {side: "tpot_ms_" + label[side] for side in "AB"}
    for batch in args.batches:
        median = {side: statistics.median(p["tpot_ms"][batch] for p in passes if p["side"] == side)
                  for side in "AB"}
        rows.append({"batch": batch, key["A"]: round(median["A"], 3), key["B"]: round(median["B"], 3),
                     "ratio_b_over_a": round(median["B"] / median["A"], 3)})
    env = environment()
    lines = [f"Decode TPOT, full policy, CUDA graphs (the default), {model} (random weights, bf16), prompt "
             f"{args.prompt}, {args.steps} steps; passes in {'ABBA' * args.rounds} order, medians; "
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}; A = {label['A']}, B = "
             f"{label['B']} (commit {env['commit']}).", "",
             f"| batch | TPOT ms {label['A']} | TPOT ms {label['B']} | {label['B']} / {label['A']} |",
             "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r[key['A']]} | {r[key['B']]} | {r['ratio_b_over_a']} |" for r in rows]
    table = "\n".join(lines)
    if args.out:
        write_results(args.out, {**env, "model": model, "a": label["A"], "b": label["B"], "passes": passes,
                                 "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
