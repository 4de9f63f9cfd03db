"""The loop driver: the one function that runs a looped model's loops over a step's batch, whatever runs them
(eager calls, a captured whole step, per-loop graphs, a piecewise chain's capture).

`run_loops(executor, model, inputs, loops, hook)` runs loops `loops` (a range) through an executor, which
either runs each loop eagerly through the model's interface (EagerLoops; model/looped.py: LoopedModel) or
replays a captured graph of it (runner/cuda_graph.py), and keeps every sampling row's per-loop readout state
and gate logit. After each loop an optional hook sees the gate logits and the loop's output and may stop
rows: runner/exit_rules.py's RuleExit stops the generated tokens whose exit rule fires (early:Q's exit CDF
reached Q, an exit criterion's checked loops settled) and copies their K/V forward through the KV layout.
Without a hook every row runs every loop, with no host sync, so the whole call can itself be captured: into
one graph (a whole decode step), or into a chain of pieces split at each attention call (a step with prompt
tokens, runner/piecewise_graphs.py). Running loops 0..d-1, then loops d..T-1 from loop d-1's output
(StepInputs.hidden), gives bit for bit what running 0..T-1 does: each loop reads only its own slots' K/V and
the previous loop's output, so a draft of the first d loops is exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol

import torch

from attention.base import AttentionBackend, AttentionMetadata
from model.looped import Attention, LoopedModel, LoopStates


@dataclasses.dataclass(slots=True)
class StepInputs:
    """One step's batch as tensors, built once (runner/model_runner.py: ModelRunner.prepare)."""

    input_ids: torch.Tensor  # [N] int64, the new tokens of every row, row after row
    positions: torch.Tensor  # [N] int64
    # None only where the executor's attention needs no metadata (a piecewise chain's capture, a profile run)
    meta: AttentionMetadata | None
    # [R] int64: the tokens that read out (each sampling row's last). None: every token, only for a whole
    # step without a hook (a captured step graph), whose executor returns a fresh tensor per loop.
    readout: torch.Tensor | None
    generated_rows: list[int]  # rows whose one new token is a generated token: those a hook may stop
    reads_out_every_token: bool = False  # readout is 0..N-1, in order
    # [N, H]: the state the first loop starts from (the tokens' drawn or warm initial states, or a later
    # loop's input, e.g. to verify a draft of the first loops); None: the prelude's output, or the tokens'
    # embeddings for a model without a prelude. A model's prelude runs either way (it makes the injection).
    hidden: torch.Tensor | None = None
    # [W] int64: tokens whose last-loop output the step hands back (LoopStates.final), the source of the next
    # token's warm start; None: none
    keep_final: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclasses.dataclass(slots=True)
class LoopOutput:
    """What one loop over the live rows gives: h [live tokens, H], the loop's output state; and, where
    the executor computed them on the device already (a captured loop), the gate logits [live tokens] and
    which live rows' exit CDF reached the threshold ([live rows] bool), whose K/V the executor has then
    copied forward too."""

    h: torch.Tensor
    gate_logits: torch.Tensor | None = None
    reached: torch.Tensor | None = None


class LoopExecutor(Protocol):
    # True where run_loop's tensors are buffers that the next loop overwrites (a captured graph's outputs)
    reuses_outputs: bool
    # [N, H] once begin ran: the state loop 0 starts from (a hook's criterion may compare with it); None where
    # a captured loop makes it on the device, and decides the exits there too
    initial_state: torch.Tensor | None

    def begin(self, inputs: StepInputs) -> None:
        """Embed the step's tokens (or take inputs.hidden) and make the attention metadata current."""

    def run_loop(self, t: int) -> LoopOutput:
        """Loop t over the live rows."""

    def keep(self, rows: list[int]) -> None:
        """From the next loop on, run only these of the live rows (indices into the live rows, in order)."""

    def run_coda(self, state: torch.Tensor) -> torch.Tensor:
        """The model's coda over every token of the step (live or not), from `state`, every token's last-loop
        output [N, H]: the readout hidden [N, H]."""

    def readout(self, rows: list[int], state: torch.Tensor) -> torch.Tensor:
        """The model's coda over some live rows mid-step (indices into the live rows, in order), from
        `state`, their tokens' loop output [n, H]: their readout hidden [n, H], for an exit criterion's check.
        It stores those tokens' coda K/V, which the step's final coda (run_coda) overwrites. Only an executor
        that leaves exit decisions to the hook serves it (per-loop graphs run the coda inside the loop)."""


