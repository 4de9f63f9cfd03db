"""Per-token exit criteria that compare a token's successive checked loops (docs/huginn.md §5): the official
Huginn code's kl, minp-kl, entropy-diff, argmax-stability, latent-diff and cosine, with its "auto"
thresholds, min_steps and check-every-n. They read only next-token logits or the loop state, which every
looped model has, so they are not Huginn's alone (early:Q reads Ouro's exit gate instead). Their names,
"auto" thresholds and check schedule are exit_policy.py's, where the engine's policy strings name them.

Everything here is a pure function over rows: an engine keeps one ExitMemory per criterion for its rows,
calls `check` at a checked loop with the rows' logits or states, and reads which rows exit. Nothing syncs
with the host and no shape depends on the data, so a check can run inside a captured graph.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from exit_policy import AUTO_THRESHOLDS, CRITERIA, READS_LOGITS, READS_STATE, ExitPolicy  # noqa: F401
INITIAL_ENTROPY = 100.0  # the official evaluator's entropy before the first check
MINP_RATIO = 0.1  # minp-kl: probabilities below this fraction of the top one become 1/V


@dataclasses.dataclass(frozen=True, slots=True)
class ExitMemory:
    """What a criterion carries from one checked loop to the next, per row: log-probs [R, V] (kl, minp-kl),
    entropy [R] (entropy-diff), the state [R, H] (latent-diff, cosine) or the argmax [R] (argmax-stability,
    with `run`, the checks it has held for)."""

    previous: torch.Tensor
    run: torch.Tensor | None = None


def kl_divergence(previous_log_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """KL(previous || current) per row, the official direction: F.kl_div with the previous checked loop's
    log-probs as the target, summed over the vocabulary. [R, V] each -> [R]."""
    return F.kl_div(log_probs, previous_log_probs, reduction="none", log_target=True).sum(dim=-1)


def minp_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """minp-kl's distribution: softmax, every probability below MINP_RATIO x the row's top one set to 1/V,
    renormalised; its log. [R, V] fp32 logits -> [R, V]."""
    probs = torch.softmax(logits, dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * MINP_RATIO
    probs = torch.where(probs < floor, 1.0 / logits.shape[-1], probs)
    return (probs / probs.sum(dim=-1, keepdim=True)).log()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits), with the official 1e-10 inside the log. [R, V] -> [R]."""
    probs = torch.softmax(logits, dim=-1)
    return -(probs * torch.log(probs + 1e-10)).sum(dim=-1)


