"""Turns a scheduled batch into tensors once per step, runs the model's loops over it through the loop driver
(a captured graph where one fits, eagerly otherwise), reads out under each row's exit policy and samples.

A speculative step (ScheduledBatch.draft_lens) goes to runner/speculative.py instead of one pass of every
loop. A run changes no request: what the step adds to them comes back in a StepResult, which `commit`
appends once the step is applied. Until then `rollback` puts back the little a run does change (seeded
generators, loop counters), so a step cut short (KeyboardInterrupt included) leaves no trace; `take_staged`
marks the point from which the step is applied and nothing is rolled back.
A row whose readout or sampling fails ends in StepResult.errors; the other rows are sampled without it.

Depth batching (config.depth_batching, runner/depth_passes.py): a step's decode rows run one loop pass, each
at its own loop, and only those whose token finished sample; the others come back in
StepResult.mid_token_rows, their MidToken kept here (never by the scheduler) once the step is applied. The
step's prompt rows run every loop in the same step, as without depth batching. On CUDA a pass's layer stack
replays a graph per batch bucket (runner/pass_graphs.py); steps with prompt tokens take piecewise graphs where
lockstep would. A lone decode row at the start of its token shares a pass with nobody: it runs its loops back
to back in one step, as without depth batching (the decode graphs of one row), so batch 1 pays no per-pass
step; so do pipelined speculation's decode rows when every one of them pauses its drafts
(Request.drafts_paused), as plain decoding.

Async scheduling (`launch` / `finish`): a step is launched without waiting for its tokens, which stay on the
device (a LaunchedStep) while the host copies them back; the next step can be launched before they arrive,
its rows whose last token is still pending (request.PENDING_TOKEN) reading it from the previous step's
device tokens. `finish` waits for the copy and hands back the StepResult that `run` would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from attention.base import AttentionBackend, AttentionMetadata, SharedKVMetadata, side_table_tensor
from cache.kv_pool import KVPool
from cache.kvarn_pool import KVarNPool
from cache.layout import KVLayout
from engine_config import EngineConfig
from exit_policy import FULL, ExitPolicy, LoopTrace, coda_traces, readout_logits, request_policy
from model.exit_criteria import ExitCriterion
from model.looped import LoopedModel, LoopStates
from request import DepthStats, Logprob, Request, ScheduledBatch, SpeculativeStats
from runner.block_tables import BlockTables
from runner.chain_graphs import BucketChains, ChainGraphs, SpeculativeChainGraphs
from runner.cuda_graph import DecodeGraphs
from runner.depth_passes import DepthPasses, MidToken, PassResult
from runner.exit_rules import CriterionRows, ExitRule, GateCDFRows, RuleExit, check_readout
from runner.host_to_device import upload
from runner.initial_states import InitialStates
from runner.loop_driver import EagerLoops, LoopStats, StepInputs, run_loops
from runner.pass_chains import PassChains
from runner.pass_graphs import PassGraphs
from runner.pipelined_speculation import InFlight, PipelinedSpeculation
from runner.piecewise_graphs import PiecewiseGraphs
from runner.request_loops import RequestLoops
from runner.sampler import logprob_dicts, logprobs_topn, process_logits, sample
from runner.speculative import SelfSpeculation
from runner.speculative_chains import SpeculativeChains


@dataclasses.dataclass(slots=True)
class StepResult:
    """One step's outcome, before any request changes. Per batch row: the next token (None where the row
    does not sample or failed; a list of tokens in a speculative step), why it failed, and what commit()
    appends to its request: per new token its loop trace and logprobs, the prompt logprobs of its chunk, and
    (speculative) per verification, how many tokens it drafted and how many of them were accepted (a chain
    of pipelined passes: one entry per token, None where no draft was behind it)."""

    tokens: list[int | list[int] | None]
    errors: dict[int, str] = dataclasses.field(default_factory=dict)
    traces: dict[int, list[LoopTrace]] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list[dict[int, Logprob]]] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[int, list[dict[int, Logprob]]] = dataclasses.field(default_factory=dict)
    drafts: dict[int, list[tuple[int, int] | None]] = dataclasses.field(default_factory=dict)
    # Under a warm start (runner/initial_states.py): row -> (the position of its last token, the warm start of
    # the token after it), kept for its request once the step is applied
    warm: dict[int, tuple[int, torch.Tensor]] = dataclasses.field(default_factory=dict)
    # A launched step's sampled tokens while they are still on the device: (batch rows, their tokens [rows])
    device_tokens: list[tuple[list[int], torch.Tensor]] = dataclasses.field(default_factory=list)
    # Depth batching: per decode row, the token it carries into the next pass (None: its token finished);
    # per row whose tokens finished, (the loops it ran, the passes it spanned) of each, in order
    mid_tokens: dict[int, MidToken | None] = dataclasses.field(default_factory=dict)
    depth_tokens: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    # Speculation pipelined in depth passes (runner/pipelined_speculation.py): per decode row, its request's
    # tokens in flight after the pass ([] where none is)
    in_flight: dict[int, list[InFlight]] = dataclasses.field(default_factory=dict)

    @property
    def mid_token_rows(self) -> frozenset[int]:
        """The rows that yield nothing this step: their token is still between its loops (a row of chained
        passes that finished tokens before the one it carries yields those)."""
        rows = {row for row, mid in self.mid_tokens.items() if mid is not None} | set(self.in_flight)
        return frozenset(row for row in rows if self.tokens[row] is None)

    def take(self, rows: list[int], part: StepResult) -> None:
        """A step's part over these of its rows (part's row i is row rows[i]), into this result."""
        for i, row in enumerate(rows):
            if part.tokens[i] is not None:
                self.tokens[row] = part.tokens[i]
        for field in ("errors", "traces", "logprobs", "prompt_logprobs", "warm", "mid_tokens",
                      "depth_tokens", "in_flight", "drafts"):
            into = getattr(self, field)
            for i, value in getattr(part, field).items():
                into[rows[i]] = value


@dataclasses.dataclass(slots=True)
class _Staged:
    """What a run changed outside its StepResult, to undo; `committed` once commit() has taken it on."""

    batch: ScheduledBatch
    generators: dict[str, torch.Tensor | None]  # request_id -> generator state before (None: no generator)
    decode_tokens: int
    decode_loops: int
    decode_passes: int
    committed: bool = False


@dataclasses.dataclass(slots=True)
class LaunchedStep:
    """A step launched without waiting for its tokens (async scheduling): its batch, its StepResult (tokens
    None until finish()), what to undo, and its sampled tokens on the device, in the order `index` gives
    (request id -> position), with their host copy under way (`ready` marks its end on CUDA)."""

    batch: ScheduledBatch
    result: StepResult
    staged: _Staged
    tokens: torch.Tensor
    index: dict[str, int]
    host: torch.Tensor
    ready: torch.cuda.Event | None


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LoopedModel, backend: AttentionBackend,
                 pool: KVPool | KVarNPool, layout: KVLayout, scratch_block: int,
                 token_text: Callable[[int], str] | None = None,
                 scratch_side_block: int | None = None) -> None:
        """scratch_block: a pool block no request owns, which CUDA-graph padding rows write;
        scratch_side_block (a KVarN pool): the side block they write. token_text: one token's text, for
        Logprob.decoded_token."""
        self.config = config
        self.token_text = token_text
        self.model = model
        self.backend = backend
        self.layout = layout
        self.side_tables = isinstance(pool, KVarNPool)  # a KVarN pool: rows carry their side tables
        self.scratch_side_block = scratch_side_block
        self.device = config.device
        self.loops = config.loops
        self.generators: dict[str, torch.Generator] = {}
        self.loop_stats = LoopStats()
        self._staged: _Staged | None = None
        bs = config.block_size
        self.block_tables = BlockTables(-(-config.max_model_len // bs), lambda r: r.block_table)
        self.max_pages = -(-config.max_model_len // (self.loops * bs))
        self.generated_tables = (BlockTables(self.max_pages, lambda r: r.generated_block_table)
                                 if layout.stores_generated_apart else None)
        self.pool = pool
        self.hook = self._exit_hook(pool)
        self.eager = EagerLoops(model, backend)
        self.initial_states = InitialStates(model, config.initial_state_scale, config.continuous_compute,
                                            self.device) if model.initial_state is not None else None
        self.speculation = SelfSpeculation(self, config.draft_loops) if config.draft_loops else None
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.mid_tokens: dict[str, MidToken] = {}  # depth batching: request id -> its token between passes
        self.depth = DepthPasses(model, backend, layout, pool, self._exit_rule,
                                 self.hook.readout_loop if self.hook is not None else self.loops - 1,
                                 config.continuous_compute is not None, self.loop_stats) \
            if config.depth_batching else None
        # speculation pipelined in depth passes: request id -> its tokens in flight between passes
        self.in_flight: dict[str, list[InFlight]] = {}
        self.pipelined = PipelinedSpeculation(self, self.depth, config.draft_loops) \
            if config.pipelines_speculation else None
        self.scratch_block = scratch_block
        # depth batching: decode steps whose rows allow it chain several passes on the device
        self.chains = PassChains(model, self.depth, scratch_block * config.block_size, self.device) \
            if self.depth is not None and config.step_passes > 1 else None
        self.speculative_chains = None
        if self.chains is not None and self.pipelined is not None:
            self.speculative_chains = SpeculativeChains(self.chains, self.pipelined, self.loops,
                                                        config.draft_loops)
        if self.device.type == "cuda" and not config.enforce_eager and backend.capabilities.cuda_graphs:
            self._reserve_fused_workspace()
            if self.depth is None:
                self.graphs = self._capture(scratch_block)
            else:  # decode steps are loop passes: their layer stack, per bucket
                self.depth.graphs = self.pass_graphs()
                self.depth.graphs.capture_all()
                for chains in self.chain_graphs():  # a chained pass with the step to the next, whole
                    chains.capture_all()
                # and _lockstep_tokens' steps: a lone decode row's token, or pipelined rows that pause drafts
                lockstep_rows = 1 if self.pipelined is None else config.max_num_seqs
                self.graphs = self._capture(scratch_block, lockstep_rows)
            # Steps with prompt tokens: piecewise, unless an exit hook must see each loop (early:Q).
            tokens = min(config.piecewise_graph_tokens, config.max_num_batched_tokens)
            if tokens and self.hook is None:
                self.piecewise = PiecewiseGraphs(model, backend, tokens, self.device)
                self.piecewise.capture_all()

    def _exit_hook(self, pool: KVPool | KVarNPool) -> RuleExit | None:
        """The loop driver's hook of an exit policy that stops generated tokens early, over the policy's exit
        rule (None: every token runs every loop)."""
        policy = self.config.exit_policy
        if not policy.can_exit:
            return None
        readout_loop = self.loops - 1
        if policy.is_criterion:
            self.criterion = ExitCriterion.from_policy(policy)
            self.check_readout = check_readout(self.model, self.criterion)
            readout_loop = self.criterion.readout_loop(self.loops)
        return RuleExit(self._exit_rule, readout_loop, self.layout, pool, self.loop_stats)

    def _exit_rule(self, capacity: int) -> ExitRule | None:
        """The exit policy's rule for `capacity` rows (None: no exits): early:Q's exit CDF, or an exit
        criterion's memory, whose check reads out only the rows it is given (an eager step's looping generated
        rows, a per-loop graph's live rows, compacted after every exit), so that a checked loop costs one head
        GEMM over the rows still looping (docs/looped_controls.md)."""
        policy = self.config.exit_policy
        if policy.is_criterion:
            shape = self.model.shape
            return CriterionRows(self.criterion, self.check_readout, self.loops, capacity, shape.hidden_size,
                                 shape.vocab_size, self.device)
        if policy.can_exit:
            return GateCDFRows(float(policy.value), self.loops, capacity, self.device)
        return None

    def _capture(self, scratch_block: int, rows: int | None = None) -> DecodeGraphs:
        """One graph per decode bucket for the whole step; one per (bucket, loop) when rows can stop early or
        a step may run some loops only (speculative decoding's steps, whose verify pass has k rows per
        request; pipelined speculation has none).
        rows: the largest bucket (None: every row a step can decode)."""
        config = self.config
        hook, layout = self.hook, self.layout
        rows = rows or config.max_num_seqs * max(1, config.speculative_tokens)
        copy_forward = None
        if hook is not None and layout.copies_forward:
            def copy_forward(slots: torch.Tensor, mask: torch.Tensor, loop: int) -> None:
                layout.copy_forward(hook.pool, slots, loop, mask)
        per_loop = hook is not None or (self.speculation is not None and self.pipelined is None)
        graphs = DecodeGraphs(self.model, self.backend, "loop" if per_loop else "step", rows,
                              self.block_tables.width, config.block_size, scratch_block, self.device,
                              self._shared_kv(), self._exit_rule(rows), copy_forward, self.scratch_side_block)
        graphs.capture_all()
        return graphs

    def _reserve_fused_workspace(self) -> None:
        """The skinny GEMM's split-K tickets, made outside any capture (a model with fused kernels)."""
        if self.model.fused_kernels:
            from model.kernels.gemv import reserve_workspace

            reserve_workspace(self.device)

    def _shared_kv(self) -> tuple[int, int, int] | None:
        """The graphs' kv_sharing="last" shape: (loops, layers a loop, generated pages a sequence)."""
        if self.generated_tables is None:
            return None
        return self.loops, self.model.slot_map.loop_layers, self.max_pages

    def pass_graphs(self) -> PassGraphs:
        """Depth batching's loop pass over static buffers (runner/pass_graphs.py), not captured yet: until its
        capture_all runs, DepthPasses given it runs the graphs' body eagerly."""
        rows = self.config.max_num_seqs * (self.config.speculative_tokens if self.config.speculative else 1)
        return PassGraphs(self.model, self.backend, rows, self.block_tables.width,
                          self.config.block_size, self.scratch_block, self.device, self._shared_kv())

    def chain_graphs(self) -> list[BucketChains]:
        """Chained passes over static buffers (runner/chain_graphs.py), on the pass graphs' (depth.graphs),
        set on the chains that run them (the plain chains, or pipelined speculation's), not captured yet:
        until their capture_all runs, the chains run the graphs' body eagerly. [] without chains."""
        graphs, config = self.depth.graphs, self.config
        columns = config.chain_positions + 1
        if self.speculative_chains is not None:
            chains = self.speculative_chains
            chains.graphs = SpeculativeChainGraphs(chains, graphs, config.max_num_seqs, config.step_passes,
                                                   columns)
            return [chains.graphs]
        if self.chains is None:
            return []
        rule = self._exit_rule(graphs.buckets[-1])
        self.chains.graphs = ChainGraphs(self.chains, graphs, rule, config.step_passes, columns)
        return [self.chains.graphs]

    @property
    def uses_cuda_graphs(self) -> bool:
        depth_graphs = self.depth is not None and self.depth.graphs is not None and self.depth.graphs.captured
        return self.graphs is not None or depth_graphs

    def prepare(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> StepInputs:
        """Flatten the batch: token ids, positions, slot mapping, per-row lengths and block tables. A row
        whose last token is pending reads it from `previous`, the step that sampled it."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        readout: list[int] = []
        prompt_readout: list[int] = []  # tokens whose next prompt token's logprob is asked for, after readout
        generated_rows: list[int] = []
        pending: tuple[list[int], list[int]] = ([], [])  # (input index, index into previous.tokens)
        for row, (request, num_new, samples) in enumerate(zip(batch.requests, batch.num_new_tokens,
                                                               batch.sample)):
            start = request.num_computed_tokens
            end = start + num_new
            input_ids += request.token_ids[start:end]
            positions += range(start, end)
            slot_mapping += self.layout.slot_mapping(request, start, end)
            query_start.append(query_start[-1] + num_new)
            context_lens.append(end)
            if samples:
                readout.append(query_start[-1] - 1)
            first = query_start[-2] - start
            prompt_readout += [first + p for p in prompt_logprob_positions(request, start, end)]
            if num_new == 1 and start >= request.num_prompt_tokens:
                generated_rows.append(row)
            if request.pending and end == request.num_tokens:
                if previous is None or request.request_id not in previous.index:
                    raise RuntimeError(f"request {request.request_id}'s last token is pending, and the step "
                                       "that samples it was not given")
                pending[0].append(query_start[-1] - 1)
                pending[1].append(previous.index[request.request_id])
        readout += prompt_readout
        inputs = self._inputs(batch.requests, input_ids, positions, slot_mapping, query_start, context_lens,
                              list(batch.num_new_tokens), readout, generated_rows,
                              (*pending, previous.tokens) if pending[0] else None)
        initial = self.initial_states
        if initial is not None and initial.needed:
            starts = [r.num_computed_tokens for r in batch.requests]
            inputs.hidden = initial.for_step(batch.requests, starts, context_lens)
            kept = initial.keep_rows(batch.requests, context_lens)
            if kept:
                inputs.keep_final = torch.tensor([query_start[row + 1] - 1 for row in kept],
                                                 dtype=torch.int64).to(self.device, non_blocking=True)
        return inputs

    def decode_inputs(self, requests: list[Request], tokens: list[int] | torch.Tensor, positions: list[int],
                      hidden: torch.Tensor | None = None) -> StepInputs:
        """One token per row, at a position of the caller's choosing (its block table covers it): the draft
        and verify passes of speculative decoding (runner/speculative.py). A request may fill several rows,
        one per position; each row attends causally up to its own position, so the rows of one request see
        each other's K/V of the same loop, stored before any row attends. hidden: the state the first loop
        starts from, [rows, H]. tokens may be a device tensor (int64): drafts that never visit the host.
        Every row reads out."""
        slot_mapping = [s for request, p in zip(requests, positions)
                        for s in self.layout.slot_mapping(request, p, p + 1)]
        rows = range(len(requests))
        inputs = self._inputs(requests, tokens, positions, slot_mapping, list(range(len(requests) + 1)),
                              [p + 1 for p in positions], [1] * len(requests), list(rows), list(rows))
        inputs.hidden = hidden
        return inputs

    def _inputs(self, requests: list[Request], input_ids: list[int] | torch.Tensor, positions: list[int],
                slot_mapping: list[int], query_start: list[int], context_lens: list[int],
                query_lens: list[int], readout: list[int], generated_rows: list[int],
                pending: tuple[list[int], list[int], torch.Tensor] | None = None) -> StepInputs:
        """The step's tensors, in two host-to-device copies (runner/host_to_device.py), one per dtype.
        pending: (indices into input_ids, indices into the previous step's device tokens, those tokens):
        input tokens still on the device, put in place there."""
        tables = self.block_tables.gather(requests)
        int32_parts: list[list[int] | torch.Tensor] = [query_start, context_lens, tables]
        if self.generated_tables is not None:
            prompt_lens = [r.num_prompt_tokens for r in requests]
            int32_parts += [prompt_lens, self.generated_tables.gather(requests)]
        side_tables = [r.side_table for r in requests] if self.side_tables else None
        if side_tables is not None:  # last: [rows, the block tables' width], -1 where a block has none
            int32_parts.append(side_table_tensor(side_tables, tables.shape[1]))
        int32 = upload(int32_parts, torch.int32, self.device)
        on_device = isinstance(input_ids, torch.Tensor)
        int64_parts = [[] if on_device else input_ids, positions, slot_mapping, readout]
        if pending is not None:
            int64_parts += pending[:2]
        ids, positions_d, slots, readout_d, *pending_index = upload(int64_parts, torch.int64, self.device)
        if pending is not None:
            at, src = pending_index
            ids.index_copy_(0, at, pending[2].index_select(0, src))
        if on_device:
            ids = input_ids
        shared = None
        if self.generated_tables is not None:
            generated_sides = [r.generated_side_table for r in requests] if self.side_tables else None
            shared = SharedKVMetadata(int32[3], int32[4], prompt_lens, self.loops,
                                      self.model.slot_map.loop_layers, generated_sides)
        meta = AttentionMetadata(
            query_start_loc=int32[0],
            context_lens=int32[1],
            block_tables=int32[2],
            slot_mapping=slots,
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
            block_size=self.config.block_size,
            shared_kv=shared,
            side_tables_cpu=side_tables,
            side_tables=int32[-1] if side_tables is not None else None,
            decode_rows=generated_rows,
        )
        return StepInputs(ids, positions_d, meta, readout_d, generated_rows,
                          readout == list(range(len(input_ids))))

    def forward(self, inputs: StepInputs, loops: list[int] | None = None) -> LoopStates:
        """Every loop over the batch (fewer for rows an exit hook stops): a captured graph for a decode step
        that fits a bucket, piecewise graphs for a step with prompt tokens that fits a token bucket, else
        eager. loops: each row's loop count (runner/request_loops.py; None: the engine's for every row); a
        batch with rows of fewer loops runs through the RequestLoops hook, on the per-loop graphs where they
        exist and a decode batch fits a bucket, else eagerly (the per-loop graphs are captured only for
        options that refuse per-request loops today, so eagerly)."""
        stats = self.loop_stats
        stats.decode_tokens += len(inputs.generated_rows)
        graphs, decode, rows = self.graphs, inputs.meta.is_decode, inputs.meta.num_rows
        if loops is not None and min(loops, default=self.loops) < self.loops:
            hook = RequestLoops(loops, self.loops, self.layout, self.pool, stats)
            executor = self.executor_for(rows) if decode else self.eager
            return run_loops(executor, self.model, inputs, range(self.loops), hook)
        if self.hook is None:
            stats.decode_loops += self.loops * len(inputs.generated_rows)
        if self.config.batch_invariant:  # a one-token prompt chunk takes the prompt path (decode_rows)
            decode = decode and len(inputs.generated_rows) == rows
        if graphs is not None and graphs.mode == "step" and decode and graphs.bucket_for(rows):
            return self._read(graphs.replay_step(inputs), inputs)
        piecewise = self.piecewise
        if (not decode and piecewise is not None and (inputs.hidden is None or piecewise.initial is not None)
                and piecewise.bucket_for(inputs.num_tokens)):
            self.backend.prepare(inputs.meta)
            states = self._read(piecewise.run(inputs.input_ids, inputs.positions, inputs.hidden), inputs)
            # each loop's gate on its own, as the eager loop driver computes it
            gate_of = self.model.exit_gate
            if gate_of is not None:
                states.gate_logits = torch.stack([gate_of(h) for h in states.hidden])
            return states
        executor = self.executor_for(rows) if decode else self.eager
        return run_loops(executor, self.model, inputs, range(self.loops), self.hook)

    @staticmethod
    def _read(states: LoopStates, inputs: StepInputs) -> LoopStates:
        """A graph's states of every token of the step: those of its readout tokens, and the last-loop states
        of inputs.keep_final."""
        final = None if inputs.keep_final is None else states.hidden[-1][inputs.keep_final]
        if inputs.reads_out_every_token:
            states.final = final
            return states
        return dataclasses.replace(states.rows(inputs.readout), final=final)

    def executor_for(self, num_rows: int):
        """The loop driver's executor for a decode batch of num_rows one-token rows: the per-loop graphs
        where they exist and a bucket fits, else eager."""
        graphs = self.graphs
        if graphs is not None and graphs.mode == "loop" and graphs.bucket_for(num_rows):
            return graphs
        return self.eager

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        """The next token of every request whose chunk reaches the end of its sequence (None elsewhere), and
        the logprobs, prompt logprobs and traces its SamplingParams ask for, staged for commit()."""
        self._stage(batch)
        if batch.draft_lens:
            try:
                result = StepResult([None] * batch.num_seqs)
                self.speculation.run(batch, result)
                self.loop_stats.decode_tokens += sum(len(tokens) for tokens in result.tokens)
                self.loop_stats.decode_loops += self.loops * sum(batch.draft_lens)
                return result
            except Exception:
                # One row's failure (its sampling, say) must not take down the batch: run the step the plain
                # way, which isolates failing rows. What the drafts wrote lies at positions it rewrites.
                self._restore_generators(self._staged.generators)
            except BaseException:
                self.rollback()
                raise
        try:
            if self.depth is not None:
                return self._run_depth_step(batch)
            return self._run_loops_and_sample(batch)
        except BaseException:
            self.rollback()
            raise

    def _run_depth_step(self, batch: ScheduledBatch) -> StepResult:
        """Depth batching: the decode rows (one generated token each) run one loop pass; the other rows
        (prompt chunks) every loop, as without it."""
        result = StepResult([None] * batch.num_seqs)
        decode = self._decode_rows(batch)
        chosen = set(decode)
        others = [row for row in range(batch.num_seqs) if row not in chosen]
        if decode and self._drafts_pause(batch, decode):  # plain decoding
            return self._lockstep_tokens(batch, decode)
        if decode and self._chainable(batch, decode):
            chained = self._chained_passes if self.pipelined is None else self._speculative_chain
            result.take(decode, chained(batch.select(decode)))
        elif len(decode) == 1 and self.pipelined is None and not self._mid_token(batch.requests[decode[0]]):
            return self._lockstep_tokens(batch, decode)
        elif decode:
            run_pass = self._depth_pass if self.pipelined is None else self._pipelined_pass
            result.take(decode, run_pass(batch.select(decode)))
        if others:
            result.take(others, self._run_loops_and_sample(batch.select(others)))
        return result

    @staticmethod
    def _decode_rows(batch: ScheduledBatch) -> list[int]:
        """The rows that decode one generated token."""
        return [row for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens))
                if num_new == 1 and request.num_computed_tokens >= request.num_prompt_tokens]

    def _drafts_pause(self, batch: ScheduledBatch, decode: list[int]) -> bool:
        """Do these decode rows all pause their pipelined drafts (Scheduler.apply), so the step is plain
        decoding's?"""
        return self.pipelined is not None and all(batch.requests[row].drafts_paused for row in decode)

    def launchable(self, batch: ScheduledBatch) -> bool:
        """Can launch() run the batch ahead of its tokens? Not a speculative step, nor under depth batching
        a loop pass (a row may end mid-token): there only a step of prompt chunks or of decode rows whose
        pipelined drafts all pause."""
        return self._launched_decode_rows(batch) is not None

    def _launched_decode_rows(self, batch: ScheduledBatch) -> list[int] | None:
        """The decode rows a launched step runs as lockstep tokens ([] without depth batching), or None where
        the batch cannot be launched ahead of its tokens (launchable)."""
        if batch.draft_lens:
            return None
        if self.depth is None:
            return []
        decode = self._decode_rows(batch)
        return decode if self._drafts_pause(batch, decode) else None

    def _chainable(self, batch: ScheduledBatch, decode: list[int]) -> bool:
        """Can these decode rows run chained passes (runner/pass_chains.py)?"""
        if self.chains is None or not batch.reserved:
            return False
        policy = self.config.exit_policy  # read out at a token's last run loop (_readout_policies)
        readout_is_last = policy.kind in ("full", "early") or (
            policy.is_criterion and policy.readout_loop(self.loops) == self.loops - 1)
        return all(self.chains.eligible(batch.requests[row], readout_is_last) for row in decode)

    def _chained_passes(self, batch: ScheduledBatch) -> StepResult:
        """config.step_passes loop passes over decode rows, each within the positions it reserved: every row's
        finished tokens (a list, or None where none finished) and the MidToken it carries on."""
        requests = batch.requests
        inputs = self.prepare(batch)
        carried = [self.mid_tokens.get(r.request_id) for r in requests]
        carried = [mid if mid is not None and mid.continues(r) else None for mid, r in zip(carried, requests)]
        out = self.chains.run(inputs, requests, [self.loops_of(r) for r in requests], carried,
                              self.reserved_slots(batch), self.config.step_passes)
        result = StepResult([tokens or None for tokens in out.tokens])
        result.mid_tokens = dict(enumerate(out.carried))
        result.depth_tokens = {row: depth for row, depth in enumerate(out.depth) if depth}
        return result

    def reserved_slots(self, batch: ScheduledBatch) -> list[list[int]]:
        """Per decode row, the slots of the positions it reserved (ScheduledBatch.reserved), from its next
        one on."""
        return [self.layout.slot_mapping(r, r.num_computed_tokens, r.num_computed_tokens + reserved)
                for r, reserved in zip(batch.requests, batch.reserved)]

    def _speculative_chain(self, batch: ScheduledBatch) -> StepResult:
        """Pipelined speculation over decode rows, config.step_passes passes chained on the device."""
        result = StepResult([None] * batch.num_seqs)
        self.speculative_chains.run(batch, self.config.step_passes, result)
        return result

    def _mid_token(self, request: Request) -> bool:
        """Is the request's next token between loop passes?"""
        mid = self.mid_tokens.get(request.request_id)
        return mid is not None and mid.continues(request)

    def _lockstep_tokens(self, batch: ScheduledBatch, decode: list[int], previous: LaunchedStep | None = None,
                         on_device: bool = False) -> StepResult:
        """The step as without depth batching (the per-loop or whole-step graphs), each decode row's token
        running its loops back to back, one pass per loop: a lone decode row at the start of its token (no
        other row shares a pass), or decode rows whose pipelined drafts pause (Request.drafts_paused; their
        tokens in flight are dropped, and a token between its loops restarts at loop 0). previous, on_device:
        _run_loops_and_sample's (a launched step)."""
        stats = self.loop_stats
        before = stats.decode_loops
        result = self._run_loops_and_sample(batch, previous, on_device)
        ran = stats.decode_loops - before
        loops = [ran] if len(decode) == 1 else [self.loops_of(batch.requests[row]) for row in decode]
        stats.decode_passes += max(loops)
        for row, token_loops in zip(decode, loops):
            result.mid_tokens[row] = None
            result.depth_tokens[row] = [(token_loops, max(loops))]
            if self.pipelined is not None and row not in result.errors:  # its token finished
                result.in_flight[row] = []
        return result

    def _depth_pass(self, batch: ScheduledBatch) -> StepResult:
        """One loop pass over decode rows: the finished tokens' rows read out and sample; every row's MidToken
        (or None) in StepResult.mid_tokens."""
        requests = batch.requests
        inputs = self.prepare(batch)
        carried = [self.mid_tokens.get(r.request_id) for r in requests]
        carried = [mid if mid is not None and mid.continues(r) else None for mid, r in zip(carried, requests)]
        out = self.depth.run(inputs, requests, [self.loops_of(r) for r in requests], carried)
        result = StepResult([None] * batch.num_seqs)
        result.mid_tokens = dict(enumerate(out.carried))
        if out.finished:
            result.take(out.finished, self.sample_finished(batch.select(out.finished), out))
        return result

    def _pipelined_pass(self, batch: ScheduledBatch) -> StepResult:
        """One loop pass over decode rows with their tokens in flight (runner/pipelined_speculation.py)."""
        result = StepResult([None] * batch.num_seqs)
        self.pipelined.run(batch, result)
        return result

    def finished_readout(self, finished: ScheduledBatch, states: LoopStates
                         ) -> tuple[torch.Tensor, list[LoopTrace | None]]:
        """The raw readout logits [F, V] (fp32) of a pass's finished rows (`finished`, states in order), and
        their traces where asked for."""
        rows = list(range(finished.num_seqs))
        return self._readout(states, self._readout_policies(finished, rows),
                             [r.params.loop_trace for r in finished.requests], finished.requests)

    def sample_finished(self, finished: ScheduledBatch, out: PassResult) -> StepResult:
        """A pass's finished tokens (their rows: `finished`, in out.finished's order) read out and sampled,
        with their warm starts and (loops run, passes spanned)."""
        part = StepResult([None] * finished.num_seqs)
        if out.states.final is not None:
            self._warm_starts(finished, out.states.final, part)
        sampling = [i for i, samples in enumerate(finished.sample) if samples]
        if sampling:
            self._isolated(finished, part, self._sample_rows, "sampling", out.states.rows(sampling),
                           sampling)
        part.depth_tokens = {i: [(loops, passes)] for i, (loops, passes)
                             in enumerate(zip(out.loops_run, out.passes))}
        return part

    def _run_loops_and_sample(self, batch: ScheduledBatch, previous: LaunchedStep | None = None,
                              on_device: bool = False) -> StepResult:
        """Every loop over the batch, then prompt logprobs and sampling. on_device: the sampled tokens stay
        on the device (StepResult.device_tokens) instead of in StepResult.tokens."""
        inputs = self.prepare(batch, previous)
        states = self.forward(inputs, [self.loops_of(r) for r in batch.requests])
        result = StepResult([None] * batch.num_seqs)
        if states.final is not None:
            self._warm_starts(batch, states.final, result)
        sampling = [row for row, samples in enumerate(batch.sample) if samples]
        if len(inputs.readout) > len(sampling):  # the readout's first rows sample; prompt tokens follow
            self._isolated(batch, result, self._prompt_logprobs, "prompt logprobs",
                           states.rows(slice(len(sampling), None)), list(range(batch.num_seqs)))
        rows = [row for row in sampling if row not in result.errors]
        if rows:
            stage = self._sample_rows_on_device if on_device else self._sample_rows
            self._isolated(batch, result, stage, "sampling", states, rows)
        return result

    def _warm_starts(self, batch: ScheduledBatch, final: torch.Tensor, result: StepResult) -> None:
        """The warm starts of the tokens after the kept rows' last tokens (InitialStates.keep_rows, in its
        order), into result.warm."""
        initial = self.initial_states
        ends = [r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens)]
        warm = initial.warm_states(final)
        for i, row in enumerate(initial.keep_rows(batch.requests, ends)):
            result.warm[row] = (ends[row] - 1, warm[i])

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """run() without waiting for the sampled tokens (a batch launchable() takes): they stay on the device
        and are copied back to the host behind the step. Rows whose last token is pending read it from
        `previous`. finish() hands back the StepResult; commit(result, launched.staged) applies it."""
        decode = self._launched_decode_rows(batch)
        if decode is None:
            raise ValueError("a speculative step or a depth-batched loop pass cannot be launched ahead of "
                             "its tokens")
        self._stage(batch)
        try:
            result = (self._lockstep_tokens(batch, decode, previous, on_device=True) if decode
                      else self._run_loops_and_sample(batch, previous, on_device=True))
            order = [(row, tokens) for rows, tokens in result.device_tokens for row in rows]
            parts = [tokens for _, tokens in result.device_tokens]
            tokens = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else
                                                               torch.zeros(0, dtype=torch.int64))
            index = {batch.requests[row].request_id: i for i, (row, _) in enumerate(order)}
            ready = None
            if tokens.device.type == "cuda":
                host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                host.copy_(tokens, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                host = tokens
            launched = LaunchedStep(batch, result, self._staged, tokens, index, host, ready)
        except BaseException:
            self.rollback()
            raise
        self._staged = None  # the launched step holds it now
        return launched

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and put them in its StepResult."""
        if launched.ready is not None:
            launched.ready.synchronize()
        values = launched.host.tolist()
        result = launched.result
        for row, request in enumerate(launched.batch.requests):
            position = launched.index.get(request.request_id)
            if position is not None:
                result.tokens[row] = values[position]
        result.device_tokens = []
        return result

    def drop(self, launched: LaunchedStep) -> None:
        """A launched step will not be applied: its generators and loop counters go back."""
        self._staged = launched.staged
        self.rollback()

    def take_staged(self) -> _Staged | None:
        """The last run's undo record, taken out for commit(): from here the step is applied, and rollback()
        has nothing left to undo."""
        staged, self._staged = self._staged, None
        return staged

    def commit(self, result: StepResult, staged: _Staged | None, appended: list[int],
               advances: list[bool]) -> None:
        """The step is applied: append its traces and logprobs to the requests it advanced. staged: the run's
        (take_staged) or a launched step's (LaunchedStep.staged); per batch row, appended: the tokens the
        scheduler appends (a stop may cut a speculative row's short), advances: does its request move
        forward. Once only: a staged record already committed is skipped."""
        if staged is None or staged.committed:
            return
        staged.committed = True
        for row, (position, warm) in result.warm.items():
            if advances[row]:
                self.initial_states.keep(staged.batch.requests[row].request_id, position, warm)
        for row, mid in result.mid_tokens.items():
            request = staged.batch.requests[row]
            if mid is None or request.is_finished:
                self.mid_tokens.pop(request.request_id, None)
            else:
                self.mid_tokens[request.request_id] = mid
        for row, chain in result.in_flight.items():
            request = staged.batch.requests[row]
            if chain and not request.is_finished:
                self.in_flight[request.request_id] = chain
            else:
                self.in_flight.pop(request.request_id, None)
        for row, tokens in result.depth_tokens.items():
            request = staged.batch.requests[row]
            for loops, passes in tokens[:appended[row]]:
                if request.depth is None:
                    request.depth = DepthStats()
                request.depth.add(loops, passes)
        for row, request in enumerate(staged.batch.requests):
            added = appended[row]
            if added > 0:
                request.traces += result.traces.get(row, [])[:added]
                request.logprobs += result.logprobs.get(row, [])[:added]
            for check in result.drafts.get(row, [])[:max(added, 1)]:
                if check is None:
                    continue
                if request.speculative is None:
                    request.speculative = SpeculativeStats()
                request.speculative.add(*check)
                self.speculation.stats.add(*check)
            if row in result.prompt_logprobs and advances[row]:
                request.prompt_logprobs.extend(result.prompt_logprobs[row])

    def rollback(self) -> None:
        """The last run's step will not be applied: its generators and loop counters go back."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self._restore_generators(staged.generators)
            stats = self.loop_stats
            stats.decode_tokens, stats.decode_loops, stats.decode_passes = \
                staged.decode_tokens, staged.decode_loops, staged.decode_passes

    def _stage(self, batch: ScheduledBatch) -> None:
        generators = {}
        for request, samples in zip(batch.requests, batch.sample):
            if samples and request.params.seed is not None and not request.params.greedy:
                generator = self.generators.get(request.request_id)
                generators[request.request_id] = generator.get_state() if generator is not None else None
        stats = self.loop_stats
        self._staged = _Staged(batch, generators, stats.decode_tokens, stats.decode_loops,
                               stats.decode_passes)

    def _restore_generators(self, states: dict[str, torch.Tensor | None]) -> None:
        for request_id, state in states.items():
            if state is None:
                self.generators.pop(request_id, None)
            elif request_id in self.generators:
                self.generators[request_id].set_state(state)

    def _isolated(self, batch: ScheduledBatch, result: StepResult, stage: Callable, what: str,
                  states: LoopStates, rows: list[int]) -> None:
        """stage(batch, result, states, rows) for all rows at once; if that raises, row by row, so that a
        row that fails ends in result.errors and the others are unaffected. A stage writes into `result` only
        once it has computed everything. Only these rows' generators go back before the retry (a depth step's
        other part has sampled its own already)."""
        try:
            stage(batch, result, states, rows)
            return
        except Exception:
            ids = {batch.requests[row].request_id for row in rows}
            self._restore_generators({request_id: state for request_id, state
                                      in self._staged.generators.items() if request_id in ids})
        for row in rows:
            try:
                stage(batch, result, states, [row])
            except Exception as err:
                result.errors[row] = f"{what} failed: {type(err).__name__}: {err}"

    def _sample_rows(self, batch: ScheduledBatch, result: StepResult, states: LoopStates,
                     rows: list[int]) -> None:
        """Read out and sample these sampling rows (batch rows); states: every sampling row's, in order."""
        requests, logits, traces, sampled = self._readout_and_sample(batch, states, rows, traced=True)
        logprobs = self.logprobs_of(requests, logits, sampled)  # of the raw logits, as vLLM's default
        for row, token, trace, entry in zip(rows, sampled.tolist(), traces, logprobs):
            result.tokens[row] = token
            if trace is not None:
                result.traces[row] = [trace]
            if entry is not None:
                result.logprobs[row] = [entry]

    def _readout_and_sample(self, batch: ScheduledBatch, states: LoopStates, rows: list[int], traced: bool
                            ) -> tuple[list[Request], torch.Tensor, list[LoopTrace | None], torch.Tensor]:
        """The rows' requests, readout logits, traces (where asked for and `traced`) and sampled tokens [rows]
        on the device."""
        sampling = [row for row, samples in enumerate(batch.sample) if samples]
        index = slice(0, len(rows)) if len(rows) == len(sampling) else [sampling.index(row) for row in rows]
        requests = [batch.requests[row] for row in rows]
        logits, traces = self._readout(states.rows(index), self._readout_policies(batch, rows),
                                       [traced and r.params.loop_trace for r in requests], requests)
        sampled = sample(process_logits(logits, requests), [r.params for r in requests],
                         [self.generator_of(r) for r in requests])
        return requests, logits, traces, sampled

    def _sample_rows_on_device(self, batch: ScheduledBatch, result: StepResult, states: LoopStates,
                               rows: list[int]) -> None:
        """_sample_rows for a launched step: the rows' tokens stay on the device (result.device_tokens).
        Rows that ask for logprobs or traces are not launched ahead (the engine runs those steps with
        run())."""
        _, _, _, sampled = self._readout_and_sample(batch, states, rows, traced=False)
        result.device_tokens.append((rows, sampled))

    def logprobs_of(self, requests: list[Request], logits: torch.Tensor,
                    sampled: torch.Tensor) -> list[dict[int, Logprob] | None]:
        """SamplingParams(logprobs=N): the sampled token's logprob and the top N per row (None: not asked)."""
        out: list[dict[int, Logprob] | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if rows:
            counts = [requests[i].params.logprobs for i in rows]
            top = logprobs_topn(logits[rows], sampled[rows], max(counts))
            for i, entry in zip(rows, logprob_dicts(top, counts, self.token_text)):
                out[i] = entry
        return out

    def _prompt_logprobs(self, batch: ScheduledBatch, result: StepResult, states: LoopStates,
                         rows: list[int]) -> None:
        """SamplingParams(prompt_logprobs=N): each prompt token's logprob given the tokens before it, read out
        under the request's exit policy; states: every row's prompt readout tokens, in prepare's order."""
        chosen, requests, next_tokens, owners = set(rows), [], [], []
        index = 0
        for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            for p in prompt_logprob_positions(request, start, start + num_new):
                if row in chosen:
                    owners.append((row, index))
                    requests.append(request)
                    next_tokens.append(request.prompt_token_ids[p + 1])
                index += 1
        if not owners:
            return
        # prompt tokens never exit under a criterion: every loop, read out at the last
        policies = [FULL if policy.is_criterion else policy for policy in self.policies_of(requests)]
        tokens = [i for _, i in owners]
        logits, _ = self._readout(states.rows(tokens), policies, [False] * len(requests), requests)
        counts = [r.params.prompt_logprobs for r in requests]
        top = logprobs_topn(logits, torch.tensor(next_tokens, device=logits.device), max(counts))
        entries: dict[int, list[dict[int, Logprob]]] = {}
        for (row, _), entry in zip(owners, logprob_dicts(top, counts, self.token_text)):
            entries.setdefault(row, []).append(entry)
        result.prompt_logprobs.update(entries)

    def _readout(self, states: LoopStates, policies: list[ExitPolicy], traced: list[bool],
                 requests: list[Request]) -> tuple[torch.Tensor, list[LoopTrace | None]]:
        """Logits [R, V] (fp32) of the states' rows under their policies, and their traces. A model with a
        coda reads out its coda's output, which the loop driver ran on each row's readout state (its last
        loop's, a request's k-th under SamplingParams.loops, or under an exit criterion the loop where the
        row stopped or its readout loop). Otherwise the rows of a request with k loops read out of their
        first k loops' states, as an engine of k loops would."""
        if states.readout is not None:
            logits = self.model.compute_logits(states.readout).float()
            return logits, coda_traces(states.gate_logits, policies, traced)
        threshold = self.config.model.early_exit_threshold
        loops = [self.loops_of(r) for r in requests]
        if min(loops, default=self.loops) == self.loops:
            return readout_logits(self.model.compute_logits, states.hidden, states.gate_logits, policies,
                                  traced, threshold)
        logits, traces = None, [None] * len(policies)
        for k in sorted(set(loops)):
            rows = [i for i, n in enumerate(loops) if n == k]
            part, part_traces = readout_logits(self.model.compute_logits, states.hidden[:k, rows],
                                               states.gate_logits[:k, rows], [policies[i] for i in rows],
                                               [traced[i] for i in rows], threshold)
            if logits is None:
                logits = part.new_empty(len(loops), part.shape[1])
            logits[rows] = part
            for i, trace in zip(rows, part_traces):
                traces[i] = trace
        return logits, traces

    def loops_of(self, request: Request) -> int:
        """The loops the request's tokens run (SamplingParams.loops, else the engine's)."""
        return self.loops if request.params.loops is None else request.params.loops

    def policies_of(self, requests: list[Request]) -> list[ExitPolicy]:
        """Each request's readout policy (its own override, else the engine's)."""
        engine_policy = self.config.exit_policy
        return [request_policy(r.params.exit_policy, engine_policy, self.loops_of(r)) for r in requests]

    def _readout_policies(self, batch: ScheduledBatch, rows: list[int]) -> list[ExitPolicy]:
        """Each sampling row's readout policy. A generated row under early:Q stopped looping exactly where
        its CDF reached Q (or ran every loop), so its last state is its threshold readout: untraced, it reads
        out as `full` does, with one lm_head call and no exit-pdf arithmetic. Under a criterion so does a
        generated row whose readout loop is where it stopped or the last (exit_policy.py: exit_loops), and
        every row of prompt tokens, which ran every loop."""
        policies = []
        for row, policy in zip(rows, self.policies_of([batch.requests[row] for row in rows])):
            request = batch.requests[row]
            generated = (batch.num_new_tokens[row] == 1
                         and request.num_computed_tokens >= request.num_prompt_tokens)
            untraced = not request.params.loop_trace
            if policy.kind == "early" and generated and untraced:
                policy = FULL
            elif policy.is_criterion and (not generated or
                                          (untraced and policy.readout_loop(self.loops) == self.loops - 1)):
                policy = FULL
            policies.append(policy)
        return policies

    def generator_of(self, request: Request) -> torch.Generator | None:
        if request.params.seed is None or request.params.greedy:
            return None
        if request.request_id not in self.generators:
            generator = torch.Generator(self.device).manual_seed(request.params.seed)
            self.generators[request.request_id] = generator
        return self.generators[request.request_id]

    def release(self, request: Request) -> None:
        """The request finished: forget its generator, its last state, its token between passes and its
        block-table rows."""
        self.generators.pop(request.request_id, None)
        self.mid_tokens.pop(request.request_id, None)
        self.in_flight.pop(request.request_id, None)
        if self.initial_states is not None:
            self.initial_states.release(request.request_id)
        self.block_tables.release(request)
        if self.generated_tables is not None:
            self.generated_tables.release(request)


def prompt_logprob_positions(request: Request, start: int, end: int) -> range:
    """Positions in [start, end) whose logits give a prompt token's logprob (position p predicts token p + 1)
    and that are not recorded yet (a preempted request recomputes its prompt)."""
    if request.params.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(request.prompt_logprobs)), min(end, request.num_prompt_tokens - 1))