class LoopHook(Protocol):
    # The loop whose state a generated row that runs every loop reads out: the last, except under a criterion
    # whose last check comes before it (runner/exit_rules.py: RuleExit); a model's final coda reads it
    readout_loop: int

    def begin(self, inputs: StepInputs, executor: LoopExecutor) -> None:
        """A new step starts, run by `executor` (its initial_state: loop 0's input; its readout: the coda of
        some live rows, for a check)."""

    def after_loop(self, t: int, gate_logits: torch.Tensor, live: list[int],
                   reached: torch.Tensor | None, state: torch.Tensor) -> list[int]:
        """gate_logits [N]: every token's loop-t gate logit (NaN for tokens of rows no longer live); live: the
        batch rows that ran loop t; reached: the executor's own exit decisions for them, if it made them;
        state: loop t's output, the live rows' tokens in order. Returns the rows that stop now (their K/V
        already made whole)."""


class EagerLoops:
    """Each loop as plain calls into the model's interface, through the attention backend (prepared with the
    step's metadata), or through `attention` as is where there is no backend (a piecewise chain's capture
    splits itself at each call; a profile run stores nothing)."""

    reuses_outputs = False

    def __init__(self, model: LoopedModel, backend: AttentionBackend | None,
                 attention: Attention | None = None) -> None:
        if (backend is None) == (attention is None):
            raise ValueError("EagerLoops runs attention through a backend or a callable: pass one of them")
        self.model = model
        self.backend = backend
        self.attention = attention

    def begin(self, inputs: StepInputs) -> None:
        model = self.model
        # the embeddings: loop 0's state, or the prelude's input (which a given loop-0 state does not replace)
        state = inputs.hidden if inputs.hidden is not None and model.prelude is None else \
            model.embed(inputs.input_ids)
        self.context = model.step_context(inputs.positions, state.dtype)
        self.meta = self.step_meta = inputs.meta
        if self.backend is not None:
            self.backend.prepare(self.meta)
        if model.prelude is not None:
            state, self.context = model.prelude(state, self.context, self._attention())
        self.state = self.initial_state = inputs.hidden if inputs.hidden is not None else state
        self.step_context = self.context

    def _attention(self) -> Attention:
        return self.attention if self.backend is None else self.backend.forward

    def run_loop(self, t: int) -> LoopOutput:
        self.state = self.model.loop(self.state, self.context, t, self._attention())
        return LoopOutput(self.state)

    def keep(self, rows: list[int]) -> None:
        self.meta, tokens = self.meta.select(rows)
        self.state = self.state[tokens]
        self.context = self.context.select(tokens)
        self.backend.prepare(self.meta)

    def run_coda(self, state: torch.Tensor) -> torch.Tensor:
        if self.meta is not self.step_meta:  # rows stopped: the coda runs on every token again
            self.meta, self.context = self.step_meta, self.step_context
            self.backend.prepare(self.meta)
        return self.model.coda(state, self.context, self._attention())

    def readout(self, rows: list[int], state: torch.Tensor) -> torch.Tensor:
        meta, tokens = self.meta.select(rows)
        self.backend.prepare(meta)
        out = self.model.coda(state, self.context.select(tokens), self._attention())
        self.backend.prepare(self.meta)
        return out


