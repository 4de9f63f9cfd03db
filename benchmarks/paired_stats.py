"""The statistics of a paired comparison, as pure functions of lists and dicts: McNemar's exact test, the
first divergent token, the KL between two top-N logprob dicts, and ABBA ratios.

KL(A || B) from top-N logprobs: each side's distribution is known only on its top N tokens (and its sampled
token). Both are coarse-grained onto the tokens known on both sides plus one bucket holding the rest of the
mass, and the KL of those coarse distributions is returned. Coarse-graining never raises a KL (the data
processing inequality), so this is a lower bound on the true KL; it is exact when N is the vocabulary size,
and exactly 0 for identical inputs.
"""

from __future__ import annotations

import math
import statistics

import numpy

TINY = 1e-12  # a rest bucket below this holds no mass: fp32 logprobs of a full vocabulary sum to 1 +- 1e-6


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: the discordant items follow Binomial(only_a + only_b, 1/2) under the
    hypothesis that A and B are equally accurate."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where the token lists differ (the shorter one's length if one is a prefix of the
    other), or None when they are identical."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def topn_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) in nats of two distributions given as {token: logprob} on their top tokens, coarse-grained
    onto the tokens in both plus one rest bucket (this module's docstring)."""
    shared = p.keys() & q.keys()
    kl = sum(math.exp(p[t]) * (p[t] - q[t]) for t in shared)
    rest_p = 1.0 - sum(math.exp(p[t]) for t in shared)
    rest_q = 1.0 - sum(math.exp(q[t]) for t in shared)
    if rest_p > TINY:
        kl += rest_p * math.log(rest_p / max(rest_q, TINY))
    return max(kl, 0.0)


def percentile(values: list[float], q: float) -> float:
    """numpy's (linearly interpolated) q-th percentile, 0 <= q <= 100; NaN for no values."""
    return float(numpy.percentile(values, q)) if values else math.nan


def abba_ratio(order: str, values: list[float]) -> float:
    """Median over adjacent (A, B) pairs of value_B / value_A. With passes in ABBA order, pairs (A1, B1) and
    (B2, A2) put each B next to an A, so a drift in the machine's speed cancels out of the median."""
    if len(order) != len(values) or len(order) % 2:
        raise ValueError(f"need one value per pass and an even number of passes, got {order!r} and "
                         f"{len(values)} values")
    ratios = []
    for i in range(0, len(order), 2):
        pair = dict(zip(order[i:i + 2], values[i:i + 2]))
        if set(pair) != {"A", "B"}:
            raise ValueError(f"passes {i} and {i + 1} of {order!r} are not one A and one B")
        ratios.append(pair["B"] / pair["A"])
    return statistics.median(ratios)
