"""The CUDA-graph capture wrapper, and the captured decode graphs: per batch bucket, the whole T-loop step,
or each loop alone (with the model's prelude and coda, where it has them, as graphs of their own).

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

from attention.base import AttentionBackend, AttentionMetadata, SharedKVMetadata
from model.looped import LoopedModel, LoopStates, StepContext
from runner.exit_rules import ExitRule, compact
from runner.loop_driver import EagerLoops, LoopOutput, StepInputs, run_loops

# DecodeGraphs.graphs keys besides loops: the whole step (mode "step"), a loop-mode prelude and coda
WHOLE_STEP, PRELUDE, CODA = -1, -2, -3

# A padding row's prompt length under kv_sharing="last": longer than any context, so it has no generated
# tokens and reads only the scratch block.
PADDING_PROMPT_LEN = 1 << 30


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


def side_stream_after_current(stream: torch.cuda.Stream):
    """`stream` as the current stream, its work ordered after everything queued on the stream current now.
    A capture's warm-up runs on a side stream; without the order it would overlap a graph just replayed on
    the main stream, and two launches of the skinny GEMM at once share its split-K tickets
    (model/kernels/gemv.py), which then stay off by one for every later launch in the process."""
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream)


def capture(graph: torch.cuda.CUDAGraph, run: Callable[[], object], pool, stream: torch.cuda.Stream,
            collect: Callable[[], None] = collect_garbage) -> object:
    """Warm up `run` outside capture, collect garbage, then capture it into `graph`. The warm-up runs on
    `stream` once the current stream's work is done (side_stream_after_current)."""
    with side_stream_after_current(stream):
        run()
    torch.cuda.synchronize()
    collect()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        result = run()
    return result


