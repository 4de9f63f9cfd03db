"""CUDA graphs of a depth-batched loop pass (runner/depth_passes.py), per batch bucket: the layer stack over
every decode row, each at its own loop, and the exit gate where the model has one. What surrounds it stays
eager: the starting rows' embedding, prelude and initial states, the exit rules' decisions, copy-forward, the
coda, readout and sampling. A chained pass (runner/chain_graphs.py) captures this body and those steps in one
graph, over these same static buffers.

A row's loop is data, not shape: it reaches the graph as a slot offset (AttentionMetadata.slot_offsets, an
int32 device buffer), so one graph per bucket serves every mix of loops, and the Triton backend records its
decode kernel's per-row-slot variant. The inputs live in static buffers sized for the largest bucket, as
runner/cuda_graph.py's DecodeGraphs keep theirs: the rows' states, positions, a prelude's injection (Huginn),
the attention metadata and the slot offsets; a bucket's padding rows attend to one token of the scratch block,
at loop 0. Until capture_all runs (on CPU, in tests) `run` runs the same body over the same static buffers
eagerly, so the CPU suite runs the code that a capture records.
"""

from __future__ import annotations

from typing import Callable

import torch

from attention.base import AttentionBackend, AttentionMetadata, SharedKVMetadata
from model.looped import LoopedModel
from runner.cuda_graph import PADDING_PROMPT_LEN, batch_buckets, capture, collect_garbage


