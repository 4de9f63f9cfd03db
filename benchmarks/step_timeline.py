"""Where a decode step's host time goes, without a profiler's overhead: host timestamps on entry to and exit
from the step's stages (schedule, prepare, the executor's begin and each loop's replay, each after-loop
hook, which waits for the loop's exit flags, the readout and sampling), averaged over steps.

    python -m benchmarks.step_timeline --preset ouro-1.4b --policy early:0.5 --forced-exit 3 --batch 1
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from benchmarks.common import checkpoint
from engine import Engine, SamplingParams
from model.exit_policy import force_exit_loop


def instrument(obj, name: str, marks: list) -> None:
    """Record (name, entry time) and (name, exit time) around every call of obj.name."""
    method = getattr(obj, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        marks.append((name + " >", time.perf_counter()))
        try:
            return method(*args, **kwargs)
        finally:
            marks.append((name + " <", time.perf_counter()))

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--forced-exit", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=args.batch, exit_policy=args.policy,
                max_model_len=512 + 2 * args.steps + 16, enable_prefix_caching=False,
                verbose=False) as engine:
        if args.forced_exit is not None:
            force_exit_loop(engine.model, args.forced_exit, float(args.policy.partition(":")[2]))
        params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 8, ignore_eos=True)
        for _ in range(args.batch):
            engine.add_request(list(range(3, 515)), params)
        for _ in range(4):
            engine.step()
        marks: list = []
        runner = engine.runner
        instrument(engine.scheduler, "schedule", marks)
        instrument(runner, "prepare", marks)
        instrument(runner, "_sample_rows", marks)
        if runner.graphs is not None:
            for name in ("begin", "run_loop", "replay_step"):
                instrument(runner.graphs, name, marks)
        if runner.hook is not None:
            instrument(runner.hook, "after_loop", marks)
        torch.cuda.synchronize()
        steps = []
        for _ in range(args.steps):
            marks.clear()
            start = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            steps.append([(label, (t - start) * 1e6) for label, t in marks]
                         + [("step end", (end - start) * 1e6)])
    print(f"{args.policy} forced {args.forced_exit} batch {args.batch}: µs from step start, mean over "
          f"{len(steps)} steps")
    for i, (label, _) in enumerate(steps[-1]):
        times = [s[i][1] for s in steps if len(s) == len(steps[-1])]
        print(f"{sum(times) / len(times):10.1f}  {label}")


if __name__ == "__main__":
    main()
