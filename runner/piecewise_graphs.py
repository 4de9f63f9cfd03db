"""Piecewise CUDA graphs for steps with prompt tokens (prefill, or prefill beside decode rows), per token
bucket: everything the model does between two attention calls is one captured graph, and attention runs
eagerly between the replays, on the step's own metadata.

Why piecewise. A mixed step's attention depends on far more than its token count (how the tokens split
into rows, each row's cached prefix, which rows decode), so capturing it whole would need a graph per
composition. The work between attention calls (norms, projections, RoPE, the MLP) depends only on the
token count: padded to a bucket, it is the same kernels on the same buffers in every step. This is
vLLM's piecewise capture (its default for mixed batches), done here with the plain capture API instead of
a compiler pass: the loop driver runs the model's loops once per bucket under capture (runner/loop_driver.py:
run_loops, with an eager executor), and the attention callable it is handed copies q, k and v into static
buffers (the piece's last kernels), ends the piece's capture, begins the next one and returns the static
buffer that eager attention fills at replay time. A step whose model has S KV slots (T loops x L layers)
replays S + 1 pieces and makes S eager attention calls, in the slot map's order.

Only small steps are captured (up to `max_tokens`, 512 by default): there the host's launches cost more
than the GPU's work, and one eager step of 1,000+ launches is several times slower than the replay. A
step of thousands of tokens is compute-bound, its launches hide behind the GPU's work, and it runs eagerly
(vLLM caps its capture sizes the same way).

Exactness. Padding changes the row count of every projection; the per-row results are the same bits
where the GEMM's choice of kernel does not depend on the row count (tests/test_piecewise_graphs.py
checks tokens against eager steps on the GPU). Padding tokens are token 0 at position 0; they touch no
KV (attention runs on the real tokens only) and no real row reads them.

Every piece shares one graph memory pool: a chain's pieces replay in their capture order, chains one at a
time, and what a chain keeps past its replay (its loop outputs) stays allocated, so no other chain's
temporaries land on it. The garbage collector runs in full before each bucket's chain
(runner/cuda_graph.py: collect_garbage) and its young generation before every later piece, outside any
capture.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from attention.base import AttentionBackend
from model.looped import Attention, LoopedModel, LoopStates
from runner.cuda_graph import collect_garbage, side_stream_after_current
from runner.loop_driver import EagerLoops, StepInputs, run_loops


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then steps of 128, capped at max_tokens (which is always the last bucket)."""
    sizes = [b for b in (16, 32, 64) if b < max_tokens] + list(range(128, max_tokens + 1, 128))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sorted(set(sizes))


class PiecewiseGraphs:
    """Per token bucket, a chain of captured pieces; `run` replays the chain of the smallest bucket that
    holds a step, with eager attention between the pieces, and returns every loop's output of the step's
    tokens, [T, tokens, H], and the coda's output [tokens, H] where the model has one (views of graph-owned
    memory that the next run overwrites)."""

    def __init__(self, model: LoopedModel, backend: AttentionBackend, max_tokens: int,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.loops = model.slot_map.loops
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        n, shape = self.max_tokens, model.shape
        dtype = model.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        heads, kv_heads, head_dim = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        self.q = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attention_out = torch.zeros_like(self.q)
        self.initial = torch.zeros(n, shape.hidden_size, dtype=dtype, device=device) \
            if model.initial_state is not None else None
        self.chains: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.slots: list[int] = []  # the KV slot of the attention call after each piece but the last
        self.outputs: dict[int, LoopStates] = {}  # each bucket's loop (and coda) outputs, graph-owned
        self.pool = None

    def bucket_for(self, num_tokens: int) -> int | None:
        for size in self.buckets:
            if size >= num_tokens:
                return size
        return None

    # -- capture -------------------------------------------------------------------------------------

    def run_model(self, n: int, attention: Attention) -> LoopStates:
        """The model's loops over the first n static tokens, through the loop driver with `attention` as is
        (a capture's splitting callable): every loop's output [T, n, H] and the coda's (the gates are the
        replay's)."""
        initial = None if self.initial is None else self.initial[:n]
        inputs = StepInputs(self.input_ids[:n], self.positions[:n], None, None, [], hidden=initial)
        return run_loops(EagerLoops(self.model, None, attention), self.model, inputs, range(self.loops),
                         read_gates=False)

    def _stash(self, n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A piece's last kernels: q, k, v into the static buffers eager attention reads. Returns the static
        buffer the next piece reads attention's output from."""
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        self.v[:n].copy_(v)
        return self.attention_out[:n]

    @torch.inference_mode()
    def capture_all(self, collect: Callable[[], None] = collect_garbage) -> None:
        stream = torch.cuda.Stream()
        self.pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.buckets):  # largest first: later chains reuse its pool memory
            # the warm-up: compiles and allocator growth outside capture, after the last chain's replays
            with side_stream_after_current(stream):
                self.run_model(n, lambda q, k, v, slot, n=n: self._stash(n, q, k, v))
            torch.cuda.synchronize()
            collect()
            chain: list[torch.cuda.CUDAGraph] = []
            slots: list[int] = []

            def begin_piece() -> None:
                chain.append(torch.cuda.CUDAGraph())
                chain[-1].capture_begin(pool=self.pool)

            def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int,
                      n: int = n) -> torch.Tensor:
                out = self._stash(n, q, k, v)
                chain[-1].capture_end()
                slots.append(slot)
                gc.collect(0)
                begin_piece()
                return out

            with torch.cuda.stream(stream):
                begin_piece()
                try:
                    self.outputs[n] = self.run_model(n, split)
                finally:
                    chain[-1].capture_end()
            if self.slots and slots != self.slots:
                raise RuntimeError(f"the model called attention in another order at {n} tokens")
            self.slots, self.chains[n] = slots, chain
            for piece in chain:  # a first replay uploads the graph: paid here, not by a request's first step
                piece.replay()  # (without attention between: the pieces touch no KV, only their buffers)
        torch.cuda.synchronize()

    # -- replay --------------------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            initial: torch.Tensor | None = None) -> LoopStates:
        """Every loop's output of the step's tokens [T, n, H] and the coda's [n, H] (None: no coda), no
        gates. initial [n, H]: the tokens' initial states, for a model that has them (None: zeros). The
        attention backend must be prepared with the step's metadata."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if self.initial is not None:
            if initial is None:
                self.initial[:n].zero_()
            else:
                self.initial[:n].copy_(initial)
        if n < bucket:  # padding: token 0 at position 0 (the buffers may hold a larger step's tokens)
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            if self.initial is not None:
                self.initial[n:bucket].zero_()
        q, k, v, out = self.q[:n], self.k[:n], self.v[:n], self.attention_out[:n]
        chain, forward = self.chains[bucket], self.backend.forward
        for piece, slot in zip(chain, self.slots):
            piece.replay()
            out.copy_(forward(q, k, v, slot))
        chain[-1].replay()
        states = self.outputs[bucket]
        return LoopStates(states.hidden[:, :n], None, None if states.readout is None else states.readout[:n])
