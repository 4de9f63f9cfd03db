"""Self-speculative decoding: a looped model drafts with its own first d loops and verifies with the rest.

For a drafted token, loops 0..d-1 are exactly what the full model computes: each loop reads only the same
loop's K/V of earlier tokens and the previous loop's output of this token. So a speculative step over decode
rows, each with its last token x at position n and a draft length k (ScheduledBatch.draft_lens):

1. Draft, k passes of one token per row: pass j runs loops 0..d-1 on the row's input at position n + j (x,
   then the previous pass's draft), reads out from loop d-1's state (the `step:d-1` readout) and picks draft
   j (greedy, or a sample from the draft distribution q). Loops 0..d-1 of these k inputs leave their K/V in
   the pool, and their loop d-1 states are kept.
2. Verify, one pass: loops d..T-1 of the k inputs, from the kept states. The k inputs are k rows of a decode
   batch, one per position, all on the row's block table: each attends causally up to its own position,
   and every row's K/V of a layer is stored before any row of it attends, so input i sees inputs < i of the
   same loop. The readout under the engine's policy, from all T loops' states, gives the target at each.
3. Accept the longest prefix where the target equals the draft, plus the target's own token where it
   differs: 1 to k tokens per row and step. Greedy output is the non-speculative greedy output, token for
   token. A sampled row accepts draft j with probability min(1, p(x)/q(x)) and on rejection samples from
   the residual max(0, p - q), renormalized (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
   arXiv 2302.01318), so its tokens follow the target distribution p.

A model with a prelude and a coda (Huginn-0125): each pass runs the prelude (it makes the injection every
loop reads; the verify's rewrites the drafts' prelude K/V with the same values). A draft reads out through
the coda on loop d-1's state, which stores coda K/V at its position; the verify runs the coda on the final
states of all k inputs, so every position a step keeps holds the full model's coda K/V, and the verify's
rows read one another's (every row stores a layer's K/V before any row of it attends), never a draft's.
Where tokens start from drawn states, a draft starts each token's loop 0 from the state a plain step draws
for its (state seed, position) (runner/initial_states.py); a warm start is refused (engine_config.py), since
a token's start is the previous token's last loop, which only the verify computes.

Rejected positions need no rollback in the pool: the scheduler advances a request's computed length by the
tokens it appends, so attention never reads past it, and the next step overwrites those positions.
Both passes run through the loop driver (runner/loop_driver.py), on the per-loop CUDA graphs where a batch
fits a bucket, eagerly otherwise.
"""

from __future__ import annotations

import torch

from exit_policy import LoopTrace, readout_logits
from model.looped import LoopStates
from request import Request, ScheduledBatch, SpeculativeStats
from runner.loop_driver import run_loops
from runner.sampler import apply_filters


