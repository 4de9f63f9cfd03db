"""Chained loop passes (depth batching with Engine(passes_per_step=P)): a step's decode rows run P loop passes
back to back on the device, with no host read between them, as vLLM's multi-step scheduling runs several
decode steps per scheduler call.

Why: a depth-batched pass that waits for its exit flags before the next one is planned serialises the host's
work (scheduling, inputs, exit decisions, readout, commit: milliseconds a pass) with the device's (one loop's
weight read). Chained, the host only queues each pass's launches while the device runs the pass before, and
reads every pass's outcome once, at the end of the step.

Between passes the device builds each row's next pass from the last. A row whose token finished (its last
loop ran, or its exit rule fired) reads out (the head on its last state, then argmax: greedy rows only),
copies its K/V forward through the KV layout, and starts its next token at loop 0 in the next pass, one
position further: its state is the new token's embedding, its exit rule's memory is reset. The other rows go
on to their next loop. Each row reserved up to P positions (Scheduler(chain_positions=P):
ScheduledBatch.reserved), whose slots the host lists before the first pass; a row that finished the tokens of
all of them idles through the passes left, writing the scratch slot only. The host then replays the record
(per pass and row: finished, token, loop run) into each row's tokens, which the scheduler checks for stops in
turn, as it does a speculative row's: tokens after a stop are dropped, and their K/V lies past the request's
end. On CUDA a pass and the step to the next replay as one graph over static buffers (runner/chain_graphs.py);
`fused_step` is what it records (the step after the exit rule and the head as one kernel), and `step`, the
same as tensor operations, what a batch larger than every bucket runs eagerly.

Which rows: greedy, without logprobs, traces, penalties or min_tokens still pending; read out at their
token's last run loop under the engine's exit policy (full, early:Q, or a criterion whose readout loop is
the last); no warm start; a model without prelude or coda (Ouro); a KV pool whose slots the host can list
ahead (not KVarN's side tables, not kv_sharing="last"). A step with any other decode row runs one pass
(runner/depth_passes.py): the two continue each other's tokens (MidToken). A row's tokens are those of one
pass a step: the same loops over the same inputs, the same readout and argmax. The head runs over every row of
a pass here and over the finished rows there, which gives the same bits where the kernels are batch-invariant
(deterministic mode) and may differ in the last bits elsewhere, as any change of batch does. In a fused pass
where no row finishes, the head reads no weights (compute_logits' skip flag) and its tokens go unread.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from attention.base import AttentionMetadata
from model.looped import LoopedModel
from request import Request
from runner.depth_passes import DepthPasses, MidToken, PassRows
from runner.exit_rules import ExitRule
from runner.host_to_device import upload
from runner.loop_driver import StepInputs


@dataclasses.dataclass(slots=True)
class ChainResult:
    """Per row of a chain: the tokens it finished, in order; (loops run, passes spanned) of each; and the
    MidToken of the token it carries into the next step (None: its next token starts at loop 0)."""

    tokens: list[list[int]]
    depth: list[list[tuple[int, int]]]
    carried: list[MidToken | None]


@dataclasses.dataclass(slots=True)
class ChainRows:
    """The chain's per-row device tensors between passes: the PassRows (states, outputs, gates) and [n] each
    of the rest."""

    rows: PassRows
    loop: torch.Tensor  # the loop each row runs next
    finished: torch.Tensor  # tokens the row finished so far in this step
    position: torch.Tensor  # its token's position, within the row's reservation
    slot: torch.Tensor  # that position's slot (the scratch slot once the reservation is used)
    active: torch.Tensor  # still within its reservation


@dataclasses.dataclass(slots=True)
class ChainSteps:
    """What a chain's steps between passes read and never change, [n] each: the rows' first positions,
    loops to run and reserved positions; the slot table [n, columns] (slot_table); and whether a row may run
    fewer loops than the model's (SamplingParams.loops), which copies K/V forward without an exit rule."""

    first: torch.Tensor
    limit: torch.Tensor
    reserved: torch.Tensor
    table: torch.Tensor
    stops_early: bool


# layer(state, positions, slot, offsets) -> (the loop's output, gate logits): the rows through the layer
# stack, each writing its K/V at `slot` of its own loop's plane (`offsets`, int32), attending to positions + 1
# keys (offsets None: the lengths and offsets the chain graphs' buffers hold, which a fused step wrote)
Tensor = torch.Tensor
LayerPass = Callable[[Tensor, Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor]]


