"""CUDA graphs of a chained loop pass (runner/pass_chains.py), per batch bucket: the layer stack over the
rows, each at its own loop (runner/pass_graphs.py's body), and the step to the next pass (the exit rule,
copy-forward, the head and argmax, a finished row's next token at loop 0) in one graph. A chained pass then
costs the host one replay, where run eagerly the step between passes is about a hundred small tensor
operations whose launches the host must keep ahead of the device; on CUDA (`fused`) the graph records the
chains' fused_step, whose bookkeeping after the head is one kernel (runner/chain_step_kernels.py). Measured
on an H100 at batch 1 and 512 tokens of context, chains of 16: a chained pass spans 1.45 ms of device time
with that kernel and 1.52 ms with the tensor step, against 1.31 ms a loop of the whole-step decode graph.

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
from runner.cuda_graph import batch_buckets, capture, collect_garbage
from runner.depth_passes import PassRows
from runner.exit_rules import ExitRule
from runner.pass_chains import ChainRows, ChainSteps, LayerPass, PassChains
from runner.pass_graphs import PassGraphs
from runner.speculative_chains import FIELDS, ChainOutcome, Reservations, SpeculativeChains


class BucketChains:
    """What plain and speculative chain graphs share: per bucket of rows, one captured graph of a subclass's
    `body(bs, eager)` (a pass and the step to the next over the first bs rows of the static buffers), the
    layer stack through the pass graphs' body (`layer`), and `passes`, which replays a bucket's graph (or,
    before capture_all, runs its body) so many times (`replays` counts the replays). Subclasses hold the
    chain's own buffers."""

    def __init__(self, graphs: PassGraphs, buckets: list[int], loops: int, dtype: torch.dtype) -> None:
        self.graphs, self.buckets = graphs, buckets
        self.cuda_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        n, device = buckets[-1], graphs.device
        # the rows' loop outputs and gates, next loop, tokens finished, and whether within their reservation
        self.hidden = torch.zeros(n, loops, graphs.state.shape[1], dtype=dtype, device=device)
        self.gates = torch.full((n, loops), math.nan, dtype=dtype, device=device)
        self.loop, self.finished = (torch.zeros(n, dtype=torch.int64, device=device) for _ in range(2))
        self.active = torch.zeros(n, dtype=torch.bool, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)  # the passes run since the load
        # the step to the next pass as one kernel (runner/chain_step_kernels.py) on CUDA; tests set it on CPU,
        # where Triton runs in the interpreter
        self.fused = device.type == "cuda"

    @property
    def captured(self) -> bool:
        return bool(self.cuda_graphs)

    def bucket_for(self, rows: int) -> int | None:
        return next((bs for bs in self.buckets if bs >= rows), None)

    def body(self, bs: int, eager: bool) -> None:
        raise NotImplementedError

    def pad_all(self) -> None:
        """Every row of the buffers a padding row (for the captures)."""
        self.pad(0, self.loop.shape[0])

    def pad(self, start: int, end: int) -> None:
        """Rows start..end of the buffers as padding rows, and the pass counter to 0."""
        raise NotImplementedError

    def passes(self, bs: int, passes: int) -> None:
        for _ in range(passes):
            if self.cuda_graphs:
                self.cuda_graphs[bs].replay()
                self.replays += 1
            else:
                self.body(bs, eager=True)

    def static_chain(self, bs: int) -> ChainRows:
        """The bucket's rows as a chain over the static buffers (states, positions and slots: the pass
        graphs' inputs)."""
        graphs = self.graphs
        rows = PassRows(graphs.state[:bs], None, self.hidden[:bs], self.gates[:bs], [])
        return ChainRows(rows, self.loop[:bs], self.finished[:bs], graphs.positions[:bs],
                         graphs.slot_mapping[:bs], self.active[:bs])

    def write_back(self, chain: ChainRows, bs: int) -> None:
        """What a step rebound (next states, positions, slots, loops, activity) into the static buffers (the
        rest it wrote in place)."""
        graphs = self.graphs
        graphs.state[:bs].copy_(chain.rows.state)
        graphs.positions[:bs].copy_(chain.position)
        graphs.slot_mapping[:bs].copy_(chain.slot)
        self.loop[:bs].copy_(chain.loop)
        self.active[:bs].copy_(chain.active)

    def load_rows(self, chain: ChainRows, meta: AttentionMetadata, offset_of: torch.Tensor, bs: int) -> None:
        """A chain's rows into the static buffers, rows n..bs of the pass graphs' as padding rows (the
        subclass pads its own, and zeroes the pass counter)."""
        n = chain.loop.shape[0]
        rows = chain.rows
        self.graphs.load(rows.state, None, chain.position, at_loops(chain, meta, offset_of), bs)
        for buffer, values in ((self.hidden, rows.hidden), (self.gates, rows.gates), (self.loop, chain.loop),
                               (self.finished, chain.finished), (self.active, chain.active)):
            buffer[:n].copy_(values)

    def after(self, n: int, memory: list[torch.Tensor]) -> PassRows:
        """The first n rows after the last pass, copied (the next chain rewrites the buffers)."""
        return PassRows(self.graphs.state[:n].clone(), None, self.hidden[:n].clone(), self.gates[:n].clone(),
                        [buffer[:n].clone() for buffer in memory])

    def layer(self, bs: int, eager: bool) -> LayerPass:
        """The pass graphs' body over the bucket (its inputs are the chain's rows: states, positions and
        slots in place; the lengths and loops written here); eager: with the host lists an eager attention
        backend reads (a capture's are placeholders)."""
        graphs = self.graphs

        def layer(state: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                  offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            lengths, at_loops = graphs.context_lens[:bs], graphs.slot_offsets[:bs]
            if offsets is not None:  # None: the step before wrote both (a fused step)
                lengths.copy_(positions + 1)
                at_loops.copy_(offsets)
            host = (lengths.tolist(), at_loops.tolist()) if eager else ([1] * bs, [0] * bs)
            graphs.pass_body(bs, graphs.metadata(bs, *host, []))
            return graphs.output[:bs], graphs.gate_logits[:bs]

        return layer

    @torch.inference_mode()
    def capture_all(self, collect: Callable[[], None] = collect_garbage) -> None:
        """One graph per bucket, largest first, in the pass graphs' memory pool (captured before). Every row
        is a padding row while capturing, so the warm-up and the first replay write the scratch slot only."""
        graphs, backend = self.graphs, self.graphs.backend
        stream = torch.cuda.Stream()
        graphs.loads += 1  # the captures rewrite the buffers: no chain resumes from them
        self.pad_all()
        for bs in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            backend.capture_begin(bs)
            try:
                capture(graph, lambda bs=bs: self.body(bs, eager=False), graphs.pool, stream, collect)
            finally:
                backend.capture_end()
            self.pad_all()
            graph.replay()
            self.cuda_graphs[bs] = graph
        torch.cuda.synchronize()


class ChainGraphs(BucketChains):
    """Plain chains (runner/pass_chains.py) per batch bucket over static buffers: `run` loads a chain's rows
    and runs its passes (a replay each once captured). rule: the engine's exit rule over the largest bucket
    (None: no exits); max_passes: the most passes a chain runs (EngineConfig.step_passes); columns: the slot
    table's width (the most positions a row reserves, plus the scratch slot's column)."""

    def __init__(self, chains: PassChains, graphs: PassGraphs, rule: ExitRule | None, max_passes: int,
                 columns: int) -> None:
        super().__init__(graphs, graphs.buckets, chains.loops, chains.model.dtype)
        self.chains, self.rule = chains, rule
        n, device = graphs.buckets[-1], graphs.device
        self.first, self.limit, self.reserved = (torch.zeros(n, dtype=torch.int64, device=device)
                                                 for _ in range(3))
        self.table = torch.full((n, columns), chains.scratch_slot, dtype=torch.int64, device=device)
        self.record = torch.zeros(max_passes, 4, n, dtype=torch.int64, device=device)

    def fits(self, rows: int, columns: int, passes: int) -> bool:
        """Does a chain of these rows, slot table columns and passes fit the buffers?"""
        return (self.bucket_for(rows) is not None and columns <= self.table.shape[1]
                and passes <= self.record.shape[0])

    def run(self, chain: ChainRows, steps: ChainSteps, meta: AttentionMetadata, passes: int
            ) -> tuple[torch.Tensor, PassRows]:
        """The chain's passes over the static buffers: its record [passes, 4, n] (a view that the next chain
        rewrites) and its rows after the last pass."""
        n = chain.loop.shape[0]
        bs = self.bucket_for(n)
        self.load_rows(chain, meta, self.chains.offset_of, bs)
        for buffer, memory in zip([] if self.rule is None else self.rule.buffers, chain.rows.memory):
            buffer[:n].copy_(memory)
        for buffer, values in ((self.first, steps.first), (self.limit, steps.limit),
                               (self.reserved, steps.reserved)):
            buffer[:n].copy_(values)
        columns = steps.table.shape[1]
        self.table[:n, :columns].copy_(steps.table)
        self.table[:n, columns:].fill_(self.chains.scratch_slot)
        self.pad(n, bs)
        self.passes(bs, passes)
        return self.record[:passes, :, :n], self.after(n, [] if self.rule is None else self.rule.buffers)

    def pad(self, start: int, end: int) -> None:
        """Rows start..end as padding rows: inactive at loop 0 on the scratch slot, reserving nothing."""
        for buffer in (self.loop, self.finished, self.first, self.reserved):
            buffer[start:end].zero_()
        self.active[start:end].fill_(False)
        self.limit[start:end].fill_(self.chains.loops)
        self.table[start:end].fill_(self.chains.scratch_slot)
        self.count.zero_()

    def body(self, bs: int, eager: bool) -> None:
        """One pass and the step to the next over the bucket's rows (PassChains.fused_step, or step)."""
        chain = self.static_chain(bs)
        steps = ChainSteps(self.first[:bs], self.limit[:bs], self.reserved[:bs], self.table[:bs], True)
        layer, record = self.layer(bs, eager), self.record[:, :, :bs]
        if self.fused:  # in place, the next pass's lengths and loops included
            inputs = (self.graphs.context_lens[:bs], self.graphs.slot_offsets[:bs])
            self.chains.fused_step(chain, steps, layer, self.rule, record, self.count, inputs)
            return
        self.chains.step(chain, steps, layer, self.rule, record, self.count)
        self.write_back(chain, bs)


class SpeculativeChainGraphs(BucketChains):
    """Pipelined speculation's chains (runner/speculative_chains.py) per bucket of requests, m = ceil(T/d)
    rows each, over static buffers: `run` loads a chain's rows, `resume` goes on from the last chain's.
    max_requests: the most requests a step decodes (max_num_seqs; buckets whose rows outgrow the pass graphs'
    are left out); max_passes, columns: as ChainGraphs'."""

    def __init__(self, chains: SpeculativeChains, graphs: PassGraphs, max_requests: int, max_passes: int,
                 columns: int) -> None:
        m = chains.m
        buckets = [b * m for b in batch_buckets(max_requests) if b * m <= graphs.buckets[-1]]
        super().__init__(graphs, buckets, chains.loops, chains.chains.model.dtype)
        self.chains = chains
        n, device = buckets[-1], graphs.device
        requests = n // m
        self.given = torch.zeros(n, dtype=torch.int64, device=device)  # the token each row started from
        self.limit = torch.full((n,), chains.loops, dtype=torch.int64, device=device)
        self.first, self.end = (torch.zeros(requests, dtype=torch.int64, device=device) for _ in range(2))
        self.table = torch.full((requests, columns), chains.chains.scratch_slot, dtype=torch.int64,
                                device=device)
        self.record = torch.zeros(max_passes, FIELDS, requests, dtype=torch.int64, device=device)
        self.served = torch.zeros(max_passes, dtype=torch.int64, device=device)

    def fits(self, requests: int, columns: int, passes: int) -> bool:
        return (self.bucket_for(requests * self.chains.m) is not None and columns <= self.table.shape[1]
                and passes <= self.record.shape[0])

    def run(self, chain: ChainRows, given: torch.Tensor, owners: Reservations, table: torch.Tensor,
            meta: AttentionMetadata, passes: int) -> ChainOutcome:
        """The chain's passes over the static buffers (SpeculativeChains._eager's outcome; the record and
        served counts are views that the next chain rewrites)."""
        n = chain.loop.shape[0]
        bs = self.bucket_for(n)
        self.load_rows(chain, meta, self.chains.chains.offset_of, bs)
        self.given[:n].copy_(given)
        self.reserve(owners, table)
        self.pad(n, bs)
        return self.outcome(n, bs, passes)

    def resume(self, owners: Reservations, table: torch.Tensor, block_tables: torch.Tensor, passes: int
               ) -> ChainOutcome:
        """The last chain's rows go on from where its passes left them in the buffers (the same requests,
        with the same tokens in flight: SpeculativeChains checks), under the step's new reservations: only
        the requests' first positions, reservation ends and slot tables, and their block tables [R, width]
        (which may have gained blocks) are written. The states, loops, positions, started tokens, slots, and
        the next pass's lengths and slot offsets are the last pass's: a token in flight lies within the last
        reservation, and its position's slot is the same in the new one."""
        m, requests = self.chains.m, owners.first.shape[0]
        n = requests * m
        self.reserve(owners, table)
        self.graphs.block_tables[:n, :block_tables.shape[1]].copy_(block_tables.repeat_interleave(m, 0))
        self.count.zero_()
        return self.outcome(n, self.bucket_for(n), passes)

    def reserve(self, owners: Reservations, table: torch.Tensor) -> None:
        """The requests' first positions, reservation ends and slot tables (padded with the scratch slot)."""
        requests, columns = owners.first.shape[0], table.shape[1]
        self.first[:requests].copy_(owners.first)
        self.end[:requests].copy_(owners.end)
        self.table[:requests, :columns].copy_(table)
        self.table[:requests, columns:].fill_(self.chains.chains.scratch_slot)

    def outcome(self, n: int, bs: int, passes: int) -> ChainOutcome:
        """The passes over the bucket, then the record, served counts, final (active, position, loop, token)
        of the first n rows, and their PassRows."""
        requests = n // self.chains.m
        self.served.zero_()
        self.passes(bs, passes)
        positions = self.graphs.positions[:n]
        final = torch.stack([self.active[:n].long(), positions, self.loop[:n], self.given[:n]])
        return self.record[:passes, :, :requests], self.served[:passes], final, self.after(n, [])

    def pad(self, start: int, end: int) -> None:
        """Rows start..end and their requests as padding: inactive, reserving nothing."""
        m = self.chains.m
        for buffer in (self.loop, self.finished, self.given):
            buffer[start:end].zero_()
        self.active[start:end].fill_(False)
        for buffer in (self.first, self.end):
            buffer[start // m:end // m].zero_()
        self.table[start // m:end // m].fill_(self.chains.chains.scratch_slot)
        self.count.zero_()

    def body(self, bs: int, eager: bool) -> None:
        """One pass and the step to the next over the bucket's requests (SpeculativeChains.fused_step, or
        step)."""
        requests = bs // self.chains.m
        chain = self.static_chain(bs)
        owners = Reservations(self.first[:requests], self.end[:requests])
        given, table, record = self.given[:bs], self.table[:requests], self.record[:, :, :requests]
        layer = self.layer(bs, eager)
        if self.fused:  # in place, the next pass's lengths and loops included
            inputs = (self.graphs.context_lens[:bs], self.graphs.slot_offsets[:bs])
            self.chains.fused_step(chain, given, owners, table, layer, record, self.served, self.count,
                                   inputs)
            return
        self.chains.step(chain, given, owners, table, self.limit[:bs], layer, record, self.served, self.count)
        self.write_back(chain, bs)


def at_loops(chain: ChainRows, meta: AttentionMetadata, offset_of: torch.Tensor) -> AttentionMetadata:
    """The step's metadata (its block tables) with the chain rows' slots, lengths and loops (slot offsets)."""
    return dataclasses.replace(meta, slot_mapping=chain.slot, context_lens=(chain.position + 1).int(),
                               slot_offsets=offset_of[chain.loop])
