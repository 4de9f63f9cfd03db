"""Self-speculation pipelined in depth-batched loop passes (Engine(depth_batching=True,
speculative="loops:d")): a request keeps several tokens in flight, each at its own loop of the same pass, so
drafting no longer waits for verification (the bound is T/d, not kT/(kd + T - d)).

What a pass holds per request. Its tokens in flight (InFlight, position order): the first one's input is the
request's own last token (position num_computed_tokens); each later one's input is a draft, read out (the head
on loop d-1's state, as runner/speculative.py drafts) from the token before it once that one's loop d-1 ran.
A draft starts at loop 0 in the next pass, while the token it came from runs loops d..T-1, its verify: so the
tokens in flight are d loops apart, and at most ceil(T/d) are (2 at d = 2, T = 4: a verifying row and a
drafting row). Each is one row of the pass (runner/depth_passes.py: DepthPasses), at its own position and
loop, on its request's block table; a row attends causally up to its own position at its own loop's slots,
which every earlier token in flight has already written (it is d loops ahead), and every row of a layer stores
its K/V before any row of it attends.

Acceptance. Only the first token in flight can finish in a pass (the others are at least d loops behind). Its
full-model token (read out and sampled as any depth-batched token) is compared with the draft the next token
in flight started from. Greedy: on equality (SelfSpeculation.accept, a speculative step's rule) the draft was
the request's token, every loop the next token ran was the full model's computation of it, and it goes on as
the first in flight; otherwise every token in flight after the finished one is discarded, and the request
continues from the corrected token, which starts at loop 0 in the next pass. So a greedy request's tokens are
plain decoding's (and depth batching's without speculation), token for token. Sampled: a draft is drawn from q
(loop d-1's logits under the request's temperature and filters, kept with it), and the finished token is the
draft with probability min(1, p/q), else a draw from the residual max(0, p - q), renormalized
(runner/speculative.py's rule, the request's seeded generator), so it follows the full model's p; it goes on
exactly when that token is the draft.

The scheduler's view. A request is one decode row, at num_computed_tokens, as under depth batching: a pass
appends at most one token a row (its first in flight finished) or none (the row is left mid-token), so
nothing rolls back: num_computed_tokens counts the tokens whose inputs are confirmed, never the drafts. Each
step the row reserves the positions of up to k tokens in flight, as a speculative row does (Scheduler,
pipelined=True; ScheduledBatch.reserved says how many, fewer where max_tokens, max_model_len, the token budget
or the free blocks leave less room); a token in flight beyond them is dropped before the pass and a draft is
made only within them, so k caps the tokens in flight and no slot outside the request's blocks is written. The
draft length does not adapt: a draft costs a row of a pass, not a weight read; but a request whose drafts are
mostly rejected pauses drafting for a while (scheduler/scheduler.py: PIPELINED_PAUSE), its tokens decoded as
without speculation (ModelRunner._lockstep_tokens). Blocks of rejected positions stay the request's (its next
tokens fill them) until it finishes or is preempted, when they are freed with the rest.

Why nothing stale is ever read. A discarded token at position p wrote loops 0..j of position p. Its slots are
read only by rows at positions >= p of the same request: those in flight after it, discarded with it, and the
tokens that take over p and later, which run each loop j at p (rewriting slot (j, p) before any row of that
layer attends) before any later position reaches loop j (a token starts only once the one before it ran
loop d-1). Other requests never see these blocks, and a freed block is rewritten by its next owner before it
is read.

Preemption and abort. A preempted request's tokens in flight are dropped (the first's position or the
request's preemption count no longer match: its tokens restart at loop 0 after the recompute); an aborted or
finished request's go with it (ModelRunner.release). A step that is not applied changes none of them: a pass
builds new InFlight records, which ModelRunner.commit keeps.

Stats. Each finished token's SpeculativeStats entry (one per verification): the draft behind it, accepted or
not, plus (position i >= 1) the drafts discarded behind a rejection. DepthStats counts per token the passes
since the request's previous token finished (d a token when every draft is accepted, T when none is).
"""

