"""Pipelined self-speculation chained on the device (depth batching with speculative="loops:d" and
passes_per_step=P): runner/pipelined_speculation.py's passes, P of them a step with one host read, for
greedy requests, as runner/pass_chains.py chains plain depth-batched passes.

Each request holds m = ceil(T/d) rows of the chain, one per token it may have in flight (a row whose flag is
off writes the scratch slot and counts nothing). After each pass, per request, on the device:
- its first token in flight finishes when it has run loop T-1: its token (the head's argmax on its last
  state) is appended; it is accepted when the token in flight behind it started from that very token (the
  greedy rule of runner/speculative.py: SelfSpeculation.accept). Then the token behind goes on as the first
  in flight; otherwise every token behind it is dropped and the finished token starts the next position at
  loop 0 (as it does when none was behind it);
- its last token in flight that has just run loop d-1 drafts: the head's argmax on that state starts the next
  position at loop 0, in a row of the request that is free, if the position is within the request's
  reservation (ScheduledBatch.reserved);
- every other token in flight goes on to its next loop.
The tokens are plain decoding's, token for token (the pipelined pass's argument: a dropped token's K/V is
rewritten loop by loop before any later position reads it). The host replays the record (per pass and
request: finished, token, accepted, the tokens dropped, the row a token started in) into each request's
tokens, its verifications (SpeculativeStats), passes per token (DepthStats) and its tokens in flight, which a
later step, chained or not, continues. The speculation runs at full depth (speculation refuses exit
policies), so no K/V is copied forward. On CUDA each pass with its step replays as one graph per bucket of
requests (runner/chain_graphs.py: SpeculativeChainGraphs), reading the forced verdict from the device. A
step of the same requests as the chain before, each with the tokens in flight it left, goes on from what that
chain left in the graphs' buffers (resume): the host then writes only the reservations and block tables, not
the rows.
"""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionMetadata
from request import Request, ScheduledBatch
from runner.depth_passes import MidToken, PassRows
from runner.host_to_device import upload
from runner.pass_chains import ChainRows, LayerPass, PassChains, check_contiguous, hidden_block
from runner.pipelined_speculation import InFlight, PipelinedSpeculation

# what the record holds per pass and request: did a token finish, its token, its row, was it the draft
# behind it, how many tokens behind it were dropped, did a token start, in which row
FIELDS = 7
# a chain's record, rows served per pass, final (active, position, loop, token) per row [4, n], PassRows
ChainOutcome = tuple[torch.Tensor, torch.Tensor, torch.Tensor, PassRows]


@dataclasses.dataclass(slots=True)
class Reservations:
    """Per request [R]: its first position this step, and the end of its reservation."""

    first: torch.Tensor
    end: torch.Tensor


@dataclasses.dataclass(slots=True)
class _Left:
    """What a chain through the static buffers left there: its requests, in order; per request the tokens in
    flight its step gave (the very list a commit keeps) and the seat of each; the pass graphs' loads then."""

    requests: list[Request]
    flights: list[list[InFlight]]
    seats: list[list[int]]
    loads: int


