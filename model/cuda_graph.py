"""The CUDA-graph capture wrapper: one graph per decode batch bucket for the whole T-loop step.

Every capture is preceded by gc.collect() (PyTorch 2.9+ no longer does this; a garbage cycle that
holds a CUDA graph or tensors of an earlier engine, collected mid-capture, frees device memory
and aborts the capture) and by a warm-up run outside capture on the same shapes, so no Triton
compile, autotune or allocator growth happens inside a capture. All graphs share one memory pool,
largest bucket first. Inputs live in static buffers that a replay fills in place.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from attention.base import AttentionBackend, AttentionMetadata
from model.ouro import LoopStates, OuroForCausalLM


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, capped at max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, min(max_num_seqs, 64) + 1, 8)) + list(range(80, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def collect_garbage() -> None:
    """Free what only the cycle collector can reach, then hand the allocator's cache back to the driver,
    so the capture's own allocations find room without a cudaFree mid-capture."""
    gc.collect()
    torch.cuda.empty_cache()


def capture(graph: torch.cuda.CUDAGraph, run: Callable[[], object], pool, stream: torch.cuda.Stream,
            collect: Callable[[], None] = collect_garbage) -> object:
    """Warm up `run` outside capture, collect garbage, then capture it into `graph`."""
    with torch.cuda.stream(stream):
        run()
    torch.cuda.synchronize()
    collect()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        result = run()
    return result


class DecodeGraphs:
    """Captured decode steps, one per bucket. Padding rows attend to one token of a scratch block."""

    def __init__(self, model: OuroForCausalLM, backend: AttentionBackend, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.buckets = batch_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block,
                                       dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, LoopStates] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc[:bs + 1],
                                 self.context_lens[:bs], self.block_tables[:bs],
                                 self.slot_mapping[:bs], [1] * bs, [1] * bs, self.block_size)

    def _step(self, bs: int) -> LoopStates:
        self.backend.prepare(self._meta(bs))
        return self.model(self.input_ids[:bs], self.positions[:bs], self.backend.forward)

    @torch.inference_mode()
    def capture_all(self, collect: Callable[[], None] = collect_garbage) -> None:
        stream = torch.cuda.Stream()
        for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool memory
            graph = torch.cuda.CUDAGraph()
            self.backend.capture_begin(bs)
            try:
                self.outputs[bs] = capture(graph, lambda bs=bs: self._step(bs), self.pool, stream, collect)
            finally:
                self.backend.capture_end()
            self.graphs[bs] = graph
            if self.pool is None:
                self.pool = graph.pool()
        torch.cuda.synchronize()

    def bucket_for(self, num_rows: int) -> int | None:
        for bs in self.buckets:
            if bs >= num_rows:
                return bs
        return None

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> LoopStates:
        """Run one decode step of meta.num_rows rows through the smallest bucket that holds them."""
        n = meta.num_rows
        bs = self.bucket_for(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # Padding rows (n..bs) keep the scratch defaults, restored here in case a larger batch used them.
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
        self.context_lens[n:bs].fill_(1)
        self.block_tables[n:bs].fill_(self.scratch_block)
        self.graphs[bs].replay()
        states = self.outputs[bs]
        return LoopStates(states.hidden[:, :n], states.gate_logits[:, :n])