def run_loops(executor: LoopExecutor, model: LoopedModel, inputs: StepInputs, loops: range,
              hook: LoopHook | None = None, read_gates: bool = True) -> LoopStates:
    """Per-loop states of the readout tokens: hidden [len(loops), R, H] and gate logits [len(loops), R] (None
    where the model has no exit gate, or read_gates is False: a piecewise chain's capture, whose replays
    compute them on their readout rows). A row a hook stopped repeats its last loop's hidden state in later
    loops, with NaN gate logits there. Where `loops` ends at the model's last loop, a model's coda runs on
    every token's last state (a stopped row's: the loop it stopped at; a generated row that ran every loop:
    the hook's readout_loop), and LoopStates.readout holds the readout tokens' coda outputs;
    LoopStates.final the last-loop states of inputs.keep_final."""
    executor.begin(inputs)
    gate_of = model.exit_gate if read_gates else None

    every_token = inputs.readout is None or inputs.reads_out_every_token

    def read(x: torch.Tensor, reused: bool) -> torch.Tensor:
        """The readout tokens' rows of a per-token tensor, as a tensor of their own (x itself, when x is
        fresh, not `reused` later, and every token reads out)."""
        if not every_token:
            return x[inputs.readout]
        return x.clone() if reused else x

    def coda_and_final(states: LoopStates, last: torch.Tensor, readout: torch.Tensor | None = None
                       ) -> LoopStates:
        """The coda over every token's last state `last` [N, H] where the run reaches the model's last loop,
        read at the readout tokens (from `readout` where given: the readout loop's states of the rows that
        ran every loop); the last states of inputs.keep_final."""
        if inputs.keep_final is not None:
            states.final = last[inputs.keep_final]
        if model.coda is not None and loops.stop == model.slot_map.loops:
            coda_in = last if readout is None else readout
            states.readout = read(executor.run_coda(coda_in), executor.reuses_outputs)
        return states

    hidden, gates = [], []
    if hook is None:
        last = None
        for t in loops:
            last = executor.run_loop(t).h
            out = read(last, executor.reuses_outputs)
            hidden.append(out)
            if gate_of is not None:
                gates.append(gate_of(out))
        return coda_and_final(LoopStates(torch.stack(hidden), torch.stack(gates) if gates else None), last)
    hook.begin(inputs, executor)
    rows = _LiveRows(inputs.meta.query_starts_cpu, inputs.input_ids.device)
    state = gate_state = None  # every token's latest loop output and gate, once some row has stopped
    # A coda model's generated rows that run every loop read out an earlier loop (a criterion's last check):
    # that loop's output of every token, of which the coda reads those rows'
    early_readout = model.coda is not None and bool(inputs.generated_rows) and \
        hook.readout_loop < loops.stop - 1
    readout = None
    for t in loops:
        out = executor.run_loop(t)
        h, gate = out.h, _loop_gate(out, gate_of)
        if rows.all_live:
            hidden.append(read(h, executor.reuses_outputs))
            gates.append(read(gate, executor.reuses_outputs and out.gate_logits is not None))
        else:  # state and gate_state change in the next loops
            state.index_copy_(0, rows.token_index, h)
            gate_state.fill_(math.nan).index_copy_(0, rows.token_index, gate)
            hidden.append(read(state, True))
            gates.append(read(gate_state, True))
        leaving = hook.after_loop(t, gate if rows.all_live else gate_state, rows.live, out.reached, h)
        if early_readout and t == hook.readout_loop:
            readout = (h if rows.all_live else state).clone()
        if leaving:
            if rows.all_live:  # before the executor compacts h: loop t's output of every token
                state, gate_state = h.clone(), gate.clone()
            kept = rows.drop(leaving)
            if not kept:
                break
            executor.keep(kept)
    last = h if rows.all_live else state
    for _ in range(len(loops) - len(hidden)):  # every row stopped early
        hidden.append(hidden[-1])
        gates.append(torch.full_like(gates[-1], math.nan))
    if readout is not None:  # generated rows: the readout loop's state, or where they stopped before it
        readout = _with_generated_rows(last, readout, inputs)
    return coda_and_final(LoopStates(torch.stack(hidden), torch.stack(gates)), last, readout)


def _loop_gate(out: LoopOutput, gate_of: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Every live token's gate logit after a loop: the executor's, else the model's gate on the loop's
    output; a model without a gate gets zeros, where stopped rows then get NaN as a gate's logits would."""
    if out.gate_logits is not None:
        return out.gate_logits
    if gate_of is not None:
        return gate_of(out.h)
    return out.h.new_zeros(out.h.shape[0])


def _with_generated_rows(last: torch.Tensor, readout: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    """Every token's `last` state [N, H], with the generated rows' tokens taken from `readout` [N, H]."""
    starts = inputs.meta.query_starts_cpu
    at = torch.tensor([starts[row] for row in inputs.generated_rows], dtype=torch.int64)
    at = at.to(last.device, non_blocking=True)
    return last.clone().index_copy_(0, at, readout[at])


class _LiveRows:
    """Which batch rows still loop, and where their tokens sit among the step's tokens."""

    def __init__(self, query_starts: list[int], device: torch.device) -> None:
        self.starts = query_starts
        self.live = list(range(len(query_starts) - 1))
        self.all_live = True
        self.device = device
        self.token_index: torch.Tensor | None = None

    def drop(self, rows: list[int]) -> list[int]:
        """Take rows out; the indices, among the rows live before, of those that stay."""
        gone = set(rows)
        kept = [i for i, row in enumerate(self.live) if row not in gone]
        self.live = [self.live[i] for i in kept]
        self.all_live = False
        tokens = [t for row in self.live for t in range(self.starts[row], self.starts[row + 1])]
        self.token_index = torch.tensor(tokens, dtype=torch.int64).to(self.device, non_blocking=True)
        return kept


@dataclasses.dataclass(slots=True)
class LoopStats:
    """Loops run by decode tokens (generated tokens fed back in), summed since the engine started; under
    depth batching (runner/depth_passes.py) also the loop passes that ran them, each one loop of every decode
    row of its step."""

    decode_tokens: int = 0
    decode_loops: int = 0
    decode_passes: int = 0

    @property
    def loops_per_token(self) -> float:
        return self.decode_loops / self.decode_tokens if self.decode_tokens else math.nan

    @property
    def loops_per_pass(self) -> float:
        """Decode rows per loop pass: how many loops one weight read served (depth batching)."""
        return self.decode_loops / self.decode_passes if self.decode_passes else math.nan
