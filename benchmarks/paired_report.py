"""The paired report of two configs on one protocol: accuracy of each, the delta with McNemar's exact p-value,
the items only one got right, token identity, each item's first divergent token with both tokens' logprobs
there, KL(A || B) over the shared prefix, and the ABBA timing. JSON for machines, markdown for people (and
notebooks: a report displays itself as markdown in Jupyter).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.abba import Timing
from benchmarks.eval_protocol import EvalItem
from benchmarks.paired_markdown import render
from benchmarks.paired_stats import first_divergence, mcnemar_exact, percentile, topn_kl
from request import CompletionOutput, Logprob

KL_NOTE = ("KL(A || B) in nats at every generated position whose context both runs share (up to and "
           "including the first divergent token), from the top-{n} logprobs of each side: both distributions "
           "are coarse-grained onto the tokens in both top-{n} lists plus one bucket for the rest of the "
           "mass. That is a lower bound on the true KL, exact when N is the vocabulary size.")


@dataclasses.dataclass(slots=True)
class Side:
    """One config's run of the protocol: its Engine arguments and one completion per item."""

    label: str
    engine_args: dict[str, Any]
    completions: list[CompletionOutput]
    answers: list[str | None]
    correct: list[bool]
    loops_per_token: float  # loops run per generated token (fewer than the loop count under early:Q)
    wall_s: float
    device: str

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "engine_args": self.engine_args, "device": self.device,
                "accuracy": self.accuracy, "correct": sum(self.correct), "items": len(self.correct),
                "output_tokens": sum(len(c.token_ids) for c in self.completions),
                "loops_per_token": self.loops_per_token, "wall_s": self.wall_s}


@dataclasses.dataclass(slots=True)
class Divergence:
    """The first position where A's and B's tokens differ; a token is None where that side had ended.
    a_logprobs / b_logprobs: A's and B's logprobs of (A's token, B's token) there, None outside the top N."""

    position: int
    a_token: int | None
    b_token: int | None
    a_text: str | None
    b_text: str | None
    a_logprobs: tuple[float | None, float | None]
    b_logprobs: tuple[float | None, float | None]


@dataclasses.dataclass(slots=True)
class ItemPair:
    id: str
    gold: str
    a_answer: str | None
    b_answer: str | None
    a_correct: bool
    b_correct: bool
    a_text: str
    b_text: str
    a_tokens: int
    b_tokens: int
    divergence: Divergence | None  # None: token-identical
    kl: list[float]  # per shared-prefix position

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def row(self) -> dict[str, Any]:
        """One flat dict, for a table (pandas.DataFrame(report.rows()))."""
        d = self.divergence
        return {"id": self.id, "gold": self.gold, "a_answer": self.a_answer, "b_answer": self.b_answer,
                "a_correct": self.a_correct, "b_correct": self.b_correct, "identical": self.identical,
                "divergence": d.position if d else None, "a_tokens": self.a_tokens, "b_tokens": self.b_tokens,
                "kl_mean": statistics.fmean(self.kl) if self.kl else math.nan,
                "kl_max": max(self.kl, default=math.nan)}


