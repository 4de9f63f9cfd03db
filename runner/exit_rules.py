"""Exit decisions made on the device after a loop, per row, in buffers of their own: early:Q's exit CDF
(GateCDFRows) and an exit criterion's memory of the row's last checked loop (CriterionRows); and RuleExit,
the loop driver's hook that runs either over an eager step's rows (docs/looped_controls.md).

A per-loop CUDA graph (runner/cuda_graph.py: DecodeGraphs) runs a rule inside each loop's capture over its
bucket's rows, so a step reads one flag vector per loop and no shape depends on the data; an eager step runs
the same rule through the hook over its generated rows, reading the flags after each checked loop. A
criterion that reads logits reads them through the model's readout at a checked loop: for a model with a coda
(Huginn) the coda over the rows being checked, through the step's attention (a `Coda` the caller gives:
the graph's own attention over its bucket, or the eager executor's over the looping rows). Rows
[:n] of a rule's buffers are the live rows, in order; when rows stop, the survivors are compacted to the
front (`buffers`), as the graphs compact their static inputs.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from cache.kv_pool import KVPool
from cache.layout import KVLayout
from model.exit_criteria import ExitCriterion, ExitMemory
from model.looped import LoopedModel
from runner.loop_driver import LoopExecutor, LoopStats, StepInputs

# coda(state [n, H]) -> [n, H]: the model's coda over the n rows being checked, from their loop output,
# through the attention of the step that runs them (it stores those tokens' coda K/V: a later check or the
# step's final coda overwrites them, so the last write wins, as in the official cache)
Coda = Callable[[torch.Tensor], torch.Tensor]
# readout(state [n, H], coda) -> what a criterion observes of the rows (check_readout)
Readout = Callable[[torch.Tensor, Coda | None], torch.Tensor]


class ExitRule(Protocol):
    buffers: list[torch.Tensor]  # per-row state, [capacity, ...] each: compacted with the rows
    reads_gates: bool  # does decide read the exit gate's logits? (else callers may pass None)

    def decides(self, t: int) -> bool:
        """Does loop t decide exits? (Known on the host: a captured loop includes the decision or not.)"""

    def reset(self, n: int, state: torch.Tensor) -> None:
        """Rows [:n] start a step; state [n, H]: each row's initial state, loop 0's input."""

    def decide(self, n: int, state: torch.Tensor, gate_logits: torch.Tensor | None,
               coda: Coda | None = None) -> torch.Tensor:
        """After a loop that decides (decides(t)): which of rows [:n] stop, [n] bool; state [n, H] is each
        row's output of that loop; coda: the model's coda over these rows (None: the model has none). A row's
        decision reads its own memory and output only, not the loop's index, so rows after different loops
        may be decided in one call (depth batching)."""

    def decide_rows(self, rows: torch.Tensor, state: torch.Tensor, gate_logits: torch.Tensor | None
                    ) -> torch.Tensor:
        """decide over the first n = len(rows) rows, for those where `rows` ([n] bool) only: the others'
        memory stays as it was and they do not stop (a chained pass's rows whose loop does not decide)."""

    def reset_rows(self, rows: torch.Tensor, state: torch.Tensor) -> None:
        """reset, for the rows where `rows` ([n] bool) only."""


def keep_rows(buffers: list[torch.Tensor], before: list[torch.Tensor], keep: torch.Tensor) -> None:
    """Rows `keep` ([n] bool) of each buffer's first n go back to `before`'s (a rule's buffers may hold more
    rows than a pass has: a captured bucket's)."""
    n = keep.shape[0]
    for buffer, old in zip(buffers, before):
        head = buffer[:n]
        head.copy_(torch.where(keep.view(-1, *[1] * (buffer.dim() - 1)), old[:n], head))


def advance_exit_cdf(cdf: torch.Tensor, survival: torch.Tensor, gate_logits: torch.Tensor,
                     threshold: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One loop of rows' exit CDF, in place, float64, in the order of model/exit_policy.py: exit_pdf (so
    the decisions are the readout's): p = lambda * S, CDF += p, S *= 1 - lambda. Which rows reached
    threshold. rows ([n] bool): advance those only; elsewhere lambda is 0, and CDF + 0 * S and S * 1 leave
    a row's bits as they were (no copy of the buffers to restore)."""
    lam = torch.sigmoid(gate_logits.double())
    if rows is not None:
        lam = torch.where(rows, lam, 0.0)
    cdf.add_(lam * survival)
    survival.mul_(1.0 - lam)
    return cdf >= threshold


class GateCDFRows:
    """early:Q: each row's exit CDF, float64, advanced every loop but the last (advance_exit_cdf)."""

    reads_gates = True

    def __init__(self, threshold: float, loops: int, capacity: int, device: torch.device) -> None:
        self.threshold, self.loops = threshold, loops
        self.cdf = torch.zeros(capacity, dtype=torch.float64, device=device)
        self.survival = torch.ones(capacity, dtype=torch.float64, device=device)
        self.buffers = [self.cdf, self.survival]

    def decides(self, t: int) -> bool:
        return t < self.loops - 1

    def reset(self, n: int, state: torch.Tensor) -> None:
        self.cdf[:n].zero_()
        self.survival[:n].fill_(1.0)

    def decide(self, n: int, state: torch.Tensor, gate_logits: torch.Tensor | None,
               coda: Coda | None = None) -> torch.Tensor:
        return advance_exit_cdf(self.cdf[:n], self.survival[:n], gate_logits, self.threshold)

    def decide_rows(self, rows: torch.Tensor, state: torch.Tensor, gate_logits: torch.Tensor | None
                    ) -> torch.Tensor:
        n = rows.shape[0]
        return rows & advance_exit_cdf(self.cdf[:n], self.survival[:n], gate_logits, self.threshold, rows)

    def reset_rows(self, rows: torch.Tensor, state: torch.Tensor) -> None:
        n = rows.shape[0]
        self.cdf[:n].masked_fill_(rows, 0.0)
        self.survival[:n].masked_fill_(rows, 1.0)


def check_readout(model: LoopedModel, criterion: ExitCriterion) -> Readout:
    """What a criterion observes at a checked loop, from the loop's output state [n, H]: the state itself
    (latent-diff, cosine), or the next-token logits [n, V] in fp32, the model's readout of that state: for a
    model without a coda (Ouro) its head on the state; for a model with a coda (Huginn) its head on the
    coda's output, the coda run over the checked rows by the `coda` the caller gives (the official adaptive
    loop's readout at a check: its coda attends over the coda slots and writes the token's own there)."""
    if not criterion.reads_logits:
        return lambda state, coda: state
    if model.coda is None:
        return lambda state, coda: model.compute_logits(state).float()

    def through_coda(state: torch.Tensor, coda: Coda | None) -> torch.Tensor:
        if coda is None:
            raise ValueError(f"{criterion.kind} reads the next-token distribution through the model's coda; "
                             "the caller must give the coda of the checked rows")
        return model.compute_logits(coda(state)).float()

    return through_coda


class CriterionRows:
    """An exit criterion's memory (model/exit_criteria.py: ExitMemory) for up to `capacity` rows: the last
    checked loop's log-probs [capacity, V] (kl, minp-kl), entropy (entropy-diff), argmax and run length
    (argmax-stability) or state [capacity, H] (latent-diff, cosine), updated in place at each checked loop.
    `readout` (check_readout) turns a loop's output into what the criterion observes."""

    reads_gates = False

    def __init__(self, criterion: ExitCriterion, readout: Readout, loops: int,
                 capacity: int, hidden_size: int, vocab_size: int, device: torch.device) -> None:
        self.criterion, self.readout, self.loops, self.vocab_size = criterion, readout, loops, vocab_size
        kind = criterion.kind
        width = (vocab_size,) if kind in ("kl", "minp-kl") else (hidden_size,) if not criterion.reads_logits \
            else ()
        dtype = torch.long if kind == "argmax-stability" else torch.float32
        self.previous = torch.zeros(capacity, *width, dtype=dtype, device=device)
        self.run = torch.zeros(capacity, dtype=torch.long, device=device) if kind == "argmax-stability" \
            else None
        self.buffers = [self.previous] + ([self.run] if self.run is not None else [])

    def decides(self, t: int) -> bool:
        return t < self.loops - 1 and self.criterion.is_checked(t)

    def reset(self, n: int, state: torch.Tensor) -> None:
        self._store(n, self.criterion.start(state, self.vocab_size))

    def decide(self, n: int, state: torch.Tensor, gate_logits: torch.Tensor | None,
               coda: Coda | None = None) -> torch.Tensor:
        memory = ExitMemory(self.previous[:n], None if self.run is None else self.run[:n])
        exits, _, memory = self.criterion.check(memory, self.readout(state, coda))
        self._store(n, memory)
        return exits

    def decide_rows(self, rows: torch.Tensor, state: torch.Tensor, gate_logits: torch.Tensor | None
                    ) -> torch.Tensor:
        before = [buffer.clone() for buffer in self.buffers]
        fired = self.decide(rows.shape[0], state, gate_logits)
        keep_rows(self.buffers, before, ~rows)
        return rows & fired

    def reset_rows(self, rows: torch.Tensor, state: torch.Tensor) -> None:
        before = [buffer.clone() for buffer in self.buffers]
        self.reset(rows.shape[0], state)
        keep_rows(self.buffers, before, ~rows)

    def _store(self, n: int, memory: ExitMemory) -> None:
        self.previous[:n].copy_(memory.previous)
        if self.run is not None:
            self.run[:n].copy_(memory.run)


def compact(buffers: list[torch.Tensor], index: torch.Tensor) -> None:
    """Rows `index` [k] int64 of each buffer move to its first k rows, in order."""
    for buffer in buffers:
        buffer[:index.shape[0]] = buffer[index]


class RuleExit:
    """An exit rule as an after-loop hook (runner/loop_driver.py: LoopHook): a generated token stops at the
    first loop t < T-1 that the rule decides (ExitRule.decides) and where it fires (early:Q: the exit CDF
    reached Q; a criterion: the checked loops settled), and its deeper slots get what the KV layout says
    (paged: copies of its loop-t K/V; shared-last: nothing; docs/looped_controls.md). Prompt tokens run every
    loop and never exit. Under per-loop graphs the executor decides on the device and copies K/V forward
    itself (LoopOutput.reached); eagerly, a rule over the step's generated rows decides, compacted as rows
    stop, with one device-to-host read per deciding loop; a criterion reads a model's coda through the
    executor (LoopExecutor.readout) over the rows still looping.
    readout_loop: the loop a generated token that never stops reads out (the last, or a criterion's
    ExitCriterion.readout_loop)."""

    def __init__(self, rule_for: Callable[[int], ExitRule], readout_loop: int, layout: KVLayout, pool: KVPool,
                 stats: LoopStats) -> None:
        """rule_for(capacity): an ExitRule for that many rows (an eager step's generated rows)."""
        self.rule_for = rule_for
        self.decides = rule_for(1).decides
        self.readout_loop = readout_loop
        self.layout = layout
        self.pool = pool
        self.stats = stats

    def begin(self, inputs: StepInputs, executor: LoopExecutor) -> None:
        starts = inputs.meta.query_starts_cpu
        self.starts = starts
        self.looping = list(inputs.generated_rows)
        self.slot_mapping = inputs.meta.slot_mapping
        self.device = inputs.input_ids.device
        self.executor = executor
        self.rules = None
        initial_state = executor.initial_state
        if initial_state is not None and self.looping:  # eager: this step's rows, from their initial state
            self.rules = self.rule_for(len(self.looping))
            self.rules.reset(len(self.looping), initial_state[self._index([starts[r] for r in self.looping])])

    def after_loop(self, t: int, gate_logits: torch.Tensor | None, live: list[int],
                   reached: torch.Tensor | None, state: torch.Tensor) -> list[int]:
        self.stats.decode_loops += len(self.looping)
        if not self.looping or not self.decides(t):
            return []
        if reached is not None:  # decided on the device (generated rows only), which copied their K/V forward
            leaving = [row for row, hit in zip(live, reached.tolist()) if hit]
        else:
            leaving = self._decide(t, live, state, gate_logits)
        gone = set(leaving)
        self.looping = [row for row in self.looping if row not in gone]
        return leaving

    def _decide(self, t: int, live: list[int], state: torch.Tensor,
                gate_logits: torch.Tensor | None) -> list[int]:
        """Loop t's exits among the looping rows, from their tokens of `state` (the live rows' tokens, in
        order) and of `gate_logits` (every token's), and their K/V copied forward. A model's coda reads out
        the looping rows only."""
        offset, at = 0, {}
        for row in live:
            at[row] = offset
            offset += self.starts[row + 1] - self.starts[row]
        looping = state[self._index([at[r] for r in self.looping])]
        gates = None
        if gate_logits is not None and self.rules.reads_gates:
            gates = gate_logits[self._index([self.starts[r] for r in self.looping])]
        index_of = {row: i for i, row in enumerate(live)}
        among_live = [index_of[r] for r in self.looping]

        def coda(rows_state: torch.Tensor) -> torch.Tensor:
            return self.executor.readout(among_live, rows_state)

        flags = self.rules.decide(len(self.looping), looping, gates, coda).tolist()
        leaving = [row for row, hit in zip(self.looping, flags) if hit]
        if leaving:
            tokens = self._index([self.starts[r] for r in leaving]).to(self.slot_mapping.device)
            self.layout.copy_forward(self.pool, self.slot_mapping[tokens], t)
            compact(self.rules.buffers, self._index([i for i, hit in enumerate(flags) if not hit]))
        return leaving

    def _index(self, positions: list[int]) -> torch.Tensor:
        return torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