def latent_diff(previous: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """||s_t - s_prev|| / ||s_t|| per row, in fp32 (the official code stays in the model dtype). [R, H]."""
    previous, state = previous.float(), state.float()
    return (state - previous).norm(dim=-1) / state.norm(dim=-1)


def cosine_distance(previous: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """1 - cos(s_t, s_prev) per row, in fp32. A zero previous state (init_scale 0, first check) gives NaN,
    which never exits, as in the official code. [R, H] -> [R]."""
    previous, state = previous.float(), state.float()
    return 1 - (state * previous).sum(dim=-1) / state.norm(dim=-1) / previous.norm(dim=-1)


def uniform_log_probs(rows: int, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """The distribution kl and minp-kl compare the first check against: uniform over the padded vocabulary."""
    return ((1.0 / vocab_size) * torch.ones(rows, vocab_size, device=device)).log()


def parse_threshold(kind: str, text: str) -> float:
    """A threshold as written after `kind:`: "auto" (AUTO_THRESHOLDS) or a number (a whole count for
    argmax-stability); ValueError naming the criterion otherwise."""
    if kind not in CRITERIA:
        raise ValueError(f"unknown exit criterion {kind!r}; choose one of {', '.join(CRITERIA)}")
    if text == "auto":
        return AUTO_THRESHOLDS[kind]
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"exit criterion {kind!r} needs a number or 'auto' after ':', "
                         f"got {text!r}") from None
    check_threshold(kind, value)
    return value


def check_threshold(kind: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"exit criterion {kind!r} needs a finite threshold > 0, got {value!r}")
    if kind == "argmax-stability" and value != int(value):
        raise ValueError(f"exit criterion 'argmax-stability' counts checks: its threshold must be a whole "
                         f"number, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ExitCriterion:
    """One criterion with its threshold and schedule. Loops are counted from 0 as the loop driver runs them:
    loop t is checked when t >= min_steps and (t - min_steps) % check_every == 0; a token that exits at
    loop t ran t + 1 loops. Exit when the value is below the threshold (argmax-stability: when the argmax
    has held for at least `threshold` checks after the first)."""

    kind: str
    threshold: float
    min_steps: int = 0
    check_every: int = 1

    def __post_init__(self) -> None:
        if self.kind not in CRITERIA:
            raise ValueError(f"unknown exit criterion {self.kind!r}; choose one of {', '.join(CRITERIA)}")
        check_threshold(self.kind, self.threshold)
        for name, least in (("min_steps", 0), ("check_every", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

    @classmethod
    def parse(cls, spec: str, min_steps: int = 0, check_every: int = 1) -> ExitCriterion:
        """"kl", "kl:auto" or "kl:5e-4" (and the other CRITERIA)."""
        kind, _, text = spec.partition(":")
        return cls(kind, parse_threshold(kind, text or "auto"), min_steps, check_every)

    @classmethod
    def from_policy(cls, policy: ExitPolicy) -> ExitCriterion:
        """The criterion of an exit policy string's (exit_policy.py: 'kl:5e-4,min=4,every=2')."""
        return cls(policy.kind, float(policy.value), policy.min_loops, policy.check_every)

    @property
    def policy(self) -> ExitPolicy:
        return ExitPolicy(self.kind, self.threshold, self.min_steps, self.check_every)

    @property
    def reads_logits(self) -> bool:
        """True: a check needs the token's next-token logits at that loop (a readout through the coda)."""
        return self.kind in READS_LOGITS

    def is_checked(self, loop: int) -> bool:
        return self.policy.is_checked(loop)

    def readout_loop(self, loops: int) -> int:
        """The loop whose readout a token that never exits takes, of `loops` (exit_policy.py: ExitPolicy.
        readout_loop; its continuous-compute state is still the last loop's)."""
        return self.policy.readout_loop(loops)

    def start(self, state: torch.Tensor, vocab_size: int) -> ExitMemory:
        """The memory before a token's first check; `state` [R, H] is its initial state s0."""
        rows, device = state.shape[0], state.device
        if self.kind in ("kl", "minp-kl"):
            return ExitMemory(uniform_log_probs(rows, vocab_size, device))
        if self.kind == "entropy-diff":
            return ExitMemory(torch.full((rows,), INITIAL_ENTROPY, device=device))
        if self.kind == "argmax-stability":
            return ExitMemory(torch.full((rows,), -1, dtype=torch.long, device=device),
                              torch.zeros(rows, dtype=torch.long, device=device))
        return ExitMemory(state.clone())

    def check(self, memory: ExitMemory, observed: torch.Tensor, active: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, ExitMemory]:
        """One checked loop: `observed` is the rows' fp32 logits [R, V] (reads_logits) or their raw loop
        state [R, H]. Returns (exits [R] bool, values [R], the new memory). Rows where `active` [R] is False
        (exited already, or not checked at this loop) keep their memory and never exit."""
        values, memory_after = exit_values(self.kind, memory, observed)
        exits = exit_fires(self.kind, values, self.threshold)
        if active is None:
            return exits, values, memory_after
        keep = active.view(-1, *([1] * (memory.previous.dim() - 1)))
        previous = torch.where(keep, memory_after.previous, memory.previous)
        run = None if memory.run is None else torch.where(active, memory_after.run, memory.run)
        return exits & active, values, ExitMemory(previous, run)


def exit_values(kind: str, memory: ExitMemory, observed: torch.Tensor) -> tuple[torch.Tensor, ExitMemory]:
    """The criterion's value per row at this checked loop, and the memory for the next check."""
    if kind in ("kl", "minp-kl"):
        log_probs = torch.log_softmax(observed, dim=-1) if kind == "kl" else minp_log_probs(observed)
        return kl_divergence(memory.previous, log_probs), ExitMemory(log_probs)
    if kind == "entropy-diff":
        current = entropy(observed)
        return (current - memory.previous).abs(), ExitMemory(current)
    if kind == "argmax-stability":
        argmax = observed.argmax(dim=-1)
        run = torch.where(argmax == memory.previous, memory.run + 1, torch.zeros_like(memory.run))
        return run, ExitMemory(argmax, run)
    measure = latent_diff if kind == "latent-diff" else cosine_distance
    return measure(memory.previous, observed), ExitMemory(observed.clone())


def exit_fires(kind: str, values: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """[R] bool: argmax-stability exits at a run of at least `threshold` checks, the others below it.
    threshold may be a per-row tensor (requests of one criterion with different thresholds)."""
    return values >= threshold if kind == "argmax-stability" else values < threshold