class SelfSpeculation:
    def __init__(self, runner, draft_loops: int) -> None:
        """runner: the ModelRunner whose model, executors and inputs this uses (runner/model_runner.py)."""
        self.runner = runner
        self.model = runner.model
        self.d = draft_loops
        self.loops = runner.loops
        self.stats = SpeculativeStats()  # every request's, since the engine started
        # For benchmarks and tests: every greedy draft accepted (True) or every one rejected (False), whatever
        # the targets say (an accepted draft is then the token); None: the greedy rule
        self.forced_acceptance: bool | None = None

    def run(self, batch: ScheduledBatch, result) -> None:
        """Fill result (a StepResult) for a speculative batch: per row its tokens (a list), their traces and
        logprobs (lists, one per token), and (drafts, accepted) in result.drafts.

        The drafts stay on the device until the verify has been launched: pass j's input ids are pass j-1's
        draft tensor, so the host never waits for a pass and prepares the next one while the GPU runs it.
        One device-to-host read, after the verify, brings back every draft and every target."""
        runner, d = self.runner, self.d
        requests, lengths = batch.requests, batch.draft_lens
        device = runner.device
        starts = [r.num_computed_tokens for r in requests]
        lives: list[list[int]] = []  # per pass: the rows that draft in it, in batch order
        passes: list[torch.Tensor] = []  # per pass: its drafts [len(live)] int64, on the device
        draft_states: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in requests]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in requests]  # q, for the sampled rows
        for j in range(max(lengths)):
            live = [row for row, k in enumerate(lengths) if k > j]
            if j == 0:
                ids: list[int] | torch.Tensor = [requests[r].token_ids[-1] for r in live]
            else:  # the previous pass's drafts of the rows still drafting (its live rows are a superset)
                if live == lives[-1]:
                    ids = passes[-1]
                else:
                    position = {row: i for i, row in enumerate(lives[-1])}
                    ids = passes[-1][_index([position[r] for r in live], device)]
            drafting, positions = [requests[r] for r in live], [starts[r] + j for r in live]
            initial = self._initial_states(drafting, positions)
            states = self._loops(drafting, ids, positions, range(d), initial, coda=True)
            logits = self.model.compute_logits(
                states.hidden[-1] if states.readout is None else states.readout).float()
            passes.append(self.draft_tokens(logits, [requests[r] for r in live], draft_probs, live))
            lives.append(live)
            for i, row in enumerate(live):
                gates = None if states.gate_logits is None else states.gate_logits[:, i]
                draft_states[row].append((states.hidden[:, i], gates))
        # Verify: every row's k inputs (its last token, then its first k-1 drafts) as k one-token rows, from
        # their loop d-1 states. Their ids are gathered on the device from [last tokens; every pass's drafts].
        offsets = [0]
        for live in lives:
            offsets.append(offsets[-1] + len(live))
        where = {(row, j): len(requests) + offsets[j] + i for j, live in enumerate(lives)
                 for i, row in enumerate(live)}  # (row, pass) -> index of that draft in `pool`
        flat = [(row, j) for row, k in enumerate(lengths) for j in range(k)]
        pool = torch.cat([_index([r.token_ids[-1] for r in requests], device), *passes])
        ids = pool[_index([row if j == 0 else where[row, j - 1] for row, j in flat], device)]
        hidden = torch.stack([draft_states[row][j][0][-1] for row, j in flat])
        rows = [row for row, _ in flat]
        verified = self._loops([requests[r] for r in rows], ids, [starts[row] + j for row, j in flat],
                               range(d, self.loops), hidden)
        pseudo = [requests[r] for r in rows]
        if verified.readout is not None:  # a model with a coda: the coda of the last loop, as every policy
            logits, traces = self.model.compute_logits(verified.readout).float(), [None] * len(rows)
        else:
            every = LoopStates(
                torch.cat([torch.stack([draft_states[row][j][0] for row, j in flat], 1), verified.hidden]),
                torch.cat([torch.stack([draft_states[row][j][1] for row, j in flat], 1),
                           verified.gate_logits]))
            logits, traces = readout_logits(self.model.compute_logits, every.hidden, every.gate_logits,
                                            runner.policies_of(pseudo), [r.params.loop_trace for r in pseudo],
                                            runner.config.model.early_exit_threshold)
        both = torch.cat([pool[len(requests):], logits.argmax(dim=-1)]).tolist()
        drafted, targets = both[:offsets[-1]], both[offsets[-1]:]
        drafts = [[drafted[where[row, j] - len(requests)] for j in range(k)] for row, k in enumerate(lengths)]
        self._accept_all(batch, result, logits, targets, traces, drafts, draft_probs)

    def _loops(self, requests: list[Request], tokens: list[int] | torch.Tensor, positions: list[int],
               loops: range, hidden: torch.Tensor | None = None, coda: bool = False) -> LoopStates:
        """Loops `loops` of one token per row, from `hidden` (None: the prelude's or the embedding's state).
        coda: a model with a coda also runs it on the last of these loops' states (a draft's readout,
        LoopStates.readout), storing its K/V in the coda slots, which the verify rewrites."""
        runner = self.runner
        inputs = runner.decode_inputs(requests, tokens, positions, hidden)
        executor = runner.executor_for(len(requests))
        states = run_loops(executor, self.model, inputs, loops)
        if coda and self.model.coda is not None and states.readout is None:
            states.readout = executor.run_coda(states.hidden[-1])
        return states

    def _initial_states(self, requests: list[Request], positions: list[int]) -> torch.Tensor | None:
        """Loop 0's states of the drafted tokens, drawn as a plain step draws them, keyed by (the request's
        state seed, the position) (runner/initial_states.py); None where every token starts from zeros."""
        initial = self.runner.initial_states
        if initial is None or not initial.needed:
            return None
        return initial.for_step(requests, positions, [p + 1 for p in positions])

    def draft_tokens(self, logits: torch.Tensor, requests: list[Request],
                     draft_probs: list[list[torch.Tensor]], rows: list[int]) -> torch.Tensor:
        """Each live row's draft, [rows] int64 on the device: the argmax for a greedy row; for a sampled row
        a draw from q (the draft logits under its temperature and filters), whose q is kept in
        draft_probs[row]. Nothing here waits for the device."""
        tokens = logits.argmax(dim=-1)
        for i, (request, row) in enumerate(zip(requests, rows)):
            if not request.params.greedy:
                q = apply_filters(logits[i:i + 1], [request.params]).softmax(-1)[0]
                tokens[i] = torch.multinomial(q, 1, generator=self.runner.generator_of(request))[0]
                draft_probs[row].append(q)
        return tokens

    def accept(self, drafts: list[int], targets: list[int]) -> int:
        """Greedy: how many leading drafts the targets confirm (forced_acceptance: all, or none)."""
        if self.forced_acceptance is not None:
            return len(drafts) if self.forced_acceptance else 0
        for i, (draft, target) in enumerate(zip(drafts, targets)):
            if draft != target:
                return i
        return len(drafts)

    def _accept_sampled(self, request: Request, drafts: list[int], q: list[torch.Tensor],
                        p: torch.Tensor) -> tuple[int, int | None]:
        """Speculative sampling: (accepted drafts, the residual's token where one was rejected, else None)."""
        generator = self.runner.generator_of(request)
        for i, draft in enumerate(drafts):
            u = torch.rand((), generator=generator, device=p.device)
            if u * q[i][draft] <= p[i, draft]:  # u < p / q, without dividing by q
                continue
            residual = (p[i] - q[i]).clamp_min(0.0)
            if float(residual.sum()) <= 0.0:  # p <= q everywhere cannot reject; guard the rounding
                residual = p[i]
            return i, int(torch.multinomial(residual, 1, generator=generator))
        return len(drafts), None

    def _accept_all(self, batch: ScheduledBatch, result, logits: torch.Tensor, targets: list[int],
                    traces: list[LoopTrace | None], drafts: list[list[int]],
                    draft_probs: list[list[torch.Tensor]]) -> None:
        first = 0
        logprob_rows: list[tuple[int, int, int]] = []  # (batch row, verify row, token)
        for row, (request, k) in enumerate(zip(batch.requests, batch.draft_lens)):
            span = range(first, first + k)
            first += k
            if request.params.greedy:
                accepted = self.accept(drafts[row], [targets[i] for i in span])
                tokens = drafts[row][:accepted]
                if accepted < k:
                    tokens.append(targets[span[accepted]])
            else:
                p = apply_filters(logits[span.start:span.stop], [request.params] * k).softmax(-1)
                accepted, resampled = self._accept_sampled(request, drafts[row], draft_probs[row], p)
                tokens = drafts[row][:accepted] + ([resampled] if resampled is not None else [])
            result.tokens[row] = tokens
            result.drafts[row] = [(k, accepted)]
            if request.params.loop_trace:
                kept = [traces[i] for i in span[:len(tokens)]]
                for i, trace in enumerate(kept):
                    trace.draft = "accepted" if i < accepted else "target"
                result.traces[row] = kept
            if request.params.logprobs is not None:
                logprob_rows += [(row, span[i], token) for i, token in enumerate(tokens)]
        if logprob_rows:  # each token's, under the full model's raw logits at its position
            tokens = torch.tensor([t for _, _, t in logprob_rows], device=logits.device)
            entries = self.runner.logprobs_of([batch.requests[row] for row, _, _ in logprob_rows],
                                              logits[[i for _, i, _ in logprob_rows]], tokens)
            for (row, _, _), entry in zip(logprob_rows, entries):
                result.logprobs.setdefault(row, []).append(entry)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