@dataclasses.dataclass(slots=True)
class PairedReport:
    protocol: dict[str, Any]
    environment: dict[str, Any]
    a: dict[str, Any]
    b: dict[str, Any]
    items: list[ItemPair]
    timing: Timing | None
    notes: list[str]

    @property
    def delta(self) -> float:
        return self.b["accuracy"] - self.a["accuracy"]

    @property
    def only_a(self) -> list[str]:
        return [i.id for i in self.items if i.a_correct and not i.b_correct]

    @property
    def only_b(self) -> list[str]:
        return [i.id for i in self.items if i.b_correct and not i.a_correct]

    @property
    def mcnemar_p(self) -> float:
        return mcnemar_exact(len(self.only_a), len(self.only_b))

    @property
    def identity_rate(self) -> float:
        """Items whose A and B tokens are identical, over all items."""
        return sum(i.identical for i in self.items) / len(self.items)

    @property
    def token_identity_rate(self) -> float:
        """Tokens before the first divergence over the longer side's tokens, summed over items."""
        shared = sum(i.divergence.position if i.divergence else i.a_tokens for i in self.items)
        return shared / max(sum(max(i.a_tokens, i.b_tokens) for i in self.items), 1)

    @property
    def kl(self) -> dict[str, float | int]:
        values = [v for i in self.items for v in i.kl]
        return {"mean": statistics.fmean(values) if values else math.nan, "p99": percentile(values, 99),
                "max": max(values, default=math.nan), "positions": len(values)}

    def rows(self) -> list[dict[str, Any]]:
        return [i.row() for i in self.items]

    def to_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "environment": self.environment, "a": self.a, "b": self.b,
                "delta": self.delta, "mcnemar_p": self.mcnemar_p, "only_a": self.only_a,
                "only_b": self.only_b,
                "identity_rate": self.identity_rate, "token_identity_rate": self.token_identity_rate,
                "kl": {**self.kl, "direction": "KL(A || B)",
                       "approximation": KL_NOTE.format(n=self.protocol["logprobs"])},
                "timing": dataclasses.asdict(self.timing) if self.timing else None, "notes": self.notes,
                "items": [item_json(i) for i in self.items]}

    def save(self, out: str | Path) -> tuple[Path, Path]:
        """Write OUT (.json) and OUT with suffix .md; returns both paths."""
        out = Path(out).with_suffix(".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(json_safe(self.to_dict()), indent=1, allow_nan=False) + "\n")
        out.with_suffix(".md").write_text(self.markdown() + "\n")
        return out, out.with_suffix(".md")

    def markdown(self) -> str:
        return render(self)

    def _repr_markdown_(self) -> str:
        return self.markdown()


def pair_items(items: list[EvalItem], a: Side, b: Side) -> list[ItemPair]:
    return [pair_item(item, a, b, i) for i, item in enumerate(items)]


def pair_item(item: EvalItem, a: Side, b: Side, i: int) -> ItemPair:
    ca, cb = a.completions[i], b.completions[i]
    position = first_divergence(ca.token_ids, cb.token_ids)
    shared = min(len(ca.token_ids), len(cb.token_ids)) if position is None else position + 1
    shared = min(shared, len(ca.logprobs or []), len(cb.logprobs or []))
    kl = [topn_kl(_values(ca.logprobs[p]), _values(cb.logprobs[p])) for p in range(shared)]
    return ItemPair(item.id, item.gold, a.answers[i], b.answers[i], a.correct[i], b.correct[i], ca.text,
                    cb.text, len(ca.token_ids), len(cb.token_ids),
                    None if position is None else divergence(position, ca, cb), kl)


def divergence(position: int, a: CompletionOutput, b: CompletionOutput) -> Divergence:
    ta = a.token_ids[position] if position < len(a.token_ids) else None
    tb = b.token_ids[position] if position < len(b.token_ids) else None

    def logprobs_at(c: CompletionOutput) -> tuple[float | None, float | None]:
        entry = c.logprobs[position] if c.logprobs and position < len(c.logprobs) else {}
        return tuple(entry[t].logprob if t in entry else None for t in (ta, tb))

    def text(c: CompletionOutput, token: int | None) -> str | None:
        entry = c.logprobs[position] if c.logprobs and position < len(c.logprobs) else {}
        return entry[token].decoded_token if token in entry else None

    return Divergence(position, ta, tb, text(a, ta), text(b, tb), logprobs_at(a), logprobs_at(b))


def item_json(item: ItemPair) -> dict[str, Any]:
    """An item for the JSON report: its per-position KL summarised as mean, max and count."""
    fields = dataclasses.asdict(item)
    del fields["kl"]
    row = item.row()
    return {**fields, "identical": item.identical, "kl_mean": row["kl_mean"], "kl_max": row["kl_max"],
            "kl_positions": len(item.kl)}


def json_safe(value: Any) -> Any:
    """NaN (an empty mean) becomes null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _values(entry: dict[int, Logprob]) -> dict[int, float]:
    return {t: lp.logprob for t, lp in entry.items()}