class PassChains:
    """Runs P loop passes over decode rows with one host read: `run`. scratch_slot: an in-plane index no
    request owns, which rows past their reservation write. `graphs` (runner/chain_graphs.py; the runner sets
    it on CUDA): the passes as captured graphs over static buffers, for rows that fit a bucket."""

    def __init__(self, model: LoopedModel, depth: DepthPasses, scratch_slot: int,
                 device: torch.device) -> None:
        self.model, self.depth, self.scratch_slot = model, depth, scratch_slot
        slot_map = model.slot_map
        self.loops = depth.loops
        # the slot offset of each loop, and whether its exit rule decides there
        self.offset_of = torch.tensor([slot_map.slot(t, 0) - slot_map.slot(0, 0) for t in range(self.loops)],
                                      dtype=torch.int32, device=device)
        decides = depth.decides
        self.decides_at = torch.tensor([decides is not None and decides(t) for t in range(self.loops)],
                                       dtype=torch.bool, device=device)
        self.graphs = None

    @staticmethod
    def eligible(request: Request, readout_is_last: bool) -> bool:
        """Can this decode row run in a chain? (The module docstring says which rows can.)"""
        p = request.params
        return (readout_is_last and p.greedy and p.exit_policy is None and p.logprobs is None
                and not p.loop_trace and not p.penalized and request.num_output_tokens >= p.min_tokens)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, requests: list[Request], loops: list[int],
            carried: list[MidToken | None], slots: list[list[int]], passes: int) -> ChainResult:
        """Up to `passes` loop passes over these decode rows (inputs: their one token each); loops[i]: the
        loops row i's request runs; carried[i]: its token's MidToken (None: it starts at loop 0); slots[i]:
        the slots of the positions it reserved, from its current one on (at least one). No more passes than
        the longest row can use: its reserved tokens at every loop, less the loops its token already ran."""
        depth, n = self.depth, len(requests)
        passes = min(passes, max(len(s) * k - (0 if mid is None else mid.loop)
                                 for s, k, mid in zip(slots, loops, carried)))
        device = inputs.meta.slot_mapping.device
        stats = depth.stats
        first_pass = stats.decode_passes + 1
        table, columns = self.slot_table(slots)
        start = [0 if mid is None else mid.loop for mid in carried]
        loop, limit, reserved, flat = upload([start, loops, [len(s) for s in slots], table], torch.int64,
                                             device)
        table = flat.view(n, columns)  # a row's column j: the slot of its j-th reserved position
        rows = depth.pass_rows(inputs, carried)
        zero = torch.zeros(n, dtype=torch.int64, device=device)
        chain = ChainRows(rows, loop, zero, inputs.positions.clone(), inputs.meta.slot_mapping.clone(),
                          zero < reserved)
        steps = ChainSteps(inputs.positions, limit, reserved, table, min(loops) < self.loops)
        if self.graphs is not None and self.graphs.fits(n, columns, passes):
            record, after = self.graphs.run(chain, steps, inputs.meta, passes)
        else:
            record, after = self._eager(chain, steps, self.eager_layer(inputs.meta), passes)
        active, done, tokens, ran = record.permute(1, 2, 0).tolist()  # [n][passes] each
        stats.decode_passes += passes
        stats.decode_loops += sum(map(sum, active))
        stats.decode_tokens += sum(map(sum, done))
        return self._replay(requests, carried, after, first_pass, active, done, tokens, ran)

    def slot_table(self, slots: list[list[int]]) -> tuple[list[int], int]:
        """Each row's reserved slots, padded with the scratch slot to one more column than the longest
        (flattened, for upload), and that column count: column j holds the slot of a row's j-th reserved
        position, the scratch slot past its reservation."""
        columns = max(map(len, slots)) + 1
        return [p for s in slots for p in s + [self.scratch_slot] * (columns - len(s))], columns

    def _eager(self, chain: ChainRows, steps: ChainSteps, layer: LayerPass, passes: int
               ) -> tuple[torch.Tensor, PassRows]:
        """The passes, one by one, over the rows' own tensors (a batch larger than every captured bucket, or
        no graphs): the record [passes, 4, n] and the rows after the last pass."""
        n = chain.loop.shape[0]
        rule = self.depth.exit_rule(n)
        if rule is not None:
            for buffer, memory in zip(rule.buffers, chain.rows.memory):
                buffer.copy_(memory)
        record = torch.empty(passes, 4, n, dtype=torch.int64, device=chain.loop.device)
        count = torch.zeros(1, dtype=torch.int64, device=chain.loop.device)
        for _ in range(passes):
            self.step(chain, steps, layer, rule, record, count)
        memory = [] if rule is None else list(rule.buffers)
        return record, PassRows(chain.rows.state, None, chain.rows.hidden, chain.rows.gates, memory)

    def step(self, chain: ChainRows, steps: ChainSteps, layer: LayerPass, rule: ExitRule | None,
             record: torch.Tensor, count: torch.Tensor) -> None:
        """One pass and the step to the next: row `count` of `record` [passes, 4, n] gets, per row, whether it
        was active, whether its token finished, the token, and the loop it ran; then count += 1. No host
        read: a CUDA graph records it whole (runner/chain_graphs.py)."""
        done, token = self.loop_pass(chain, layer, steps.limit, rule, rule is not None or steps.stops_early)
        ran = torch.stack([chain.active.long(), done.long(), token, chain.loop])
        record.index_copy_(0, count, ran[None])
        count += 1
        self._advance(chain, steps, done, token, rule)

    def eager_layer(self, meta: AttentionMetadata) -> LayerPass:
        """The layer pass of rows that are not in the captured buffers: the step's metadata (block tables)
        with each pass's slots, lengths and loops (DepthPasses.layer_pass: a bucket's graph where one fits).
        An eager body reads the host lists, so they are read here where no graph replays."""
        depth = self.depth

        def layer(state: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, offsets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            graphs, lengths = depth.graphs, positions + 1
            replayed = graphs is not None and graphs.captured and graphs.bucket_for(len(offsets))
            host = {} if replayed else dict(context_lens_cpu=lengths.tolist(),
                                            slot_offsets_cpu=offsets.tolist())
            at = dataclasses.replace(meta, slot_mapping=slot, context_lens=lengths.int(),
                                     slot_offsets=offsets, **host)
            return depth.layer_pass(state, None, positions, at)

        return layer

    def loop_pass(self, chain: ChainRows, layer: LayerPass, limit: torch.Tensor, rule: ExitRule | None,
                  copies: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: every row through its loop (the active ones' own slots; the others write the scratch
        slot); which active rows' tokens finished (limit: each row's loops), with their K/V copied forward
        where `copies`, and each row's argmax token."""
        rows, loop = chain.rows, chain.loop
        h, gate = layer(rows.state, chain.position, chain.slot, self.offset_of[loop])
        every = torch.arange(h.shape[0], device=h.device)
        rows.hidden[every, loop] = h
        rows.gates[every, loop] = gate.to(rows.gates.dtype)
        done = self.finishing(chain, h, gate, limit, rule, copies)
        rows.state = h
        return done, self.readout(h)

    def readout(self, h: torch.Tensor, reads: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's argmax token from its loop output: a finished token's. reads [n] bool: the rows whose
        token is used; where none is, the head may skip its weights (compute_logits' skip) and every token
        is then arbitrary."""
        skip = None if reads is None else reads.any().logical_not().view(1)
        return self.model.compute_logits(h, skip).float().argmax(dim=-1)

    def readout_and_embedding(self, h: torch.Tensor, dtype: torch.dtype, reads: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A fused step's inputs from the head: each row's argmax token and its embedding in `dtype` (the
        state a row starts from where its token finished or its draft starts); only rows `reads` are used."""
        token = self.readout(h, reads)
        return token, self.model.embed(token).to(dtype)

    def finishing(self, chain: ChainRows, h: torch.Tensor, gate: torch.Tensor, limit: torch.Tensor,
                  rule: ExitRule | None, copies: bool) -> torch.Tensor:
        """Which active rows' tokens finish with the loop they just ran (output h, gate logits gate): at
        their last loop, or where their exit rule fired; their K/V copied forward where `copies`."""
        loop = chain.loop
        done = chain.active & (loop == limit - 1)
        if rule is not None:
            deciding = chain.active & self.decides_at[loop] & ~done
            done = done | rule.decide_rows(deciding, h, gate if rule.reads_gates else None)
        if copies:  # each row from its own loop
            self.depth.layout.copy_forward(self.depth.pool, chain.slot, loop, done)
        return done

    def fused_step(self, chain: ChainRows, steps: ChainSteps, layer: LayerPass, rule: ExitRule | None,
                   record: torch.Tensor, count: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor]
                   ) -> None:
        """`step` with the step to the next as one kernel (runner/chain_step_kernels.py) after the exit rule,
        the head's argmax and the argmax's embedding: in place over the chain's tensors (the chain graphs'
        static buffers, where it runs) and over `inputs`, the next pass's lengths and slot offsets (which the
        layer then reads as they are: it is given no offsets)."""
        from runner.chain_step_kernels import chain_step_kernel  # Triton only where it runs

        rows = chain.rows
        h, gate = layer(rows.state, chain.position, chain.slot, None)
        done = self.finishing(chain, h, gate, steps.limit, rule, rule is not None or steps.stops_early)
        token, embedded = self.readout_and_embedding(h, rows.state.dtype, done)
        lengths, offsets = inputs
        n, hidden_size = h.shape
        check_contiguous(chain.active, chain.loop, chain.finished, chain.position, done, token, h, embedded,
                         rows.state, rows.hidden, rows.gates, gate, steps.first, steps.reserved,
                         chain.slot, lengths, offsets)
        table = steps.table
        block = 4  # rows a program
        chain_step_kernel[(-(-n // block),)](
            chain.active, chain.loop, chain.finished, chain.position, done, token, n,
            steps.first, steps.reserved, table, table.stride(0), table.shape[1],
            count, record, record.stride(0), record.stride(1),
            chain.slot, lengths, offsets, self.offset_of,
            h, embedded, rows.state, rows.hidden, gate, rows.gates,
            BLOCK_R=block, LOOPS=self.loops, H=hidden_size, BLOCK_H=hidden_block(hidden_size, 512),
            num_warps=4)
        count += 1
        if rule is not None:
            rule.reset_rows(done, rows.state)

    def _advance(self, chain: ChainRows, steps: ChainSteps, done: torch.Tensor, token: torch.Tensor,
                 rule: ExitRule | None) -> None:
        """The rows' next pass: a finished token's row starts the next token at loop 0, one position on (or
        idles, its reservation used); the others go on to their next loop."""
        rows, reserved = chain.rows, steps.reserved
        chain.finished += done
        chain.active = chain.finished < reserved
        chain.loop = torch.where(done | ~chain.active, 0, chain.loop + 1)
        # (clamped at 0 for a captured bucket's padding rows, which reserve nothing)
        chain.position = steps.first + torch.minimum(chain.finished, reserved - 1).clamp(min=0)
        table = steps.table
        chain.slot = table.gather(1, chain.finished.clamp(max=table.shape[1] - 1)[:, None])[:, 0]
        self.start_tokens(rows, done, token)
        if rule is not None:
            rule.reset_rows(done, rows.state)

    def start_tokens(self, rows: PassRows, starts: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows `starts` ([n] bool) start a token at loop 0: their state becomes the token's embedding (of
        `tokens`, [n]), their loop outputs zeros and their gates NaN, as a one-pass step's fresh rows."""
        rows.state = torch.where(starts[:, None], self.model.embed(tokens).to(rows.state.dtype), rows.state)
        rows.hidden.masked_fill_(starts[:, None, None], 0)
        rows.gates.masked_fill_(starts[:, None], math.nan)

    def _replay(self, requests: list[Request], carried: list[MidToken | None], after: PassRows,
                first_pass: int, active: list[list[int]], done: list[list[int]], tokens: list[list[int]],
                ran: list[list[int]]) -> ChainResult:
        """The record, per row (lists [n][passes]), into its tokens, their loops and passes, and the MidToken
        it carries on (a row's first position is its request's num_computed_tokens, as prepare gave it)."""
        result = ChainResult([], [], [])
        for i, request in enumerate(requests):
            since = first_pass if carried[i] is None else carried[i].first_pass
            out, depth = [], []
            for j, hit in enumerate(done[i]):
                if hit:
                    out.append(tokens[i][j])
                    depth.append((ran[i][j] + 1, first_pass + j - since + 1))
                    since = first_pass + j + 1
            mid = None
            if active[i][-1] and not done[i][-1]:
                position = request.num_computed_tokens + len(out)
                mid = MidToken(position, request.num_preemptions, ran[i][-1] + 1, since, after, i)
            result.tokens.append(out)
            result.depth.append(depth)
            result.carried.append(mid)
        return result


def check_contiguous(*tensors: torch.Tensor) -> None:
    """A fused step's kernel indexes rows as [n, ...] arrays: every tensor it reads or writes whole."""
    assert all(t.is_contiguous() for t in tensors), "a fused chain step's tensors must be contiguous"


def hidden_block(hidden_size: int, cap: int = 1024) -> int:
    """The fused steps' tile over a state's width: a power of two, at most `cap`."""
    return min(cap, 1 << (hidden_size - 1).bit_length())
