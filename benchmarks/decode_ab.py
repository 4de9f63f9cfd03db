"""Decode TPOT of two versions of this repository on the same GPU in one run, in ABBA order so that drift
on a shared machine cancels: the check that a change left the default path (full policy, CUDA graphs) no
slower (--eager: the eager path instead). Each pass runs in its own process and uses only the public Engine
API, which both sides share.

    python -m benchmarks.decode_ab --a HEAD~1 --out /tmp/decode_ab.json      # the commit before vs this tree
    python -m benchmarks.decode_ab --a main --b my-branch --batches 1 16 --prompt 2048

--a and --b each take a git commit-ish, checked out with `git worktree` into a temporary directory that is
removed afterwards, or a directory holding another tree (on a machine whose copy has no git history, make it
beforehand: `git worktree add DIR REF`). --b defaults to this working tree, uncommitted changes included.

With --profile, each pass also runs torch.profiler over decode steps at the smallest batch and reports the
device time and launch count per step of every kernel, and the wall time per step that no kernel covers
(host work the GPU waits for), and runs cProfile over as many more steps for the host's Python functions;
the table then lists the kernels and the functions whose time differs most between A and B.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def git_worktree(ref: str, repo: Path = ROOT) -> Iterator[Path]:
    """A detached checkout of `ref` (any commit-ish of repo) in a temporary directory, removed on exit."""
    commit = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=repo,
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise ValueError(f"{ref!r} is neither a directory nor a commit of the git repository at {repo}")
    with tempfile.TemporaryDirectory(prefix="decode_ab-") as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), commit.stdout.strip()],
                       cwd=repo, check=True, capture_output=True, text=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)


def resolve_tree(spec: str, stack: ExitStack) -> Path:
    """A directory as itself; anything else as a git commit-ish, checked out until `stack` closes."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve()
    return stack.enter_context(git_worktree(spec))


def one_pass(tree: str, model: str, batches: list[int], prompt: int, steps: int,
             profile_steps: int = 0, eager: bool = False) -> dict:
    """TPOT ms per batch size, in this process, whose engine is `tree`'s (its PYTHONPATH), with CUDA graphs
    or, with eager, without; with profile_steps, also the per-kernel profile of that many decode steps at
    the smallest batch."""
    import torch

    from engine import Engine, SamplingParams

    tpot, kernels = {}, None
    with Engine(model, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                max_model_len=prompt + steps + 8, enable_prefix_caching=False, enforce_eager=eager,
                verbose=False) as engine:
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
        if profile_steps:
            kernels = profile_decode(engine, min(batches), prompt, profile_steps)
    return {"tpot_ms": tpot, "profile": kernels}


def profile_decode(engine, batch: int, prompt: int, steps: int) -> dict:
    """Per decode step: each kernel's device µs and launches, the wall µs, and the wall µs when no kernel
    runs (the union of kernel intervals subtracted from the profiled span)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)  # both profiles decode
    for _ in range(batch):
        engine.add_request(list(range(3, 3 + prompt)), params)
    for _ in range(4):  # prefill and warm decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    host = host_profile(engine, steps)
    while engine.has_unfinished():
        engine.step()
    per_kernel: dict[str, list[float]] = {}
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us() > 0:
            entry = per_kernel.setdefault(event.name[:100], [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
            intervals.append((event.time_range.start, event.time_range.end))
    intervals.sort()
    busy, reach = 0.0, float("-inf")
    for begin, end in intervals:  # union of the kernel intervals
        if end > reach:
            busy += end - max(begin, reach)
            reach = end
    return {"steps": steps, "wall_us_per_step": round(wall_us / steps, 1),
            "device_busy_us_per_step": round(busy / steps, 1),
            "kernels": {name: [round(us / steps, 2), round(n / steps, 2)]
                        for name, (us, n) in per_kernel.items()}, "host_functions": host}


def host_profile(engine, steps: int, top: int = 40) -> dict:
    """cProfile over `steps` decode steps: the `top` functions by own time, as {name: [µs per step (cProfile's
    overhead included), calls per step]}, and the total under cProfile."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    functions = {f"{Path(file).name}:{line}({name})": [round(own * 1e6 / steps, 1), round(calls / steps, 1)]
                 for (file, line, name), (_, calls, own, _, _) in rows}
    return {"total_us_per_step": round(sum(v[2] for v in stats.values()) * 1e6 / steps, 1),
            "functions": functions}


