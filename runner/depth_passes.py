"""Continuous depth batching (Engine(depth_batching=True)): a decode step is one loop pass, in which every
decode row runs its own next loop, so rows at different loops share one read of the loop's weights.

A row carries its token from pass to pass (MidToken: its loop, the state that loop starts from, and what its
readout and exit rule need of the loops before). In a pass the rows' states go through the loop's layer stack
once, as one call of loop 0 (model/looped.py: LoopedModel.loop), whose attention moves each row to its own
loop's slots (attention/base.py: AttentionMetadata.slot_offsets), so each row stores its K/V in, and reads the
earlier tokens' K/V from, its own (loop, layer) slots. A row starts its token at loop 0: its embedding (and a
prelude: the injection every loop of the token reads) and its initial state. After the pass each row's exit
is decided as in lockstep: its last loop ran (the engine's, or SamplingParams.loops), or the exit rule fired
(early:Q's exit CDF, an exit criterion; runner/exit_rules.py), the rule run once over the rows that ran a loop
it decides at, with their carried memory. A row that finishes copies its K/V forward through the KV layout (as
lockstep's early exit does), reads out (a coda, then the head) and samples; its request's next token starts
at loop 0 in a later pass, once this one is appended. The finished rows' LoopStates are those lockstep gives
(loops not run repeat the last one's state, with NaN gates), so the runner reads them out and samples them
exactly as it does a lockstep step's.

On CUDA the layer stack and the exit gate (one call over every row) replay a graph captured per batch bucket
(runner/pass_graphs.py: PassGraphs, which DepthPasses.graphs holds); everything else here runs eagerly: the
starting rows' embedding, prelude and initial states, the exit rules' decisions, copy-forward, the coda and
the finished rows' LoopStates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from attention.base import AttentionBackend, AttentionMetadata
from cache.kv_pool import KVPool
from cache.layout import KVLayout
from model.looped import LoopedModel, LoopStates, StepContext
from request import Request
from runner.exit_rules import ExitRule
from runner.host_to_device import to_device, upload
from runner.loop_driver import LoopStats, StepInputs
from runner.pass_graphs import PassGraphs


@dataclasses.dataclass(slots=True)
class PassRows:
    """Per-row tensors of a set of rows between passes, one row per token: the loop input `state` [n, H], a
    prelude's `injection` [n, H] (Huginn; None without a prelude), each loop's output `hidden` [n, T, H] and
    exit gate logit `gates` [n, T] (0 for a model without a gate; loops not run yet hold zeros and NaN), and
    the exit rule's per-row buffers `memory` (ExitRule.buffers, [n, ...] each; [] without a rule). A pass
    gathers its rows out of these (a row's MidToken names its PassRows and index), so a pass costs the same
    few tensor operations whatever its row count. A PassRows lives while a MidToken names it: the last pass's,
    and an older one only while some of its rows wait unscheduled."""

    state: torch.Tensor
    injection: torch.Tensor | None
    hidden: torch.Tensor
    gates: torch.Tensor
    memory: list[torch.Tensor]


@dataclasses.dataclass(slots=True)
class MidToken:
    """A generated token between loop passes: row `index` of `rows`. It belongs to its request's position
    `position` as long as the request was not preempted since (`preemptions`); a preempted request restarts
    the token at loop 0."""

    position: int
    preemptions: int
    loop: int  # the loop its next pass runs
    first_pass: int  # LoopStats.decode_passes of the pass it started in
    rows: PassRows
    index: int

    @property
    def state(self) -> torch.Tensor:
        """[H]: the input of its next loop (the output of the last loop it ran)."""
        return self.rows.state[self.index]

    def continues(self, request: Request) -> bool:
        """Is this the token the request computes next, never preempted since it started?"""
        return self.position == request.num_computed_tokens and self.preemptions == request.num_preemptions


@dataclasses.dataclass(slots=True)
class PassResult:
    """One pass over the decode rows: per row, the MidToken it carries into the next pass (None where its
    token finished); the rows whose token finished, in order, with the loops each ran and the passes it
    spanned; and their LoopStates (hidden [T, F, H], gate logits [T, F], the coda's readout [F, H] for a
    model with one, final [F, H]: each one's last computed state, where the engine keeps warm starts)."""

    carried: list[MidToken | None]
    finished: list[int]
    loops_run: list[int]
    passes: list[int]
    states: LoopStates | None


class DepthPasses:
    """Runs loop passes over decode rows. exit_rule(n): a fresh exit rule over n rows (None: the engine's
    exit policy stops no token early); readout_loop: the loop whose state a coda reads out for a token that
    ran every loop (the exit hook's, runner/loop_driver.py: LoopHook.readout_loop); keep_final: keep each
    finished token's last state (a warm start's source)."""

    def __init__(self, model: LoopedModel, backend: AttentionBackend, layout: KVLayout, pool: KVPool,
                 exit_rule: Callable[[int], ExitRule | None], readout_loop: int, keep_final: bool,
                 stats: LoopStats) -> None:
        self.model, self.backend, self.layout, self.pool = model, backend, layout, pool
        self.exit_rule = exit_rule
        probe = exit_rule(1)
        self.decides = probe.decides if probe is not None else None  # does loop t decide exits?
        self.loops = model.slot_map.loops
        self.readout_loop = readout_loop
        self.keep_final = keep_final
        self.stats = stats
        # The layer stack over static buffers, captured per batch bucket on CUDA (runner/pass_graphs.py; the
        # runner sets it); None: eager calls
        self.graphs: PassGraphs | None = None

    @torch.inference_mode()
    def run(self, inputs: StepInputs, requests: list[Request], loops: list[int],
            carried: list[MidToken | None], positions: list[int] | None = None) -> PassResult:
        """One pass over these decode rows (inputs: their one token each, runner/model_runner.py: prepare);
        loops[i]: the loops row i's request runs; carried[i]: its token's MidToken, None to start the token
        at loop 0; positions[i]: row i's position (None: each request's num_computed_tokens; a request may
        fill several rows at other positions, runner/pipelined_speculation.py)."""
        meta, n = inputs.meta, len(requests)
        self.stats.decode_passes += 1
        self.stats.decode_loops += n
        passes = self.stats.decode_passes
        if positions is None:
            positions = [r.num_computed_tokens for r in requests]
        rows = self.pass_rows(inputs, carried)
        ran = [0 if mid is None else mid.loop for mid in carried]  # the loop each row runs now
        slot_map = self.model.slot_map
        offsets = [slot_map.slot(loop, 0) - slot_map.slot(0, 0) for loop in ran]
        at_loops = dataclasses.replace(meta, slot_offsets_cpu=offsets, slot_offsets=to_device(
            torch.tensor(offsets, dtype=torch.int32), meta.slot_mapping.device))
        h, gate = self.layer_pass(rows.state, rows.injection, inputs.positions, at_loops)
        loop_index = to_device(torch.tensor(ran, dtype=torch.int64), h.device)
        every = torch.arange(n, device=h.device)
        rows.hidden[every, loop_index] = h
        rows.gates[every, loop_index] = gate.to(rows.gates.dtype)
        after = PassRows(h, rows.injection, rows.hidden, rows.gates, rows.memory)
        # what a coda reads (an exit check's readout, the finished rows' readout)
        context = self._context(inputs.positions, h.dtype, rows.injection) if self.model.coda is not None \
            else None
        done = {i for i in range(n) if ran[i] == loops[i] - 1}
        done |= self._exits(ran, done, after, gate, meta, context)
        finished = sorted(done)
        self._copy_forward([i for i in finished if ran[i] < self.loops - 1], ran, meta)
        self.stats.decode_tokens += len(finished)
        out = [None if i in done else
               MidToken(positions[i], requests[i].num_preemptions if mid is None else mid.preemptions,
                        ran[i] + 1, passes if mid is None else mid.first_pass, after, i)
               for i, mid in enumerate(carried)]
        states = self._finished_states(finished, ran, after, meta, context) if finished else None
        first = [passes if carried[i] is None else carried[i].first_pass for i in finished]
        return PassResult(out, finished, [ran[i] + 1 for i in finished],
                          [passes - start + 1 for start in first], states)

    def pass_rows(self, inputs: StepInputs, carried: list[MidToken | None]) -> PassRows:
        """The rows of a pass, in order: row i continues carried[i], or starts its token at loop 0 where that
        is None (inputs: the rows' one token each)."""
        starting = [i for i, mid in enumerate(carried) if mid is None]
        fresh = self._start(inputs, starting) if starting else None
        seat = iter(range(len(starting)))
        where = [(fresh, next(seat)) if mid is None else (mid.rows, mid.index) for mid in carried]
        return self._gather(where, inputs.meta.slot_mapping.device)

    @staticmethod
    def _gather(where: list[tuple[PassRows, int]], device: torch.device) -> PassRows:
        """The pass's rows, in order, out of the PassRows they come from (row i: where[i]): fresh tensors,
        so a pass never writes those its MidTokens hold (a failed step leaves them as they were)."""
        sources: dict[int, int] = {}  # id of a PassRows -> its first row in the concatenation
        parts: list[PassRows] = []
        order = []
        for source, index in where:
            first = sources.get(id(source))
            if first is None:
                first = sources[id(source)] = sum(part.state.shape[0] for part in parts)
                parts.append(source)
            order.append(first + index)
        index = to_device(torch.tensor(order, dtype=torch.int64), device)

        def rows(field: list[torch.Tensor]) -> torch.Tensor:
            return (field[0] if len(field) == 1 else torch.cat(field))[index]

        return PassRows(rows([p.state for p in parts]),
                        None if parts[0].injection is None else rows([p.injection for p in parts]),
                        rows([p.hidden for p in parts]), rows([p.gates for p in parts]),
                        [rows([p.memory[b] for p in parts]) for b in range(len(parts[0].memory))])

    def _context(self, positions: torch.Tensor, dtype: torch.dtype, injection: torch.Tensor | None
                 ) -> StepContext:
        context = self.model.step_context(positions, dtype)
        if injection is not None:
            context.injection = injection
        return context

    def layer_pass(self, state: torch.Tensor, injection: torch.Tensor | None, positions: torch.Tensor,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows through loop 0's layer stack, each at its own loop's slots (meta.slot_offsets): the loop's
        output and gate logits (zeros for a model without a gate). A bucket's graph where one fits, else
        eagerly."""
        graphs = self.graphs
        if graphs is not None and graphs.bucket_for(meta.num_rows):
            return graphs.run(state, injection, positions, meta)
        context = self._context(positions, state.dtype, injection)
        self.backend.prepare(meta)
        h = self.model.loop(state, context, 0, self.backend.forward)
        gate_of = self.model.exit_gate
        return h, gate_of(h) if gate_of is not None else h.new_zeros(h.shape[0])

    def _start(self, inputs: StepInputs, starting: list[int]) -> PassRows:
        """The rows that start a token: loop 0's state (the embedding, a prelude's output, or the initial
        state the runner drew: inputs.hidden), a prelude's injection, and the exit rule's fresh memory."""
        model = self.model
        sub, tokens = inputs.meta.select(starting)
        given = None if inputs.hidden is None else inputs.hidden[tokens]
        injection = None
        if given is not None and model.prelude is None:
            state = given
        else:
            state = model.embed(inputs.input_ids[tokens])
        if model.prelude is not None:
            context = model.step_context(inputs.positions[tokens], state.dtype)
            self.backend.prepare(sub)
            state, context = model.prelude(state, context, self.backend.forward)
            injection = context.injection
            if given is not None:
                state = given
        n = len(starting)
        rule = self.exit_rule(n)
        if rule is not None:
            rule.reset(n, state)
        hidden = state.new_zeros((n, self.loops, state.shape[-1]), dtype=model.dtype)
        gates = state.new_full((n, self.loops), math.nan, dtype=model.dtype)
        return PassRows(state, injection, hidden, gates, [] if rule is None else list(rule.buffers))

    def _exits(self, ran: list[int], done: set[int], rows: PassRows, gate: torch.Tensor,
               meta: AttentionMetadata, context: StepContext | None) -> set[int]:
        """The rows (not done) whose exit rule fires after the loop each ran (ran[i]); their memory (in rows)
        updated in place. One call of the rule over every row whose loop decides (a decision reads a row's
        memory and output, not the loop's index); the flags come to the host in one read."""
        if self.decides is None:
            return set()
        deciding = [i for i, loop in enumerate(ran) if i not in done and self.decides(loop)]
        if not deciding:
            return set()
        n = len(deciding)
        index = to_device(torch.tensor(deciding, dtype=torch.int64), rows.state.device)
        rule = self.exit_rule(n)
        for buffer, memory in zip(rule.buffers, rows.memory):
            buffer[:n] = memory[index]

        def coda(rows_state: torch.Tensor) -> torch.Tensor:
            sub, tokens = meta.select(deciding)
            self.backend.prepare(sub)
            return self.model.coda(rows_state, context.select(tokens), self.backend.forward)

        flags = rule.decide(n, rows.state[index], gate[index] if rule.reads_gates else None,
                            coda if self.model.coda is not None else None)
        for buffer, memory in zip(rule.buffers, rows.memory):
            memory.index_copy_(0, index, buffer[:n])
        return {i for i, hit in zip(deciding, flags.tolist()) if hit}

    def _copy_forward(self, finished: list[int], ran: list[int], meta: AttentionMetadata) -> None:
        """Rows that finished before the last loop: their K/V into the deeper slots, per the KV layout."""
        by_loop: dict[int, list[int]] = {}
        for i in finished:
            by_loop.setdefault(ran[i], []).append(i)
        if not by_loop:
            return
        groups = sorted(by_loop.items())
        device = meta.slot_mapping.device
        for (loop, _), index in zip(groups, upload([group for _, group in groups], torch.int64, device)):
            self.layout.copy_forward(self.pool, meta.slot_mapping[index], loop)

    def _finished_states(self, finished: list[int], ran: list[int], rows: PassRows, meta: AttentionMetadata,
                         context: StepContext | None) -> LoopStates:
        """The finished rows' LoopStates, as lockstep gives them: loops not run repeat the last state and
        have NaN gates; a model's coda reads out each row's readout-loop state."""
        device = rows.state.device
        index, last = upload([finished, [ran[i] for i in finished]], torch.int64, device)
        state = rows.state[index]
        later = torch.arange(self.loops, device=device)[None, :] > last[:, None]  # [F, T]: loops not run
        hidden = torch.where(later[..., None], state[:, None, :], rows.hidden[index])
        gates = rows.gates[index].masked_fill(later, math.nan)
        states = LoopStates(hidden.transpose(0, 1).contiguous(), gates.transpose(0, 1).contiguous())
        if self.model.coda is not None:
            sub, tokens = meta.select(finished)
            self.backend.prepare(sub)
            states.readout = self.model.coda(states.hidden[self.readout_loop], context.select(tokens),
                                             self.backend.forward)
        if self.keep_final:
            states.final = state
        return states