class PassGraphs:
    """Per batch bucket, one loop pass's layer stack over static buffers: `run` loads a pass's rows into them
    and replays the bucket's graph (or, before capture_all, runs its body eagerly). `replays` counts the
    replays, `passes` every pass run through the static buffers."""

    def __init__(self, model: LoopedModel, backend: AttentionBackend, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, device: torch.device,
                 shared_kv: tuple[int, int, int] | None = None) -> None:
        """shared_kv: (loops, num_layers, max generated pages per sequence) under kv_sharing="last"."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.buckets = batch_buckets(max_num_seqs)
        n = self.buckets[-1]
        dtype = model.dtype
        hidden_size = model.shape.hidden_size
        self.state = torch.zeros(n, hidden_size, dtype=dtype, device=device)  # each row's loop input
        self.injection = torch.zeros_like(self.state) if model.prelude is not None else None
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.output = torch.zeros_like(self.state)
        self.gate_logits = torch.zeros(n, dtype=dtype, device=device)  # stays 0 for a model without a gate
        self.slot_offsets = torch.zeros(n, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32,
                                       device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.shared_kv = shared_kv
        if shared_kv is not None:
            self.prompt_lens = torch.full((n,), PADDING_PROMPT_LEN, dtype=torch.int32, device=device)
            self.generated_block_tables = torch.full((n, shared_kv[2]), scratch_block, dtype=torch.int32,
                                                     device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.replays = self.passes = 0
        self.loads = 0  # rows written into the buffers by load (a chain resuming from them checks for none)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, num_rows: int) -> int | None:
        for bs in self.buckets:
            if bs >= num_rows:
                return bs
        return None

    def metadata(self, bs: int, context_lens: list[int], slot_offsets: list[int],
                 prompt_lens: list[int]) -> AttentionMetadata:
        """The bucket's metadata over the static buffers. The host lists are the pass's (with its padding
        rows) for an eager run; a capture's are placeholders, since a graph-mode backend reads the device
        tensors only (runner/cuda_graph.py: DecodeGraphs does the same)."""
        shared = None
        if self.shared_kv is not None:
            loops, layers, _ = self.shared_kv
            shared = SharedKVMetadata(self.prompt_lens[:bs], self.generated_block_tables[:bs], prompt_lens,
                                      loops, layers)
        return AttentionMetadata(self.query_start_loc[:bs + 1], self.context_lens[:bs],
                                 self.block_tables[:bs], self.slot_mapping[:bs], [1] * bs, context_lens,
                                 self.block_size, shared,
                                 slot_offsets=self.slot_offsets[:bs], slot_offsets_cpu=slot_offsets)

    def pass_body(self, bs: int, meta: AttentionMetadata) -> None:
        """The graph's body: the bucket's rows through loop 0's layer stack, each moved to its own loop's
        slots by the slot offsets, into the output buffer, and their exit gate logits into theirs."""
        model = self.model
        state = self.state[:bs]
        context = model.step_context(self.positions[:bs], state.dtype)
        if self.injection is not None:
            context.injection = self.injection[:bs]
        self.backend.prepare(meta)
        out = model.loop(state, context, 0, self.backend.forward)
        self.output[:bs].copy_(out)
        if model.exit_gate is not None:
            self.gate_logits[:bs].copy_(model.exit_gate(out))

    @torch.inference_mode()
    def capture_all(self, collect: Callable[[], None] = collect_garbage) -> None:
        """One graph per bucket, largest first (later graphs reuse its pool memory). Every row is a padding
        row while capturing: the warm-up before each capture, and the first replay after it (which uploads
        the graph, paid here rather than by a request's first pass), write the scratch block only."""
        stream = torch.cuda.Stream()
        for bs in reversed(self.buckets):
            meta = self.metadata(bs, [1] * bs, [0] * bs, [PADDING_PROMPT_LEN] * bs)
            graph = torch.cuda.CUDAGraph()
            self.backend.capture_begin(bs)
            try:
                capture(graph, lambda bs=bs, meta=meta: self.pass_body(bs, meta), self.pool, stream, collect)
            finally:
                self.backend.capture_end()
            graph.replay()
            self.graphs[bs] = graph
            if self.pool is None:
                self.pool = graph.pool()
        torch.cuda.synchronize()

    def run(self, states: torch.Tensor, injections: torch.Tensor | None, positions: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over the rows (at most the largest bucket): states [rows, H], each row's loop input;
        injections [rows, H] (a model with a prelude), its injection; positions [rows], its token's position;
        meta, the rows' attention metadata (one token each), with each row's loop as its slot offset
        (meta.slot_offsets, int32 on the device; the host lists, context_lens_cpu and slot_offsets_cpu, are
        read only before capture_all, when the body runs eagerly). Returns the loop's output [rows, H] and
        gate logits [rows] (zeros without a gate), fresh tensors of their own."""
        n = meta.num_rows
        bs = self.bucket_for(n)
        self.load(states, injections, positions, meta, bs)
        self.passes += 1
        if self.graphs:
            self.graphs[bs].replay()
            self.replays += 1
        else:
            pad = bs - n
            prompt_lens = [] if meta.shared_kv is None else meta.shared_kv.prompt_lens_cpu
            lengths, offsets = meta.context_lens_cpu + [1] * pad, meta.slot_offsets_cpu + [0] * pad
            self.pass_body(bs, self.metadata(bs, lengths, offsets, prompt_lens + [PADDING_PROMPT_LEN] * pad))
        return self.output[:n].clone(), self.gate_logits[:n].clone()

    def load(self, states: torch.Tensor, injections: torch.Tensor | None,
             positions: torch.Tensor, meta: AttentionMetadata, bs: int) -> None:
        """The pass's rows into the static buffers, and rows n..bs as padding rows (restored here in case a
        larger pass used them)."""
        n = meta.num_rows
        self.loads += 1
        self.state[:n].copy_(states)
        if self.injection is not None:
            self.injection[:n].copy_(injections)
        self.positions[:n].copy_(positions)
        self.slot_offsets[:n].copy_(meta.slot_offsets)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.shared_kv is not None:
            tables = meta.shared_kv.generated_block_tables
            self.prompt_lens[:n].copy_(meta.shared_kv.prompt_lens)
            self.generated_block_tables[:n, :tables.shape[1]].copy_(tables)
        if n == bs:
            return
        self.state[n:bs].zero_()
        if self.injection is not None:
            self.injection[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.slot_offsets[n:bs].zero_()
        self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
        self.context_lens[n:bs].fill_(1)
        self.block_tables[n:bs].fill_(self.scratch_block)
        if self.shared_kv is not None:
            self.prompt_lens[n:bs].fill_(PADDING_PROMPT_LEN)
            self.generated_block_tables[n:bs].fill_(self.scratch_block)
