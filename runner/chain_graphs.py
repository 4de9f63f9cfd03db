"""CUDA graphs of a chained loop pass (runner/pass_chains.py), per batch bucket: the layer stack over the
rows, each at its own loop (runner/pass_graphs.py's body), and the step to the next pass (the exit rule,
copy-forward, the head and argmax, a finished row's next token at loop 0) in one graph. A chained pass then
costs the host one replay. Run eagerly, the step between passes is about a hundred small tensor operations,
more host time than a pass's weight read at small batches: on an H100 at batch 1 an eager chain's pass took
1.8 ms where a loop of a full-depth step takes 1.2 ms.

The chain's rows live in static buffers sized for the largest bucket: the pass graphs' (the layer stack's
inputs: states, positions, slots, lengths, loops as slot offsets, block tables) and this object's (each
loop's output and gate, the exit rule's memory, the rows' loop, tokens finished, reservation, first position
and slot table, the record and its pass counter). A bucket's padding rows reserve nothing: they stay
inactive at loop 0 on the scratch slot. Until capture_all runs (on CPU, in tests) `run` runs the same body
eagerly over the same buffers, reading the host lists an eager attention backend needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from attention.base import AttentionMetadata
from runner.cuda_graph import capture, collect_garbage
from runner.depth_passes import PassRows
from runner.exit_rules import ExitRule
from runner.pass_chains import ChainRows, ChainSteps, LayerPass, PassChains
from runner.pass_graphs import PassGraphs


class ChainGraphs:
    """Per batch bucket, one chained pass over static buffers: `run` loads a chain's rows and runs its passes
    (a replay each once captured). rule: the engine's exit rule over the largest bucket (None: no exits);
    max_passes: the most passes a chain runs (EngineConfig.step_passes); columns: the slot table's width
    (the most positions a row reserves, plus the scratch slot's column)."""

    def __init__(self, chains: PassChains, graphs: PassGraphs, rule: ExitRule | None, max_passes: int,
                 columns: int) -> None:
        self.chains, self.graphs, self.rule = chains, graphs, rule
        n, device, model = graphs.buckets[-1], graphs.device, chains.model
        hidden_size = graphs.state.shape[1]
        self.hidden = torch.zeros(n, chains.loops, hidden_size, dtype=model.dtype, device=device)
        self.gates = torch.full((n, chains.loops), math.nan, dtype=model.dtype, device=device)
        self.loop, self.finished, self.first, self.limit, self.reserved = (
            torch.zeros(n, dtype=torch.int64, device=device) for _ in range(5))
        self.active = torch.zeros(n, dtype=torch.bool, device=device)
        self.table = torch.full((n, columns), chains.scratch_slot, dtype=torch.int64, device=device)
        self.record = torch.zeros(max_passes, 4, n, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.cuda_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def captured(self) -> bool:
        return bool(self.cuda_graphs)

    def fits(self, rows: int, columns: int, passes: int) -> bool:
        """Does a chain of these rows, slot table columns and passes fit the buffers?"""
        return (self.graphs.bucket_for(rows) is not None and columns <= self.table.shape[1]
                and passes <= self.record.shape[0])

    def run(self, chain: ChainRows, steps: ChainSteps, meta: AttentionMetadata, passes: int
            ) -> tuple[torch.Tensor, PassRows]:
        """The chain's passes over the static buffers: its record [passes, 4, n] (a view that the next chain
        rewrites) and its rows after the last pass (copies)."""
        n = chain.loop.shape[0]
        bs = self.graphs.bucket_for(n)
        self._load(chain, steps, meta, bs)
        for _ in range(passes):
            if self.cuda_graphs:
                self.cuda_graphs[bs].replay()
            else:
                self._body(bs, eager=True)
        memory = [] if self.rule is None else [buffer[:n].clone() for buffer in self.rule.buffers]
        after = PassRows(self.graphs.state[:n].clone(), None, self.hidden[:n].clone(), self.gates[:n].clone(),
                         memory)
        return self.record[:passes, :, :n], after

    def _load(self, chain: ChainRows, steps: ChainSteps, meta: AttentionMetadata, bs: int) -> None:
        """The chain's rows into the buffers, rows n..bs as padding rows, and the pass counter to 0."""
        n = chain.loop.shape[0]
        rows, offsets = chain.rows, self.chains.offset_of[chain.loop]
        at = dataclasses.replace(meta, slot_mapping=chain.slot, context_lens=(chain.position + 1).int(),
                                 slot_offsets=offsets)
        self.graphs.load(rows.state, None, chain.position, at, bs)
        self.hidden[:n].copy_(rows.hidden)
        self.gates[:n].copy_(rows.gates)
        for buffer, memory in zip([] if self.rule is None else self.rule.buffers, rows.memory):
            buffer[:n].copy_(memory)
        for buffer, values in ((self.loop, chain.loop), (self.finished, chain.finished),
                               (self.active, chain.active), (self.first, steps.first),
                               (self.limit, steps.limit), (self.reserved, steps.reserved)):
            buffer[:n].copy_(values)
        columns = steps.table.shape[1]
        self.table[:n, :columns].copy_(steps.table)
        self.table[:n, columns:].fill_(self.chains.scratch_slot)
        self._pad(n, bs)
        self.count.zero_()

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end of the chain's buffers as padding rows: inactive, reserving nothing."""
        for buffer in (self.loop, self.finished, self.first, self.reserved):
            buffer[start:end].zero_()
        self.active[start:end].fill_(False)
        self.limit[start:end].fill_(self.chains.loops)
        self.table[start:end].fill_(self.chains.scratch_slot)

    def _body(self, bs: int, eager: bool) -> None:
        """The graph's body: one pass and the step to the next over the bucket's rows (PassChains.step),
        whose next states, positions and slots go back into the pass graphs' inputs."""
        graphs = self.graphs
        rows = PassRows(graphs.state[:bs], None, self.hidden[:bs], self.gates[:bs], [])
        chain = ChainRows(rows, self.loop[:bs], self.finished[:bs], graphs.positions[:bs],
                          graphs.slot_mapping[:bs], self.active[:bs])
        steps = ChainSteps(self.first[:bs], self.limit[:bs], self.reserved[:bs], self.table[:bs], True)
        self.chains.step(chain, steps, self._layer(bs, eager), self.rule, self.record[:, :, :bs], self.count)
        graphs.state[:bs].copy_(rows.state)
        self.loop[:bs].copy_(chain.loop)
        self.active[:bs].copy_(chain.active)
        graphs.positions[:bs].copy_(chain.position)
        graphs.slot_mapping[:bs].copy_(chain.slot)

    def _layer(self, bs: int, eager: bool) -> LayerPass:
        """The pass graphs' body over the bucket (its inputs are the chain's rows: states, positions and
        slots in place; the lengths and loops written here); eager: with the host lists an eager attention
        backend reads (a capture's are placeholders)."""
        graphs = self.graphs

        def layer(state: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, offsets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            lengths = graphs.context_lens[:bs]
            lengths.copy_(positions + 1)
            graphs.slot_offsets[:bs].copy_(offsets)
            host = (lengths.tolist(), offsets.tolist()) if eager else ([1] * bs, [0] * bs)
            graphs.pass_body(bs, graphs.metadata(bs, *host, []))
            return graphs.output[:bs], graphs.gate_logits[:bs]

        return layer

    @torch.inference_mode()
    def capture_all(self, collect: Callable[[], None] = collect_garbage) -> None:
        """One graph per bucket, largest first, in the pass graphs' memory pool (captured before). Every row
        is a padding row while capturing, so the warm-up and the first replay write the scratch slot only."""
        graphs, backend = self.graphs, self.graphs.backend
        stream = torch.cuda.Stream()
        self._pad(0, self.loop.shape[0])
        for bs in reversed(graphs.buckets):
            self.count.zero_()
            graph = torch.cuda.CUDAGraph()
            backend.capture_begin(bs)
            try:
                capture(graph, lambda bs=bs: self._body(bs, eager=False), graphs.pool, stream, collect)
            finally:
                backend.capture_end()
            self.count.zero_()
            graph.replay()
            self.cuda_graphs[bs] = graph
        torch.cuda.synchronize()
