"""Paired evaluation of two engine configs on one frozen protocol (`python engine.py eval`): each config runs
every item once with logprobs, the runs are compared item by item (benchmarks/paired_report.py), and an ABBA
timing of the two follows (benchmarks/abba.py).

    python engine.py eval --protocol benchmarks/tasks/addition.json --a loops=4 --b loops=1 \\
        --out benchmarks/results/paired-loops4_vs_loops1.json

    from benchmarks.paired_eval import paired_eval
    report = paired_eval("benchmarks/tasks/addition.json", {"loops": 4}, {"loops": 1})
    report               # shows itself as markdown in a notebook; report.rows() is a per-item table

A config is Engine keyword arguments; it overrides the protocol's loops, and `common` (--engine) applies to
both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from benchmarks.abba import abba
from benchmarks.common import environment
from benchmarks.eval_protocol import EvalItem, Protocol, load_protocol
from benchmarks.eval_task import AnswerRule
from benchmarks.paired_report import PairedReport, Side, pair_items
from engine import Engine, check_engine_kwargs, engine_kwargs
from request import SamplingParams

def paired_eval(protocol: str | Path | Protocol, a: dict[str, Any], b: dict[str, Any], *,
                common: dict[str, Any] | None = None, task: str | Path | None = None, abba_rounds: int = 1,
                limit: int | None = None) -> PairedReport:
    """Run configs a and b (Engine keyword arguments) on the protocol's items and compare them. `task`
    replaces the protocol's task path; `limit` keeps its first items only (the report notes both);
    abba_rounds 0 skips the timing."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1 (the protocol's first N items), got {limit!r}")
    protocol = protocol if isinstance(protocol, Protocol) else load_protocol(protocol, task)
    for flag, args in (("a", a), ("b", b), ("common", common or {})):
        check_engine_kwargs(args, flag)
    every = protocol.items()
    items = every[:limit] if limit is not None else every
    base = {"loops": protocol.loops} if protocol.loops is not None else {}
    engine_args = {"A": {**base, **(common or {}), **a}, "B": {**base, **(common or {}), **b}}
    params = protocol.sampling_params()
    sides = [run_side(label(side), items, params, engine_args[name], protocol.extract)
             for name, side in (("A", a), ("B", b))]
    timing = abba(engine_args, [i.prompt for i in items], dataclasses.replace(params, logprobs=None),
                  abba_rounds) if abba_rounds else None
    notes = []
    if len(items) < len(every):
        notes.append(f"limit={limit}: the first {limit} of the protocol's {len(every)} items only, not the "
                     "frozen protocol")
    if task is not None:
        notes.append(f"task file replaced by {task}")
    return PairedReport({**protocol.to_json(), "task_sha256_used": protocol.task_digest()},
                        {**environment(), "cpu_threads": torch.get_num_threads()},
                        sides[0].summary(), sides[1].summary(), pair_items(items, *sides), timing, notes)


def run_side(name: str, items: list[EvalItem], params: SamplingParams, engine_args: dict[str, Any],
             rule: AnswerRule) -> Side:
    start = time.perf_counter()
    with Engine(**engine_args, verbose=False) as engine:
        outputs = engine.generate([item.prompt for item in items], params, use_tqdm=False)
        stats = engine.loop_stats
        loops = stats.loops_per_token if stats.decode_tokens else float(engine.loops)
        device = str(engine.device)
    wall = time.perf_counter() - start
    completions = [out.outputs[0] for out in outputs]
    for item, completion in zip(items, completions):
        if completion.finish_reason == "error":
            raise ValueError(f"config {name!r} failed on item {item.id!r}: {completion.error}")
    answers = [rule.extract(c.text) for c in completions]
    correct = [answer == item.gold for answer, item in zip(answers, items)]
    return Side(name, engine_args, completions, answers, correct, loops, wall, device)


def label(args: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in args.items()) or "defaults"


def parse_config(tokens: Iterable[str], flag: str) -> dict[str, Any]:
    """KEY=VALUE Engine arguments (engine.engine_kwargs); a token without "=" is the model (a checkpoint
    directory or a Hugging Face id)."""
    tokens = list(tokens)
    models = [token for token in tokens if "=" not in token]
    if len(models) > 1:
        raise ValueError(f"--{flag}: 'model' is given twice")
    return engine_kwargs([t for t in tokens if "=" in t] + [f"model={m}" for m in models], flag)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine.py eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", required=True, help="protocol JSON (benchmarks/tasks/*.json)")
    parser.add_argument("--task", default=None, help="read the task from this JSONL instead (a local copy)")
    config = "Engine arguments KEY=VALUE (loops=1 exit_policy=early:0.5 ...) or a checkpoint dir"
    parser.add_argument("--a", nargs="*", default=[], metavar="ARG", help=f"config A: {config}")
    parser.add_argument("--b", nargs="*", default=[], metavar="ARG", help=f"config B: {config}")
    parser.add_argument("--engine", nargs="*", default=[], metavar="ARG",
                        help="Engine arguments for both sides (device=cpu model=DIR ...)")
    parser.add_argument("--abba", type=int, default=1, help="ABBA timing rounds (default 1; 0: no timing)")
    parser.add_argument("--limit", type=_positive_int, default=None,
                        help="the first N items only (a smoke run; the report says it is not the protocol)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 times steadier on a shared CPU)")
    parser.add_argument("--out", default=None, help="write the report here as JSON, and beside it as .md")
    return parser


def _positive_int(value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return int(value)


def main(argv: Iterable[str] | None = None) -> PairedReport:
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv_list)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        report = paired_eval(args.protocol, parse_config(args.a, "a"), parse_config(args.b, "b"),
                             common=parse_config(args.engine, "engine"), task=args.task,
                             abba_rounds=args.abba, limit=args.limit)
    except (ValueError, OSError) as err:
        sys.exit(f"error: {err}")
    report.environment["command"] = " ".join(["python engine.py eval", *argv_list])
    print(report.markdown())
    if args.out:
        for path in report.save(args.out):
            print(f"wrote {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
