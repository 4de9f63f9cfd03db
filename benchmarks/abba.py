"""ABBA timing of two engine configs on the same prompts: passes in the order A B B A (repeated per round),
each on a fresh engine after a short untimed warm-up, so that drift on a shared machine cancels out of the
median B/A ratio (benchmarks/paired_stats.abba_ratio). Engine construction (loading, graph capture) is not
timed; generation is, from submitting every prompt to the last one finishing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from benchmarks.paired_stats import abba_ratio
from engine import Engine
from request import SamplingParams


@dataclasses.dataclass(slots=True)
class TimingPass:
    """One pass. tpot_ms: the mean over requests of (last token time - first token time) / (tokens - 1);
    ttft_ms: the mean time from submission to a request's first token; tok_s: output tokens / wall_s."""

    label: str
    wall_s: float
    output_tokens: int
    tok_s: float
    tpot_ms: float
    ttft_ms: float


@dataclasses.dataclass(slots=True)
class Timing:
    """The passes in order, and the median B/A ratio of tok/s and of TPOT over adjacent A/B pairs."""

    order: str
    prompts: int
    passes: list[TimingPass]
    tok_s_ratio: float
    tpot_ratio: float

    def median(self, label: str, field: str) -> float:
        return statistics.median(getattr(p, field) for p in self.passes if p.label == label)


def abba(engine_args: dict[str, dict[str, Any]], prompts: list[str], params: SamplingParams,
         rounds: int = 1) -> Timing:
    """Time engine_args["A"] and engine_args["B"] in ABBA order, `rounds` times over."""
    if rounds < 1:
        raise ValueError(f"ABBA rounds must be >= 1, got {rounds!r}")
    order = "ABBA" * rounds
    passes = [time_pass(label, engine_args[label], prompts, params) for label in order]
    return Timing(order, len(prompts), passes, abba_ratio(order, [p.tok_s for p in passes]),
                  abba_ratio(order, [p.tpot_ms for p in passes]))


def time_pass(label: str, engine_args: dict[str, Any], prompts: list[str],
              params: SamplingParams) -> TimingPass:
    with Engine(**engine_args, verbose=False) as engine:
        # Triton JIT and the allocator warm up here, on a prompt that shares no prefix-cache block with the
        # timed ones.
        engine.generate(["Warm-up. " + prompts[0]], dataclasses.replace(params, max_tokens=4), use_tqdm=False)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        tokens: dict[str, int] = {}
        start = time.perf_counter()
        for out in engine.stream(prompts, params):
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n:
                first.setdefault(out.request_id, now)
                last[out.request_id], tokens[out.request_id] = now, n
        wall = time.perf_counter() - start
    total = sum(tokens.values())
    tpots = [(last[r] - first[r]) / (tokens[r] - 1) for r in tokens if tokens[r] > 1]
    return TimingPass(label, wall, total, total / wall,
                      1e3 * statistics.fmean(tpots) if tpots else float("nan"),
                      1e3 * statistics.fmean(t - start for t in first.values()))