def tree_commit(tree: Path) -> str:
    """The short commit a tree is at (+uncommitted where tracked files changed), or "unknown" outside git."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree,
                             capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+uncommitted" if changed else "")


def timed_pass(side: str, tree: Path, label: str, model: str, args: argparse.Namespace) -> dict:
    """One pass in its own process, whose engine is `tree`'s: TPOT per batch (and the profile, if asked)."""
    # -P: neither this script's directory nor the working directory goes on sys.path, so the child
    # imports the engine from PYTHONPATH, the tree of its side (and this file, its pass, from here).
    command = [sys.executable, "-P", __file__, "--a", args.a, "--pass-tree", str(tree), "--model", model,
               "--prompt", str(args.prompt), "--steps", str(args.steps), "--profile", str(args.profile),
               *(["--eager"] * args.eager), "--batches", *map(str, args.batches)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    if result.returncode != 0:
        raise SystemExit(f"pass {side} ({tree}) failed:\n{result.stderr[-3000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    tpot = {int(k): v for k, v in measured["tpot_ms"].items()}
    print({"side": side, "tpot_ms": tpot}, flush=True)
    return {"side": side, "label": label, "tpot_ms": tpot, "profile": measured["profile"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="version A: a git commit-ish (e.g. HEAD~1) or a directory")
    parser.add_argument("--b", default=str(ROOT),
                        help="version B: a commit-ish or a directory (default: this working tree)")
    parser.add_argument("--labels", nargs=2, default=None, help="names of A and B (default: --a and --b)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also profile this many decode steps at the smallest batch in each pass")
    parser.add_argument("--eager", action="store_true", help="time eager steps (enforce_eager) instead")
    parser.add_argument("--out", default=None)
    parser.add_argument("--pass-tree", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pass_tree is not None:  # a child: one pass, its TPOTs as JSON on the last line
        print(json.dumps(one_pass(args.pass_tree, args.model, args.batches, args.prompt, args.steps,
                                  args.profile, args.eager)))
        return
    from benchmarks.common import checkpoint, environment, write_results

    model = checkpoint(args.model, args.preset)
    label = dict(zip("AB", args.labels or [args.a, "this tree" if args.b == str(ROOT) else args.b]))
    with ExitStack() as stack:
        trees = {"A": resolve_tree(args.a, stack), "B": resolve_tree(args.b, stack)}
        commits = {side: tree_commit(tree) for side, tree in trees.items()}
        passes = [timed_pass(side, trees[side], label[side], model, args) for side in "ABBA" * args.rounds]
    rows = []
    key = {side: "tpot_ms_" + label[side] for side in "AB"}
    for batch in args.batches:
        median = {side: statistics.median(p["tpot_ms"][batch] for p in passes if p["side"] == side)
                  for side in "AB"}
        rows.append({"batch": batch, key["A"]: round(median["A"], 3), key["B"]: round(median["B"], 3),
                     "ratio_b_over_a": round(median["B"] / median["A"], 3)})
    env = environment()
    mode = "eager (enforce_eager)" if args.eager else "CUDA graphs (the default)"
    lines = [f"Decode TPOT, full policy, {mode}, {model} (random weights, bf16), prompt "
             f"{args.prompt}, {args.steps} steps; passes in {'ABBA' * args.rounds} order, medians; "
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}; A = {label['A']} (commit "
             f"{commits['A']}), B = {label['B']} (commit {commits['B']}).", "",
             f"| batch | TPOT ms {label['A']} | TPOT ms {label['B']} | {label['B']} / {label['A']} |",
             "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r[key['A']]} | {r[key['B']]} | {r['ratio_b_over_a']} |" for r in rows]
    if args.profile:
        lines += ["", *profile_table(passes, label)]
    table = "\n".join(lines)
    if args.out:
        write_results(args.out, {**env, "model": model, "eager": args.eager, "a": label["A"], "b": label["B"],
                                 "commits": commits, "passes": passes, "rows": rows}, table)
    print(table)


def profile_table(passes: list[dict], label: dict) -> list[str]:
    """Median over a side's passes of wall, device-busy and idle µs per step, then the kernels whose
    device time per step differs most between the sides."""
    def median_of(side, get):
        return statistics.median(get(p["profile"]) for p in passes if p["side"] == side)

    lines = [f"Profile, batch {min(passes[0]['tpot_ms'])}, µs per decode step (medians over passes):", "",
             f"| | {label['A']} | {label['B']} |", "|---|---|---|"]
    for title, key in (("wall", "wall_us_per_step"), ("device busy", "device_busy_us_per_step")):
        a, b = (median_of(side, lambda p, key=key: p[key]) for side in "AB")
        lines.append(f"| {title} | {a:.1f} | {b:.1f} |")
    names = {name for p in passes for name in p["profile"]["kernels"]}
    diffs = []
    for name in names:
        us = {side: median_of(side, lambda p: p["kernels"].get(name, [0.0, 0])[0]) for side in "AB"}
        calls = {side: median_of(side, lambda p: p["kernels"].get(name, [0.0, 0])[1]) for side in "AB"}
        diffs.append((us["B"] - us["A"], name, us, calls))
    diffs.sort(key=lambda d: -abs(d[0]))
    lines += ["", f"| kernel | µs {label['A']} (launches) | µs {label['B']} (launches) | difference |",
              "|---|---|---|---|"]
    lines += [f"| {name[:70]} | {us['A']:.1f} ({calls['A']:g}) | {us['B']:.1f} ({calls['B']:g}) | {d:+.1f} |"
              for d, name, us, calls in diffs[:12]]
    host = {side: [p["profile"]["host_functions"] for p in passes if p["side"] == side] for side in "AB"}
    total = {side: statistics.median(h["total_us_per_step"] for h in host[side]) for side in "AB"}
    lines += ["", f"Host Python under cProfile, µs per step (its overhead included): {label['A']} "
              f"{total['A']:.0f}, {label['B']} {total['B']:.0f}. Each side's top functions by own time:", "",
              f"| {label['A']} | µs (calls) | {label['B']} | µs (calls) |", "|---|---|---|---|"]
    first = {side: list(host[side][0]["functions"].items())[:15] for side in "AB"}
    for (name_a, (us_a, n_a)), (name_b, (us_b, n_b)) in zip(first["A"], first["B"]):
        lines.append(f"| {name_a[:60]} | {us_a} ({n_a:g}) | {name_b[:60]} | {us_b} ({n_b:g}) |")
    return lines


if __name__ == "__main__":
    main()