class DecodeGraphs:
    """Captured decode steps, per batch bucket: either whole steps (mode "step", every loop in one graph) or
    single loops (mode "loop", one graph per (bucket, loop)), so that a step whose rows stop looping early
    replays only the loops it needs, on rows compacted into a smaller bucket. In loop mode this object is
    the loop driver's executor (runner/loop_driver.py: LoopExecutor).

    Inputs live in static buffers sized for the largest bucket; each bucket's graphs read their first rows.
    Padding rows attend to one token of a scratch block (under kv_sharing="last", they have no generated
    tokens; over a KVarN pool, their one token is a row of a scratch side block)."""

    reuses_outputs = True  # a loop's hidden and gate outputs are static buffers that the next replay rewrites
    initial_state = None  # loop 0's graph embeds the tokens, and the graphs decide exits themselves

    def __init__(self, model: LoopedModel, backend: AttentionBackend, mode: str, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int, device: torch.device,
                 shared_kv: tuple[int, int, int] | None = None, exit_rule: ExitRule | None = None,
                 copy_forward: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None,
                 scratch_side_block: int | None = None) -> None:
        """shared_kv: (loops, num_layers, max generated pages per sequence) under kv_sharing="last".
        exit_rule (mode "loop"; runner/exit_rules.py): early:Q's exit CDF or an exit criterion's memory,
        with buffers for max_num_seqs rows; each loop's graph where the rule decides then also marks the
        generated rows that stop, so that the host reads one small flag vector.
        copy_forward(slots, mask, loop): the KV layout's copy-forward of the rows where mask; each loop's
        graph then copies the K/V of the rows that stop forward itself, masked on the device.
        scratch_side_block: a KVarN pool's side block that no request holds; the rows then carry side tables
        (AttentionMetadata.side_tables), and a padding row's side table points at this block."""
        if mode not in ("step", "loop"):
            raise ValueError(f"DecodeGraphs mode must be 'step' or 'loop', got {mode!r}")
        self.model = model
        self.backend = backend
        self.mode = mode
        self.loops = model.slot_map.loops
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.buckets = batch_buckets(max_num_seqs)
        n = self.buckets[-1]
        dtype = model.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, model.shape.hidden_size, dtype=dtype, device=device)
        # loop mode, a model with a prelude: what every loop's graph reads besides the state (the prelude
        # graph writes it); with a coda: the coda graph's output
        self.injection = torch.zeros_like(self.hidden) if model.prelude is not None else None
        self.coda_out = torch.zeros_like(self.hidden) if model.coda is not None else None
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
        self.scratch_side_block = scratch_side_block
        self.side_tables = None if scratch_side_block is None else torch.full(
            (n, max_blocks_per_seq), scratch_side_block, dtype=torch.int32, device=device)
        self.exit_rule = exit_rule
        self.copy_forward = copy_forward
        self.gate_logits = torch.zeros(n, dtype=dtype, device=device)
        self.may_exit = torch.zeros(n, dtype=torch.bool, device=device)  # rows of generated tokens
        self.reached = torch.zeros(n, dtype=torch.bool, device=device)
        # (bucket, loop; WHOLE_STEP, PRELUDE or CODA)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, LoopStates] = {}  # mode "step": each bucket's graph-owned states
        self.pool = None
        self.rows = self.bucket = 0
        self.views = self.hidden[:0], self.gate_logits[:0], self.reached[:0]

    def _meta(self, bs: int) -> AttentionMetadata:
        shared = None
        if self.shared_kv is not None:
            loops, layers, _ = self.shared_kv
            shared = SharedKVMetadata(self.prompt_lens[:bs], self.generated_block_tables[:bs],
                                      [PADDING_PROMPT_LEN] * bs, loops, layers)
        side_tables = None if self.side_tables is None else self.side_tables[:bs]
        return AttentionMetadata(self.query_start_loc[:bs + 1], self.context_lens[:bs],
                                 self.block_tables[:bs], self.slot_mapping[:bs], [1] * bs, [1] * bs,
                                 self.block_size, shared, side_tables=side_tables)

    def _inputs(self, bs: int) -> StepInputs:
        """A whole step's inputs: every row reads out (the runner picks the sampling rows afterwards). A
        model that starts loop 0 from a state of its own reads it from the static hidden buffer."""
        hidden = self.hidden[:bs] if self.model.initial_state is not None else None
        return StepInputs(self.input_ids[:bs], self.positions[:bs], self._meta(bs), None, list(range(bs)),
                          hidden=hidden)

    def _context(self, bs: int, dtype: torch.dtype) -> StepContext:
        context = self.model.step_context(self.positions[:bs], dtype)
        if self.injection is not None:
            context.injection = self.injection[:bs]
        return context

    def _prelude(self, bs: int) -> None:
        """The prelude graph's body: the tokens' embeddings through the prelude, its loop-0 state into the
        hidden buffer and its injection into the injection buffer."""
        model = self.model
        x = model.embed(self.input_ids[:bs])
        self.backend.prepare(self._meta(bs))
        state, context = model.prelude(x, model.step_context(self.positions[:bs], x.dtype),
                                       self.backend.forward)
        self.hidden[:bs].copy_(state)
        self.injection[:bs].copy_(context.injection)

    def _coda(self, bs: int) -> None:
        """The coda graph's body: the coda of the hidden buffer's states into coda_out."""
        h = self.hidden[:bs]
        self.backend.prepare(self._meta(bs))
        self.coda_out[:bs].copy_(self.model.coda(h, self._context(bs, h.dtype), self.backend.forward))

    def _step(self, bs: int) -> LoopStates:
        executor = EagerLoops(self.model, self.backend)
        return run_loops(executor, self.model, self._inputs(bs), range(self.loops))

    def _loop(self, bs: int, t: int) -> None:
        """The body of loop t's graph: loop 0's embeds the step's tokens; each reads the state of the
        static buffer and leaves its output there (the next loop's input). A loop where an exit criterion
        that reads logits decides also runs the readout of the bucket's rows: for a model with a coda, the
        coda (storing their coda K/V, which the step's coda graph rewrites at the end) and the head."""
        model, rule = self.model, self.exit_rule
        h = self.hidden[:bs]
        if t == 0:
            if model.prelude is None:  # else the prelude graph (or the caller) has filled h
                h.copy_(model.embed(self.input_ids[:bs]))
            if rule is not None:  # a new step's exit CDF or criterion memory, reset on the device
                rule.reset(bs, h)
        context = self._context(bs, h.dtype)
        self.backend.prepare(self._meta(bs))
        out = model.loop(h, context, t, self.backend.forward)
        h.copy_(out)
        gate = None
        if model.exit_gate is not None:
            gate = model.exit_gate(out)
            self.gate_logits[:bs].copy_(gate)
        if rule is not None and rule.decides(t):
            # a criterion's readout of a coda model: the coda over the bucket's rows, inside this graph
            coda = None if model.coda is None else \
                (lambda state: model.coda(state, context, self.backend.forward))
            exits = rule.decide(bs, out, gate, coda)
            torch.logical_and(exits, self.may_exit[:bs], out=self.reached[:bs])
            if self.copy_forward is not None:
                self.copy_forward(self.slot_mapping[:bs], self.reached[:bs], t)

    @torch.inference_mode()
    def capture_all(self, collect: Callable[[], None] = collect_garbage) -> None:
        stream = torch.cuda.Stream()
        for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool memory
            work = [(WHOLE_STEP, lambda bs=bs: self._step(bs))] if self.mode == "step" else \
                [(t, lambda bs=bs, t=t: self._loop(bs, t)) for t in range(self.loops)]
            if self.mode == "loop" and self.injection is not None:
                work.insert(0, (PRELUDE, lambda bs=bs: self._prelude(bs)))
            if self.mode == "loop" and self.coda_out is not None:
                work.append((CODA, lambda bs=bs: self._coda(bs)))
            for t, run in work:
                graph = torch.cuda.CUDAGraph()
                self.backend.capture_begin(bs)
                try:
                    result = capture(graph, run, self.pool, stream, collect)
                finally:
                    self.backend.capture_end()
                if t == WHOLE_STEP:
                    self.outputs[bs] = result
                self.graphs[bs, t] = graph
                if self.pool is None:
                    self.pool = graph.pool()
        torch.cuda.synchronize()

    def bucket_for(self, num_rows: int) -> int | None:
        for bs in self.buckets:
            if bs >= num_rows:
                return bs
        return None

    def replay_step(self, inputs: StepInputs) -> LoopStates:
        """Mode "step": one decode step of every row through the smallest bucket that holds them."""
        self.begin(inputs)
        self.graphs[self.bucket, WHOLE_STEP].replay()
        states = self.outputs[self.bucket]
        rows = self.rows
        return LoopStates(states.hidden[:, :rows],
                          None if states.gate_logits is None else states.gate_logits[:, :rows],
                          None if states.readout is None else states.readout[:rows])

    # -- the loop driver's executor (mode "loop") ------------------------------------------------------

    def begin(self, inputs: StepInputs) -> None:
        meta = inputs.meta
        n = meta.num_rows
        own_state = self.model.initial_state is not None
        if inputs.hidden is not None and self.mode == "step" and not own_state:
            raise ValueError("a whole-step graph starts from the embeddings; run later loops in loop mode")
        self.inputs = inputs
        self._load(inputs)
        if self.injection is not None and self.mode == "loop":
            self.graphs[self.bucket, PRELUDE].replay()
        if inputs.hidden is not None:  # the tokens' own initial states, or a later loop's input
            self.hidden[:n].copy_(inputs.hidden)
            if self.exit_rule is not None:  # where loop 0's graph, which resets the rule, does not run
                self.exit_rule.reset(n, self.hidden[:n])
        elif own_state and self.mode == "step":
            self.hidden[:n].zero_()

    def _load(self, inputs: StepInputs) -> None:
        """The step's tokens and metadata into the static buffers, and the bucket's padding rows."""
        meta = inputs.meta
        n = meta.num_rows
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.side_tables is not None:
            self.side_tables[:n, :meta.side_tables.shape[1]].copy_(meta.side_tables)
        if meta.shared_kv is not None:
            tables = meta.shared_kv.generated_block_tables
            self.prompt_lens[:n].copy_(meta.shared_kv.prompt_lens)
            self.generated_block_tables[:n, :tables.shape[1]].copy_(tables)
        if self.exit_rule is not None:
            if len(inputs.generated_rows) == n:  # the usual decode step: one launch, no host-to-device copy
                self.may_exit[:n].fill_(True)
            else:
                may_exit = torch.zeros(n, dtype=torch.bool)
                may_exit[inputs.generated_rows] = True
                self.may_exit[:n].copy_(may_exit, non_blocking=True)
        self._pad(n)

    def run_loop(self, t: int) -> LoopOutput:
        self.graphs[self.bucket, t].replay()
        h, gate_logits, reached = self.views
        return LoopOutput(h, gate_logits, reached if self.exit_rule is not None and self.exit_rule.decides(t)
                          else None)

    def run_coda(self, state: torch.Tensor) -> torch.Tensor:
        n = self.inputs.meta.num_rows
        if self.rows != n:  # rows stopped and were compacted: every token's buffers again
            self._load(self.inputs)
        self.hidden[:n].copy_(state)
        self.graphs[self.bucket, CODA].replay()
        return self.coda_out[:n]

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.int64).to(self.hidden.device, non_blocking=True)
        buffers = [self.hidden, self.positions, self.slot_mapping, self.context_lens, self.block_tables,
                   self.may_exit]
        if self.exit_rule is not None:
            buffers += self.exit_rule.buffers
        if self.shared_kv is not None:
            buffers += [self.prompt_lens, self.generated_block_tables]
        if self.side_tables is not None:
            buffers.append(self.side_tables)
        if self.injection is not None:
            buffers.append(self.injection)
        compact(buffers, index)
        self._pad(len(rows))

    def _pad(self, n: int) -> None:
        """Rows n..bucket become padding rows (restored here in case a larger batch used them)."""
        bs = self.bucket = self.bucket_for(n)
        if n != self.rows:
            self.views = self.hidden[:n], self.gate_logits[:n], self.reached[:n]  # run_loop's outputs
        self.rows = n
        if n == bs:
            return
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
        self.context_lens[n:bs].fill_(1)
        self.block_tables[n:bs].fill_(self.scratch_block)
        if self.side_tables is not None:
            self.side_tables[n:bs].fill_(self.scratch_side_block)
        if self.shared_kv is not None:
            self.prompt_lens[n:bs].fill_(PADDING_PROMPT_LEN)
        self.may_exit[n:bs] = False
