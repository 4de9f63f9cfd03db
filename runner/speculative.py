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

Rejected positions need no rollback in the pool: the scheduler advances a request's computed length by the
tokens it appends, so attention never reads past it, and the next step overwrites those positions.
Both passes run through the loop driver (runner/loop_driver.py), on the per-loop CUDA graphs where a batch
fits a bucket, eagerly otherwise.
"""

from __future__ import annotations

import torch

from model.exit_policy import readout_logits
from model.ouro import LoopStates
from request import LoopTrace, Request, ScheduledBatch, SpeculativeStats
from runner.loop_driver import run_loops
from runner.sampler import apply_filters, logprob_dicts, logprobs_topn


class SelfSpeculation:
    def __init__(self, runner, draft_loops: int) -> None:
        """runner: the ModelRunner whose model, executors and inputs this uses (runner/model_runner.py)."""
        self.runner = runner
        self.model = runner.model
        self.d = draft_loops
        self.loops = runner.loops
        self.stats = SpeculativeStats()  # every request's, since the engine started

    def run(self, batch: ScheduledBatch, result) -> None:
        """Fill result (a StepResult) for a speculative batch: per row its tokens (a list), their traces and
        logprobs (lists, one per token), and (drafts, accepted) in result.drafts."""
        runner, d = self.runner, self.d
        requests, lengths = batch.requests, batch.draft_lens
        starts = [r.num_computed_tokens for r in requests]
        inputs: list[list[int]] = [[r.token_ids[-1]] for r in requests]  # per row: the k inputs, in order
        drafts: list[list[int]] = [[] for _ in requests]
        draft_states: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in requests]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in requests]  # q, for the sampled rows
        for j in range(max(lengths)):
            live = [row for row, k in enumerate(lengths) if k > j]
            states = self._loops([requests[r] for r in live], [inputs[r][j] for r in live],
                                 [starts[r] + j for r in live], range(d))
            logits = self.model.compute_logits(states.hidden[-1]).float()
            tokens = self.draft_tokens(logits, [requests[r] for r in live], draft_probs, live)
            for i, (row, token) in enumerate(zip(live, tokens)):
                drafts[row].append(token)
                draft_states[row].append((states.hidden[:, i], states.gate_logits[:, i]))
                if j + 1 < lengths[row]:
                    inputs[row].append(token)
        # Verify: every row's k inputs as k one-token rows, from their loop d-1 states.
        rows = [row for row, k in enumerate(lengths) for _ in range(k)]
        flat = [(row, j) for row, k in enumerate(lengths) for j in range(k)]
        hidden = torch.stack([draft_states[row][j][0][-1] for row, j in flat])
        verified = self._loops([requests[r] for r in rows], [inputs[row][j] for row, j in flat],
                               [starts[row] + j for row, j in flat], range(d, self.loops), hidden)
        every = LoopStates(
            torch.cat([torch.stack([draft_states[row][j][0] for row, j in flat], 1), verified.hidden]),
            torch.cat([torch.stack([draft_states[row][j][1] for row, j in flat], 1), verified.gate_logits]))
        pseudo = [requests[r] for r in rows]
        logits, traces = readout_logits(self.model.compute_logits, every.hidden, every.gate_logits,
                                        runner.policies_of(pseudo), [r.params.loop_trace for r in pseudo],
                                        runner.config.model.early_exit_threshold)
        self._accept_all(batch, result, logits, traces, drafts, draft_probs, rows)

    def _loops(self, requests: list[Request], tokens: list[int], positions: list[int], loops: range,
               hidden: torch.Tensor | None = None) -> LoopStates:
        runner = self.runner
        inputs = runner.decode_inputs(requests, tokens, positions, hidden)
        return run_loops(runner.executor_for(len(requests)), self.model, inputs, loops)

    def draft_tokens(self, logits: torch.Tensor, requests: list[Request],
                     draft_probs: list[list[torch.Tensor]], rows: list[int]) -> list[int]:
        """Each live row's draft: the argmax for a greedy row; for a sampled row a draw from q (the draft
        logits under its temperature and filters), whose q is kept in draft_probs[row]."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, (request, row) in enumerate(zip(requests, rows)):
            if not request.params.greedy:
                q = apply_filters(logits[i:i + 1], [request.params]).softmax(-1)[0]
                tokens[i] = int(torch.multinomial(q, 1, generator=self.runner.generator_of(request)))
                draft_probs[row].append(q)
        return tokens

    def accept(self, drafts: list[int], targets: list[int]) -> int:
        """Greedy: how many leading drafts the targets confirm."""
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

    def _accept_all(self, batch: ScheduledBatch, result, logits: torch.Tensor, traces: list[LoopTrace | None],
                    drafts: list[list[int]], draft_probs: list[list[torch.Tensor]], rows: list[int]) -> None:
        targets = logits.argmax(dim=-1).tolist()
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
            result.drafts[row] = (k, accepted)
            if request.params.loop_trace:
                kept = [traces[i] for i in span[:len(tokens)]]
                for i, trace in enumerate(kept):
                    trace.draft = "accepted" if i < accepted else "target"
                result.traces[row] = kept
            if request.params.logprobs is not None:
                logprob_rows += [(row, span[i], token) for i, token in enumerate(tokens)]
        if logprob_rows:
            index = [i for _, i, _ in logprob_rows]
            counts = [batch.requests[row].params.logprobs for row, _, _ in logprob_rows]
            top = logprobs_topn(logits[index], torch.tensor([t for _, _, t in logprob_rows],
                                                            device=logits.device), max(counts))
            for (row, _, _), entry in zip(logprob_rows, logprob_dicts(top, counts, self.runner.token_text)):
                result.logprobs.setdefault(row, []).append(entry)