class SpeculativeChains:
    """Runs a step of P pipelined passes over greedy requests: `run`. chains: the plain chains, whose pass
    this runs; pipelined: the one-pass path, whose tokens in flight this continues and leaves."""

    def __init__(self, chains: PassChains, pipelined: PipelinedSpeculation, loops: int, draft_loops: int
                 ) -> None:
        self.chains, self.pipelined = chains, pipelined
        self.loops, self.d = loops, draft_loops
        self.m = -(-loops // draft_loops)  # the most tokens a request has in flight
        # SelfSpeculation.forced_acceptance on the device (-1: none), so a captured step reads it
        self.force = torch.full((1,), -1, dtype=torch.int64, device=chains.offset_of.device)
        self.graphs = None  # runner/chain_graphs.py: SpeculativeChainGraphs, set by the runner on CUDA
        self._left: _Left | None = None  # what the static buffers hold after the last chain through them

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, passes: int, result) -> None:
        """Up to `passes` passes over the batch's requests (one decode row each), into result (a StepResult):
        each row's tokens, verifications, passes per token and tokens in flight after the step. No more
        passes than the request with most to do needs when every draft is accepted: its first token's loops
        left, then d a reserved position."""
        runner = self.pipelined.runner
        requests = batch.requests
        flights = [self.pipelined.tokens_in_flight(r, room) for r, room in zip(requests, batch.reserved)]
        passes = min(passes, max(self.loops - (f[0].mid.loop if f[0].mid else 0) + self.d * (room - 1)
                                 for f, room in zip(flights, batch.reserved)))
        table, columns = self.chains.slot_table(runner.reserved_slots(batch))
        first = [r.num_computed_tokens for r in requests]
        ends = [f + room for f, room in zip(first, batch.reserved)]
        stats = self.chains.depth.stats
        first_pass = stats.decode_passes + 1
        forced = runner.speculation.forced_acceptance
        self.force.fill_(-1 if forced is None else int(bool(forced)))
        graphs = self.graphs
        static = graphs is not None and graphs.fits(len(requests), columns, passes)
        seats = self._seats_left(requests, flights) if static else None
        if seats is not None:
            tables = runner.block_tables.gather(requests).long()
            first_d, end_d, flat_table, blocks = upload([first, ends, table, tables], torch.int64,
                                                        self.force.device)
            outcome = graphs.resume(Reservations(first_d, end_d), flat_table.view(len(requests), columns),
                                    blocks, passes)
        else:
            seats = [list(range(len(flight))) for flight in flights]
            outcome = self._load(requests, flights, first, ends, table, columns, passes, static)
        record, served, final, after = outcome
        host = record.permute(2, 0, 1).tolist()  # [R][passes][FIELDS]
        final = final.tolist()
        stats.decode_passes += passes
        stats.decode_loops += int(served.sum())
        left = []
        for r, request in enumerate(requests):
            left.append(self._replay(r, request, flights[r], seats[r], host[r], final, after, first_pass,
                                     result))
            stats.decode_tokens += len(result.tokens[r] or [])
        self._left = _Left(requests, [result.in_flight[r] for r in range(len(requests))], left,
                           graphs.graphs.loads) if static else None

    def _seats_left(self, requests: list[Request], flights: list[list[InFlight]]) -> list[list[int]] | None:
        """Where the static buffers still hold these requests' tokens in flight as the last chain left them,
        each token's row within its request (its seat): the same requests in the same order, each continuing
        with the very tokens in flight that chain left and its step committed (none dropped, none restarted),
        and no rows loaded into the buffers since. Else None: the chain loads its rows."""
        left, runner = self._left, self.pipelined.runner
        if left is None or left.loads != self.graphs.graphs.loads or len(left.requests) != len(requests):
            return None
        for request, was, kept, flight in zip(requests, left.requests, left.flights, flights):
            held = runner.in_flight.get(request.request_id)
            if request is not was or held is not kept or len(flight) != len(kept) or flight[0] is not kept[0]:
                return None
        return left.seats

    def _load(self, requests: list[Request], flights: list[list[InFlight]], first: list[int], ends: list[int],
              table: list[int], columns: int, passes: int, static: bool) -> ChainOutcome:
        """The chain's rows built from the requests' tokens in flight (seat s of request r: row r * m + s,
        its s-th token in flight, inactive past them) and its passes run: over the static buffers (`static`)
        or over its own tensors."""
        runner, m = self.pipelined.runner, self.m
        rows = [(r, flight[s] if s < len(flight) else None) for r, flight in enumerate(flights)
                for s in range(m)]
        flat = [requests[r] for r, _ in rows]
        positions = [entry.position if entry else requests[r].num_computed_tokens for r, entry in rows]
        tokens = [entry.token if entry else 0 for _, entry in rows]
        inputs = runner.decode_inputs(flat, tokens, positions)
        device = inputs.meta.slot_mapping.device
        active = [entry is not None for _, entry in rows]
        loop = [entry.mid.loop if entry and entry.mid else 0 for _, entry in rows]
        loop_d, active_d, given, first_d, end_d, flat_table = upload(
            [loop, active, tokens, first, ends, table], torch.int64, device)
        owners = Reservations(first_d, end_d)
        table = flat_table.view(len(requests), columns)
        pass_rows = self.chains.depth.pass_rows(inputs, [entry.mid if entry else None for _, entry in rows])
        chain = ChainRows(pass_rows, loop_d, torch.zeros_like(loop_d), inputs.positions.clone(), None,
                          active_d.bool())
        chain.slot = self._slots(chain, owners, table)
        if static:
            return self.graphs.run(chain, given, owners, table, inputs.meta, passes)
        return self._eager(chain, given, owners, table, inputs.meta, passes)

    def _eager(self, chain: ChainRows, given: torch.Tensor, owners: Reservations, table: torch.Tensor,
               meta: AttentionMetadata, passes: int) -> ChainOutcome:
        """The passes one by one over the chain's own tensors (no graphs, or a batch larger than every
        bucket): the record [passes, FIELDS, R], the rows served a pass, the rows' (active, position, loop,
        token) after the last pass, and their PassRows."""
        device = given.device
        record = torch.zeros(passes, FIELDS, owners.first.shape[0], dtype=torch.int64, device=device)
        served = torch.zeros(passes, dtype=torch.int64, device=device)
        count = torch.zeros(1, dtype=torch.int64, device=device)
        limit = torch.full_like(given, self.loops)
        layer = self.chains.eager_layer(meta)
        for _ in range(passes):
            self.step(chain, given, owners, table, limit, layer, record, served, count)
        final = torch.stack([chain.active.long(), chain.position, chain.loop, given])
        rows = chain.rows
        return record, served, final, PassRows(rows.state, None, rows.hidden, rows.gates, [])

    def step(self, chain: ChainRows, given: torch.Tensor, owners: Reservations, table: torch.Tensor,
             limit: torch.Tensor, layer: LayerPass, record: torch.Tensor, served: torch.Tensor,
             count: torch.Tensor) -> None:
        """One pass and the step to the next, without a host read: row `count` of `record` [passes, FIELDS, R]
        and of `served` (the rows that ran) get the pass's; then count += 1."""
        served.index_copy_(0, count, chain.active.sum()[None])
        done, token = self.chains.loop_pass(chain, layer, limit, None, False)
        self._advance(chain, given, done, token, owners, table, record, count)
        count += 1

    def fused_step(self, chain: ChainRows, given: torch.Tensor, owners: Reservations, table: torch.Tensor,
                   layer: LayerPass, record: torch.Tensor, served: torch.Tensor, count: torch.Tensor,
                   inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """`step`'s work with the step to the next as one kernel (runner/chain_step_kernels.py) after the
        pass, the head's argmax and the embedding of each row's argmax: in place over the chain's tensors (the
        chain graphs' static buffers, where it runs), and over `inputs`, the next pass's lengths and slot
        offsets (which the layer then reads as they are: it is given no offsets). served must start at zeros
        (the kernel adds each request's rows)."""
        from runner.chain_step_kernels import pipelined_step_kernel  # Triton only where it runs

        rows, chains = chain.rows, self.chains
        h, gate = layer(rows.state, chain.position, chain.slot, None)
        # a token finishes (its last loop) or drafts (loop d - 1): the only rows whose argmax is read
        reads = chain.active & ((chain.loop == self.loops - 1) | (chain.loop == self.d - 1))
        token, embedded = chains.readout_and_embedding(h, rows.state.dtype, reads)
        check_contiguous(chain.active, chain.position, chain.loop, given, token, rows.state, h, embedded,
                         rows.hidden, rows.gates, gate, chain.slot, *inputs)
        lengths, offsets = inputs
        hidden_size = h.shape[1]
        pipelined_step_kernel[(owners.first.shape[0],)](
            chain.active, chain.position, chain.loop, given, token,
            owners.first, owners.end, table, table.stride(0), table.shape[1], chains.scratch_slot,
            self.force, count, record, record.stride(0), record.stride(1), served,
            chain.slot, lengths, offsets, chains.offset_of,
            h, embedded, rows.state, rows.hidden, gate, rows.gates,
            M=self.m, BLOCK_M=1 << (self.m - 1).bit_length(), LOOPS=self.loops, D=self.d, H=hidden_size,
            BLOCK_H=hidden_block(hidden_size), num_warps=4)
        count += 1

    def _slots(self, chain: ChainRows, owners: Reservations, table: torch.Tensor) -> torch.Tensor:
        """Each row's slot: its position's in its request's reservation (the scratch slot where inactive)."""
        m = self.m
        column = (chain.position.view(-1, m) - owners.first[:, None]).clamp(0, table.shape[1] - 1)
        slot = table.gather(1, column).view(-1)
        return torch.where(chain.active, slot, self.chains.scratch_slot)

    def _advance(self, chain: ChainRows, given: torch.Tensor, done: torch.Tensor, token: torch.Tensor,
                 owners: Reservations, table: torch.Tensor, record: torch.Tensor, count: torch.Tensor
                 ) -> None:
        """After a pass, per request: its finished token's verification, the draft it starts (or the
        finished token restarting the next position), every other token's next loop; into row `count` of
        `record` [passes, FIELDS, R]."""
        m = self.m
        active, position, loop = (t.view(-1, m) for t in (chain.active, chain.position, chain.loop))
        finished, argmax, started = done.view(-1, m), token.view(-1, m), given.view(-1, m)
        ended = finished.any(1)
        head = finished.int().argmax(1, keepdim=True)  # the finished row (any row where none finished)
        head_position = position.gather(1, head)
        emitted = argmax.gather(1, head)[:, 0]
        behind = active & (position == head_position + 1)  # the token that started from the head's draft
        draft = (started * behind).sum(1)
        force = self.force  # SelfSpeculation.forced_acceptance on the device: -1 none, 0 or 1
        confirms = torch.where(force < 0, draft == emitted, force > 0)
        accepted = ended & behind.any(1) & confirms
        emitted = torch.where(accepted, draft, emitted)  # the same token, but where acceptance is forced
        dropped = ended[:, None] & ~accepted[:, None] & active & (position > head_position)
        alive = active & ~finished & ~dropped
        ran = loop  # the loop each row just ran
        last = torch.where(alive, position, -1).max(1, keepdim=True).values
        drafting = alive & (ran == self.d - 1) & (position == last) & (last + 1 < owners.end[:, None])
        restart = ended & ~accepted & (head_position[:, 0] + 1 < owners.end)  # from the finished token
        starts = restart | drafting.any(1)
        start_position = torch.where(restart, head_position[:, 0], last[:, 0]) + 1
        start_token = torch.where(restart, emitted, (argmax * drafting).sum(1))
        # The request's first free row. There always is one where a token starts: a restart drops every row
        # but the finished one, and a draft starts from the last token in flight at loop d-1, the others
        # being d, 2d, ... loops ahead of it and below T once the finished one is gone: fewer than ceil(T/d).
        free = (~alive).int().argmax(1, keepdim=True)
        seat = starts[:, None] & (torch.arange(m, device=free.device)[None, :] == free)
        fields = torch.stack([v.long() for v in (ended, emitted, head[:, 0], accepted, dropped.sum(1), starts,
                                                 free[:, 0])])
        record.index_copy_(0, count, fields[None])
        chain.loop = torch.where(seat, 0, torch.where(alive, loop + 1, 0)).view(-1)
        chain.position = torch.where(seat, start_position[:, None], position).view(-1)
        chain.active = (alive | seat).view(-1)
        given.copy_(torch.where(seat, start_token[:, None], started).view(-1))
        self.chains.start_tokens(chain.rows, seat.view(-1), given)
        chain.slot = self._slots(chain, owners, table)

    def _replay(self, r: int, request: Request, flight: list[InFlight], seats: list[int],
                record: list[list[int]], final: list[list[int]], after: PassRows, first_pass: int, result
                ) -> list[int]:
        """Request r's record into its tokens, verifications (drafted, accepted), passes per token (from the
        later of a token's start and the finish of the one before it) and tokens in flight after the step;
        seats[j]: the row within the request where flight[j] ran. Returns the seats of the tokens in flight
        after the step, in their order."""
        started = {s: entry.mid.first_pass if entry.mid else first_pass for s, entry in zip(seats, flight)}
        after_pass = flight[0].after_pass if flight else None
        tokens, drafts, depth = [], [], []
        for j, (ended, token, head, accepted, dropped, starts, row) in enumerate(record):
            now = first_pass + j
            if ended:
                tokens.append(token)
                passes = now - started[head] + 1
                depth.append((self.loops, passes if after_pass is None else min(passes, now - after_pass)))
                drafts.append((1, 1) if accepted else (dropped, 0) if dropped else None)
                after_pass = now
            if starts:
                started[row] = now + 1
        result.tokens[r] = tokens or None
        result.drafts[r] = drafts
        result.depth_tokens[r] = depth
        held = []  # (token in flight, seat)
        for s in range(self.m):
            i = r * self.m + s
            active, position, loop, token = (final[k][i] for k in range(4))
            if active:
                mid = MidToken(position, request.num_preemptions, loop, started[s], after, i) \
                    if loop else None
                held.append((InFlight(position, token, request.num_preemptions, mid), s))
        held.sort(key=lambda pair: pair[0].position)
        in_flight = [entry for entry, _ in held]
        if in_flight:
            in_flight[0] = dataclasses.replace(in_flight[0], after_pass=after_pass)
        result.in_flight[r] = in_flight
        return [s for _, s in held]