from __future__ import annotations

import dataclasses

import torch

from request import Request, ScheduledBatch
from runner.depth_passes import DepthPasses, MidToken, PassResult
from runner.sampler import apply_filters


@dataclasses.dataclass(slots=True)
class InFlight:
    """One of a request's tokens in flight: its position and input token (the request's own for the first, a
    draft for the others), the request's preemptions when it started, its MidToken between passes (None:
    it starts at loop 0 in the next pass), the pass in which the token before it finished (None: not
    since this one started) and, for a sampled draft, the distribution q [V] it was drawn from."""

    position: int
    token: int
    preemptions: int
    mid: MidToken | None = None
    after_pass: int | None = None
    q: torch.Tensor | None = None


class PipelinedSpeculation:
    def __init__(self, runner, depth: DepthPasses, draft_loops: int) -> None:
        """runner: the ModelRunner whose inputs, sampling and in-flight tokens this uses
        (runner/model_runner.py)."""
        self.runner, self.depth, self.d = runner, depth, draft_loops

    def run(self, batch: ScheduledBatch, result) -> None:
        """One pass over decode rows (every row samples), into result (a StepResult): the finished tokens,
        each row's tokens in flight after the pass (result.in_flight) and its verification (result.drafts)."""
        runner = self.runner
        chains = [self.tokens_in_flight(r, room) for r, room in zip(batch.requests, batch.reserved)]
        flat = [(row, entry) for row, chain in enumerate(chains) for entry in chain]
        requests = [batch.requests[row] for row, _ in flat]
        positions = [entry.position for _, entry in flat]
        inputs = runner.decode_inputs(requests, [entry.token for _, entry in flat], positions)
        carried = [entry.mid for _, entry in flat]
        out = self.depth.run(inputs, requests, [runner.loops] * len(flat), carried, positions)
        finished = [flat[i][0] for i in out.finished]
        if any(flat[i][1] is not chains[flat[i][0]][0] for i in out.finished):
            raise AssertionError("a token in flight finished before the one ahead of it")
        verifying = [j for j, row in enumerate(finished) if chains[row][1:] and chains[row][1].q is not None]
        plain = [j for j in range(len(finished)) if j not in verifying]
        if plain:
            rows = [finished[j] for j in plain]
            result.take(rows, runner.sample_finished(batch.select(rows), _subset(out, plain)))
        if verifying:
            self._verify_sampled(batch, [finished[j] for j in verifying], _subset(out, verifying), chains,
                                 result)
        moved = iter(out.carried)
        after = [[dataclasses.replace(entry, mid=next(moved)) for entry in chain] for chain in chains]
        drafting: list[tuple[int, torch.Tensor]] = []
        for row, chain in enumerate(after):
            chain = self._resolved(row, chain, result)
            result.in_flight[row] = chain
            last = chain[-1].mid if chain else None
            room = self._room(batch, row, result)
            if last is not None and last.loop == self.d and chain[-1].position + 1 < room:
                drafting.append((row, last.state))
        if drafting:
            logits = runner.model.compute_logits(torch.stack([state for _, state in drafting])).float()
            rows = [row for row, _ in drafting]
            probs: list[list[torch.Tensor]] = [[] for _ in rows]
            tokens = runner.speculation.draft_tokens(logits, [batch.requests[row] for row in rows], probs,
                                                     list(range(len(rows))))
            for row, token, q in zip(rows, tokens.tolist(), probs):
                chain = result.in_flight[row]
                chain.append(InFlight(chain[-1].position + 1, token, chain[-1].preemptions,
                                      q=q[0] if q else None))

    def _verify_sampled(self, batch: ScheduledBatch, rows: list[int], out: PassResult,
                        chains: list[list[InFlight]], result) -> None:
        """Sampled rows whose finished token has a draft behind it: the token is that draft, accepted with
        probability min(1, p/q), else a draw from the residual max(0, p - q) (runner/speculative.py:
        SelfSpeculation's rule and the request's seeded generator), so it follows the full model's p."""
        runner = self.runner
        finished = batch.select(rows)
        logits, traces = runner.finished_readout(finished, out.states)
        for i, (row, request) in enumerate(zip(rows, finished.requests)):
            try:
                draft = chains[row][1]
                p = apply_filters(logits[i:i + 1], [request.params]).softmax(-1)
                accepted, resampled = runner.speculation._accept_sampled(request, [draft.token], [draft.q], p)
                token = draft.token if accepted else resampled
                entry = runner.logprobs_of([request], logits[i:i + 1], logits.new_tensor([token]).long())[0]
            except Exception as err:  # this row alone fails
                result.errors[row] = f"sampling failed: {type(err).__name__}: {err}"
                continue
            result.tokens[row] = token
            result.depth_tokens[row] = [(out.loops_run[i], out.passes[i])]
            if traces[i] is not None:
                result.traces[row] = [traces[i]]
            if entry is not None:
                result.logprobs[row] = [entry]

    def _room(self, batch: ScheduledBatch, row: int, result) -> int:
        """The end of the positions the row's next pass holds tokens in flight at: this pass's reservation's,
        one further when its first token finished here and it reserved the full k (the next pass reserves k
        from one position on; where max_tokens or max_model_len then leave one fewer, a draft past them is
        dropped before that pass, as tokens_in_flight drops any)."""
        request = batch.requests[row]
        room = request.num_computed_tokens + batch.reserved[row]
        k = request.draft_len or self.runner.config.speculative_tokens
        return room + 1 if result.tokens[row] is not None and batch.reserved[row] == k else room

    def tokens_in_flight(self, request: Request, room: int) -> list[InFlight]:
        """The request's tokens in flight for this pass: those it kept, within its reserved positions, if the
        first is still its next token (not preempted since); else its next token alone, starting at loop 0."""
        start = request.num_computed_tokens
        chain = self.runner.in_flight.get(request.request_id)
        if (not chain or chain[0].position != start or chain[0].preemptions != request.num_preemptions
                or chain[0].token != request.token_ids[start]):
            return [InFlight(start, request.token_ids[start], request.num_preemptions)]
        return [entry for entry in chain if entry.position < start + room]

    def _resolved(self, row: int, chain: list[InFlight], result) -> list[InFlight]:
        """The row's tokens in flight once its finished token (if any) is checked against the draft behind
        it (SelfSpeculation.accept, the one greedy rule of both paths; a sampled token is the draft exactly
        when it was accepted): the rest on acceptance, none on a rejection or a failed row; its verification
        in result.drafts and the finished token's passes (since the token before it finished) in
        result.depth_tokens."""
        if chain[0].mid is not None:
            return chain
        if row in result.depth_tokens and chain[0].after_pass is not None:
            [(loops, passes)] = result.depth_tokens[row]
            result.depth_tokens[row] = [(loops, min(passes, self.runner.loop_stats.decode_passes
                                                    - chain[0].after_pass))]
        rest, token = chain[1:], result.tokens[row]
        if not rest or row in result.errors:
            return []
        if self.runner.speculation.accept([rest[0].token], [token]):
            result.tokens[row] = rest[0].token  # an accepted draft is the token, as a speculative step's are
            result.drafts[row] = [(1, 1)]
            return [dataclasses.replace(rest[0], after_pass=self.runner.loop_stats.decode_passes)] + rest[1:]
        result.drafts[row] = [(len(rest), 0)]
        return []


def _subset(out: PassResult, among: list[int]) -> PassResult:
    """These of a pass's finished tokens (indices into out.finished), with their states."""
    index = torch.tensor(among, dtype=torch.int64, device=out.states.hidden.device)
    return PassResult(out.carried, [out.finished[j] for j in among], [out.loops_run[j] for j in among],
                      [out.passes[j] for j in among], out.states.rows(index, final_by_row=True))
