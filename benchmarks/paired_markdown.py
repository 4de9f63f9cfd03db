"""The paired report as markdown: the headline table, the discordant items, the first divergences and the
ABBA timing table."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.paired_report import PairedReport

SHOWN = 20  # rows of each per-item table; the JSON has every item


def render(report: PairedReport) -> str:
    p, env, a, b = report.protocol, report.environment, report.a, report.b
    kl = report.kl
    loops = p["loops"] if p["loops"] is not None else "of the checkpoint"
    lines = [f"# Paired eval `{p['name']}`: A = `{a['label']}`, B = `{b['label']}`", "",
             f"{len(report.items)} items of `{p['task']}` (sha256 {p['task_sha256_used'][:12]}), "
             f"{p['shots']}-shot, at most {p['max_new_tokens']} new tokens, sampling {p['sampling']}, "
             f"answer rule {p['extract']}, loops {loops}.", "",
             f"Commit {env['commit']}, {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"torch CPU threads: {env['cpu_threads']}, {env['date']}.", "",
             "| | A | B |", "|---|---|---|",
             f"| config | `{a['label']}` | `{b['label']}` |",
             f"| accuracy | {a['accuracy']:.3f} ({a['correct']}/{a['items']}) | "
             f"{b['accuracy']:.3f} ({b['correct']}/{b['items']}) |",
             f"| loops run per generated token | {a['loops_per_token']:.2f} | {b['loops_per_token']:.2f} |",
             f"| output tokens | {a['output_tokens']} | {b['output_tokens']} |",
             f"| wall time of the logprob run (s) | {a['wall_s']:.1f} | {b['wall_s']:.1f} |", "",
             f"- **Delta** (B - A): {report.delta:+.3f}; exact McNemar p = {report.mcnemar_p:.3g} "
             f"(only A right: {len(report.only_a)}, only B right: {len(report.only_b)}).",
             f"- **Token identity**: {report.identity_rate:.3f} of items identical; "
             f"{report.token_identity_rate:.3f} of tokens before the first divergence.",
             f"- **KL(A || B)** over the shared prefix: mean {_num(kl['mean'])}, p99 {_num(kl['p99'])}, "
             f"max {_num(kl['max'])} nats over {kl['positions']} positions (top-{p['logprobs']} logprobs, "
             "coarse-grained: a lower bound, exact at N = vocabulary size)."]
    lines += _discordant(report) + _divergences(report) + _timing(report)
    if report.notes:
        lines += ["", "Notes:", *[f"- {note}" for note in report.notes]]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3g}"


def _discordant(report: PairedReport) -> list[str]:
    rows = [i for i in report.items if i.a_correct != i.b_correct]
    if not rows:
        return []
    lines = ["", f"## Items only one side got right ({len(rows)}; first {min(SHOWN, len(rows))})", "",
             "| id | gold | A answer | B answer | right |", "|---|---|---|---|---|"]
    for i in rows[:SHOWN]:
        lines.append(f"| {i.id} | {i.gold} | {i.a_answer} | {i.b_answer} | {'A' if i.a_correct else 'B'} |")
    return lines


def _divergences(report: PairedReport) -> list[str]:
    rows = [i for i in report.items if i.divergence is not None]
    if not rows:
        return []
    lines = ["", f"## First divergent token ({len(rows)} items; first {min(SHOWN, len(rows))})", "",
             "Logprobs of A's token / B's token under each side (blank: outside that side's top N).", "",
             "| id | position | A token | B token | A: lp(A tok) | A: lp(B tok) | B: lp(A tok) "
             "| B: lp(B tok) |",
             "|---|---|---|---|---|---|---|---|"]
    for i in rows[:SHOWN]:
        d = i.divergence
        cells = [_lp(v) for v in (*d.a_logprobs, *d.b_logprobs)]
        tokens = f"{_token(d.a_token, d.a_text)} | {_token(d.b_token, d.b_text)}"
        lines.append(f"| {i.id} | {d.position} | {tokens} | {' | '.join(cells)} |")
    return lines


def _token(token: int | None, text: str | None) -> str:
    if token is None:
        return "(ended)"
    return f"{token} `{text!r}`" if text is not None else str(token)


def _lp(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _timing(report: PairedReport) -> list[str]:
    t = report.timing
    if t is None:
        return []
    lines = ["", f"## ABBA timing ({t.order}, {t.prompts} prompts per pass, logprobs off)", "",
             "| pass | config | wall (s) | output tokens | tok/s | TPOT (ms) | TTFT (ms) |",
             "|---|---|---|---|---|---|---|"]
    for n, run in enumerate(t.passes, start=1):
        lines.append(f"| {n} | {run.label} | {run.wall_s:.2f} | {run.output_tokens} | {run.tok_s:.1f} | "
                     f"{run.tpot_ms:.2f} | {run.ttft_ms:.1f} |")
    lines += ["", f"Median B/A ratio over adjacent pairs: tok/s {t.tok_s_ratio:.3f}, "
              f"TPOT {t.tpot_ratio:.3f}."]
    return lines
