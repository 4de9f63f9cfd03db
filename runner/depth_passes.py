"""Continuous depth batching (Engine(depth_batching=True)): a decode step is one loop pass, in which every
decode row runs its own next loop, so rows at different loops share one read of the loop's weights.

A row carries its token from pass to pass (MidToken: its loop, the state that loop starts from, and what its
readout and exit rule need of the loops before). In a pass the rows' states go through the loop's layer stack
once, as one call of loop 0 (model/looped.py: LoopedModel.loop), whose attention moves each row to its own
loop's slots (attention/base.py: AttentionMetadata.slot_offsets), so each row stores its K/V in, and reads the
earlier tokens' K/V from, its own (loop, layer) slots. A row starts its token at loop 0: its embedding (and a
prelude: the injection every loop of the token reads) and its initial state. After the pass each row's exit
is decided as in lockstep: its last loop ran (the engine's, or SamplingParams.loops), or the exit rule fired
(early:Q's exit CDF, an exit criterion; runner/exit_rules.py), each rule run over the rows that ran a loop it
decides at, with their carried memory. A row that finishes copies its K/V forward through the KV layout (as
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
from runner.loop_driver import LoopStats, StepInputs
from runner.pass_graphs import PassGraphs


@dataclasses.dataclass(slots=True)
class MidToken:
    """A generated token between loop passes. It belongs to its request's position `position` as long as the
    request was not preempted since (`preemptions`); a preempted request restarts the token at loop 0."""

    position: int
    preemptions: int
    loop: int  # the loop its next pass runs
    state: torch.Tensor  # [H]: that loop's input
    injection: torch.Tensor | None  # [H]: a prelude's output, which every loop of the token reads (Huginn)
    hidden: list[torch.Tensor]  # per loop run, its output [H]
    gates: list[torch.Tensor]  # per loop run, its exit gate logit [] (0 for a model without a gate)
    memory: list[torch.Tensor]  # its row of each exit rule buffer (ExitRule.buffers); [] without a rule
    first_pass: int  # LoopStats.decode_passes of the pass it started in

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
        model, meta = self.model, inputs.meta
        self.stats.decode_passes += 1
        self.stats.decode_loops += len(requests)
        starting = [i for i, mid in enumerate(carried) if mid is None]
        if positions is None:
            positions = [r.num_computed_tokens for r in requests]
        started = self._start(inputs, requests, positions, starting) if starting else {}
        rows = [mid if mid is not None else started[i] for i, mid in enumerate(carried)]
        states = [row.state for row in rows]
        injections = [row.injection for row in rows] if model.prelude is not None else None
        slot_map = model.slot_map
        offsets = [slot_map.slot(row.loop, 0) - slot_map.slot(0, 0) for row in rows]
        graphs = self.graphs
        if graphs is not None and graphs.bucket_for(len(rows)):
            h, gate = graphs.run(states, injections, inputs.positions, meta, offsets)
        else:
            h, gate = self._eager_pass(states, injections, inputs.positions, meta, offsets)
        # what a coda reads (an exit check's readout, the finished rows' readout)
        context = self._context(inputs.positions, h.dtype, injections) if model.coda is not None else None
        memory = [list(row.memory) for row in rows]
        done = {i for i, row in enumerate(rows) if row.loop == loops[i] - 1}
        done |= self._exits(rows, done, h, gate, memory, meta, context)
        finished = sorted(done)
        self._copy_forward([i for i in finished if rows[i].loop < self.loops - 1], rows, meta)
        self.stats.decode_tokens += len(finished)
        out = []
        for i, row in enumerate(rows):
            out.append(None if i in done else dataclasses.replace(
                row, loop=row.loop + 1, state=h[i], hidden=row.hidden + [h[i]], gates=row.gates + [gate[i]],
                memory=memory[i]))
        states = self._finished_states(finished, rows, h, gate, meta, context) if finished else None
        return PassResult(out, finished, [rows[i].loop + 1 for i in finished],
                          [self.stats.decode_passes - rows[i].first_pass + 1 for i in finished], states)

    def _context(self, positions: torch.Tensor, dtype: torch.dtype,
                 injections: list[torch.Tensor] | None) -> StepContext:
        context = self.model.step_context(positions, dtype)
        if injections is not None:
            context.injection = torch.stack(injections)
        return context

    def _eager_pass(self, states: list[torch.Tensor], injections: list[torch.Tensor] | None,
                    positions: torch.Tensor, meta: AttentionMetadata, offsets: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows through loop 0's layer stack, each at its own loop's slots (offsets): the loop's output
        and gate logits (zeros for a model without a gate)."""
        state = torch.stack(states)
        context = self._context(positions, state.dtype, injections)
        self.backend.prepare(dataclasses.replace(
            meta, slot_offsets=torch.tensor(offsets, dtype=torch.int32).to(state.device, non_blocking=True),
            slot_offsets_cpu=offsets))
        h = self.model.loop(state, context, 0, self.backend.forward)
        gate_of = self.model.exit_gate
        return h, gate_of(h) if gate_of is not None else h.new_zeros(h.shape[0])

    def _start(self, inputs: StepInputs, requests: list[Request], positions: list[int],
               starting: list[int]) -> dict[int, MidToken]:
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
        rule = self.exit_rule(len(starting))
        buffers = []
        if rule is not None:
            rule.reset(len(starting), state)
            buffers = rule.buffers
        passes = self.stats.decode_passes
        return {i: MidToken(positions[i], requests[i].num_preemptions, 0, state[j],
                            None if injection is None else injection[j], [], [],
                            [buffer[j].clone() for buffer in buffers], passes)
                for j, i in enumerate(starting)}

    def _exits(self, rows: list[MidToken], done: set[int], h: torch.Tensor, gate: torch.Tensor,
               memory: list[list[torch.Tensor]], meta: AttentionMetadata, context: StepContext | None
               ) -> set[int]:
        """The rows (not done) whose exit rule fires after the loop each ran; their memory updated in place.
        The rule runs once per loop among the rows, over the rows that ran it."""
        if self.decides is None:
            return set()
        deciding: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if i not in done and self.decides(row.loop):
                deciding.setdefault(row.loop, []).append(i)
        exits = set()
        for loop, group in sorted(deciding.items()):
            rule = self.exit_rule(len(group))
            for b, buffer in enumerate(rule.buffers):
                buffer[:len(group)] = torch.stack([memory[i][b] for i in group])
            index = torch.tensor(group, dtype=torch.int64, device=h.device)

            def coda(rows_state: torch.Tensor, group: list[int] = group) -> torch.Tensor:
                sub, tokens = meta.select(group)
                self.backend.prepare(sub)
                return self.model.coda(rows_state, context.select(tokens), self.backend.forward)

            flags = rule.decide(loop, len(group), h[index], gate[index],
                                coda if self.model.coda is not None else None).tolist()
            for j, i in enumerate(group):
                memory[i] = [buffer[j].clone() for buffer in rule.buffers]
                if flags[j]:
                    exits.add(i)
        return exits

    def _copy_forward(self, rows: list[int], mid: list[MidToken], meta: AttentionMetadata) -> None:
        """Rows that finished before the last loop: their K/V into the deeper slots, per the KV layout."""
        by_loop: dict[int, list[int]] = {}
        for i in rows:
            by_loop.setdefault(mid[i].loop, []).append(i)
        for loop, group in sorted(by_loop.items()):
            index = torch.tensor(group, dtype=torch.int64).to(meta.slot_mapping.device, non_blocking=True)
            self.layout.copy_forward(self.pool, meta.slot_mapping[index], loop)

    def _finished_states(self, finished: list[int], rows: list[MidToken], h: torch.Tensor, gate: torch.Tensor,
                         meta: AttentionMetadata, context: StepContext | None) -> LoopStates:
        """The finished rows' LoopStates, as lockstep gives them: loops not run repeat the last state and
        have NaN gates; a model's coda reads out each row's readout-loop state."""
        hidden, gates, last = [], [], []
        for i in finished:
            ran = rows[i].hidden + [h[i]]
            missing = self.loops - len(ran)
            hidden.append(torch.stack(ran + [h[i]] * missing))
            gates.append(torch.stack(rows[i].gates + [gate[i]] + [gate.new_tensor(math.nan)] * missing))
            last.append(h[i])
        states = LoopStates(torch.stack(hidden, dim=1), torch.stack(gates, dim=1))
        if self.model.coda is not None:
            sub, tokens = meta.select(finished)
            self.backend.prepare(sub)
            states.readout = self.model.coda(states.hidden[self.readout_loop], context.select(tokens),
                                             self.backend.forward)
        if self.keep_final:
            states.final = torch.stack(last)
        return states
