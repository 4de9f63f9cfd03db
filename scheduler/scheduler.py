"""Continuous batching: each step is one batch within a token budget and a sequence budget. Running
decodes go first, then prefill chunks (running requests first, then the waiting queue, FCFS), all mixed
into one forward pass. Admission (admission="reserve", the default) keeps room for what the running
requests are expected to grow into; when blocks still run out, the most recently admitted request is
preempted and later recomputed. It sees token ids, block ids and a detokenizer; it never touches tensors
or the model.

A step's outcome is decided, then applied. decide() works out every row's outcome (detokenizing the new
tokens) and changes nothing, so an exception while deciding (KeyboardInterrupt included) leaves every request
as it was; apply() then applies the Decision row by row, each row whatever an earlier one raised, and marks
each row as it takes it on, so an apply() cut short is resumed, never repeated (the engine's commit section
relies on this). update() is the two in one call. A request whose detokenizing fails, or whose row the caller
reports failed, ends alone with "error".

Async scheduling splits update() in two, each decided and applied the same way (decide_advance and
decide_pending). advance(batch) applies a launched step provisionally, before its tokens are known: each row's
computed tokens count, and a sampling row's token stands as PENDING_TOKEN at the end of its request
(Request.pending), so the next schedule() gives it its decode row as the synchronous path would after
update(). resolve(batch, tokens) then decides and applies each sampling row's outcome with update()'s rules,
on the request as it was before the pending token. A request certain to finish once its pending token is read
(max_tokens, max_model_len, a full pool) is retired at the next schedule(): its blocks and seat go back then,
as they would have synchronously, so a workload that ends by length schedules the same batches either way; one
that ends at a stop token or string runs one more row, which resolve() drops.

Under speculative decoding (num_speculative_tokens = k > 0) a decode row reserves the positions of up to k
tokens, and a step in which every row decodes is a speculative one (ScheduledBatch.draft_lens): a row may
then come back with several tokens, each checked for stops in turn as if it had come alone. How many a row
drafts follows the "heuristic" schedule of HF transformers' assisted generation: it starts at k, grows by 2
(up to k) after a step whose drafts were all accepted and shrinks by 1 (down to 1) after one that rejected a
draft, so a request whose drafts keep failing pays for one draft per step, not k.

Pipelined (runner/pipelined_speculation.py) a draft costs a row of a pass, not a weight read, but a pass of
a verifying and a drafting row costs more than a loop of one row (an H100 at batch 1 and Ouro-1.4B's shape:
1.60 against 1.21 ms). A token takes d passes where its draft was accepted and T where it was not, so at
d = 2, T = 4 pipelining pays only where about half the drafts or more are accepted. A request whose
verifications in a step accepted fewer than half stops drafting for its next PIPELINED_PAUSE tokens
(Request.draft_resume): it reserves one position a step and decodes as without speculation, every loop of
its token in one step (the runner does so for a step whose decode rows all pause), then drafts again.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Protocol

from cache.blocks import BlockManager
from request import ADMISSION, PENDING_TOKEN, Request, RequestStatus, ScheduledBatch

# The stop_reason of a sequence that ended with finish_reason "length" because the KV pool cannot hold one
# more of its tokens (even were it alone), not because of max_tokens or max_model_len.
KV_POOL_FULL = "kv_pool_full"

# admission="reserve" estimates the blocks the running requests will still claim, as SGLang's scheduler does
# (its new_token_ratio): a fraction of each request's remaining output budget (clipped to RESERVE_CLIP
# tokens), which starts at RESERVE_INIT, falls linearly to RESERVE_FLOOR over RESERVE_DECAY_STEPS steps
# without a preemption, and goes back to RESERVE_INIT after one. SGLang's defaults: 0.7, 0.7 x 0.14, 600.
RESERVE_INIT = 0.7
RESERVE_FLOOR = 0.7 * 0.14
RESERVE_DECAY_STEPS = 600
RESERVE_CLIP = 4096
# Pipelined speculation: the tokens a request decodes without drafts after a step that rejected most of its
# drafts (the docstring above)
PIPELINED_PAUSE = 16


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of a token list."""

    def stream(self, skip_special_tokens: bool = True) -> Callable[[int], str]:
        """A fresh incremental decoder: called with each next token id, it returns the text that token adds
        (possibly "" while a character's bytes are incomplete)."""


class _DetokenizerFailed(Exception):
    token: int | None = None


@dataclasses.dataclass(slots=True)
class _Outcome:
    """What applying a step does to one row's request: take its pending token off (`resolves`), advance it by
    num_new computed tokens, append `tokens`, stand a pending token at its end (`provisional`), set its text,
    and finish it (reason, stop_reason, error), each where set."""

    request: Request
    num_new: int
    tokens: list[int] | None = None
    text: str | None = None
    finish: tuple[str, int | str | None, str | None] | None = None
    resolves: bool = False
    provisional: bool = False


@dataclasses.dataclass(slots=True)
class Decision:
    """A step's outcome for each row of its batch (None: the row changes nothing), decided while nothing
    changed; Scheduler.apply applies it. applied[row] marks a row apply() has taken on."""

    batch: ScheduledBatch
    outcomes: list[_Outcome | None]
    accepted: dict[int, int] = dataclasses.field(default_factory=dict)  # speculative: row -> drafts accepted
    verified: dict[int, int] = dataclasses.field(default_factory=dict)  # pipelined: row -> drafts verified
    applied: list[bool] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.applied = [False] * len(self.outcomes)

    @property
    def appended(self) -> list[int]:
        """Per row, the tokens it appends (a pending token not counted)."""
        return [len(o.tokens) if o is not None and o.tokens is not None else 0 for o in self.outcomes]

    @property
    def advances(self) -> list[bool]:
        """Per row, does its request move forward (not a row that failed or whose request finished)?"""
        return [o is not None and (o.finish is None or o.finish[0] != "error") for o in self.outcomes]


class _Ahead:
    """A request as it would be with `tokens` appended (and `text` its output text): what deciding the next
    token of a multi-token row reads, before anything is applied. The counts cost nothing; the token lists,
    read only where the row ends or its decoder is rebuilt, are copied then (not once a token: a step's
    tokens would each copy the whole sequence)."""

    def __init__(self, request: Request, tokens: list[int], text: str) -> None:
        self.request_id, self.params = request.request_id, request.params
        self.eos_token_ids = request.eos_token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.output_text = text
        self._request, self._tokens = request, tokens

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens + len(self._tokens)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self._request.token_ids + self._tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self._request.token_ids[self.num_prompt_tokens:] + self._tokens


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        detokenizer: Detokenizer,
        num_speculative_tokens: int = 0,
        admission: str = "reserve",
        pipelined: bool = False,
        chain_positions: int = 1,
    ) -> None:
        """admission: "greedy" admits a waiting request whenever its next chunk fits, and preempts when the
        running requests outgrow the pool (vLLM's rule); "reserve" admits one only if the free blocks also
        cover what the running requests and it are expected to claim (RESERVE_* above), so that a
        recompute of all T loops is rarely needed. pipelined: speculation runs pipelined in depth-batched
        passes (runner/pipelined_speculation.py): decode rows reserve the positions of up to k tokens in
        flight as above (ScheduledBatch.reserved says how many), each step appends at most one token a row,
        and no step is a speculative one. chain_positions > 1: depth-batched decode rows run several loop
        passes a step (runner/pass_chains.py, runner/speculative_chains.py), so each reserves up to that many
        positions (ScheduledBatch.reserved; its budget spends one token a pass), and a step may append
        several tokens to it, each checked for stops in turn."""
        for name, value in [
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
            ("chain_positions", chain_positions),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Scheduler.{name} must be an integer >= 1, got {value!r}")
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION)}; got {admission!r}")
        self.admission = admission
        self.reserve_ratio = RESERVE_INIT
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.detokenizer = detokenizer
        self.num_speculative_tokens = num_speculative_tokens  # k: the most drafts per decode row and step
        self.pipelined = pipelined
        self.chain_positions = chain_positions
        # Under early:Q and kv_sharing="last" a generated token must finish its loops before the next one
        # starts, so a recomputed request replays its generated tokens one per step, after its prompt.
        self.replay_generated_singly = block_manager.layout.replay_generated_singly
        # request_id -> (incremental decoder, how many output tokens it has been fed)
        self._streams: dict[str, tuple[Callable[[int], str], int]] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self._unfinished: dict[str, Request] = {}
        self._finished: list[Request] = []
        self._unfreed: list[Request] = []  # finished, but freeing their blocks raised: schedule() frees them

    def add(self, request: Request, error: str | None = None) -> None:
        """Queue a request. One that can never run (or that the caller found invalid: `error`) finishes
        at once with finish_reason "error" and is handed back by the next update() or take_finished();
        it never disturbs the others."""
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id} is {request.status.value}, not waiting")
        if request.request_id in self._unfinished:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        error = error or self._admission_error(request)
        if error is not None:
            request.finish("error", error)
            self._finished.append(request)
            return
        self._unfinished[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request with finish_reason "abort"; False if it is not unfinished."""
        request = self._unfinished.get(request_id)
        if request is None:
            return False
        self._finish(request, "abort")
        return True

    def has_unfinished(self) -> bool:
        """True while a request waits, runs, has finished without yet being handed back, or holds blocks
        that the next schedule() frees."""
        return bool(self.waiting or self.running or self._finished or self._unfreed)

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call (by a step, an abort or an error at add), each once."""
        finished, self._finished = self._finished, []
        return finished

    def schedule(self) -> ScheduledBatch:
        """One step: running requests (decode rows before prefill chunks), then newly admitted ones."""
        while self._unfreed:
            self.block_manager.free(self._unfreed[0])
            self._unfreed.pop(0)
        for request in [r for r in self.running if r.pending and self._ends_with_pending(r)]:
            self._retire(request)
        rows: dict[Request, int] = {}
        ahead: dict[Request, int] = {}  # decode rows' reserved positions (speculation, chained passes)
        # the budget a row spends: its drafts under speculation; one token a pass in a chain of passes
        drafts, chains = self.num_speculative_tokens > 0, self.chain_positions > 1

        def spends(request: Request, num_new: int) -> int:
            return ahead.get(request, num_new) if drafts and not chains else num_new

        budget = self.max_num_batched_tokens
        preempted = False
        decodes_first = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in decodes_first:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = self._chunk_len(request, budget)
            decodes = num_new == 1 and request.num_tokens - request.num_computed_tokens == 1
            ahead_here = decodes and (drafts or chains)
            wanted = self.chain_positions if chains else request.draft_len or self.num_speculative_tokens
            if self.pipelined and request.drafts_paused:
                wanted = 1
            reserved = self._room(request, wanted, wanted if chains else budget) if ahead_here else num_new
            if reserved > num_new and not self.block_manager.can_append(request, reserved):
                reserved = num_new  # drafting never preempts anyone
            num_preemptions = self.num_preemptions
            fits = self._make_room(request, reserved, rows)
            if self.num_preemptions != num_preemptions:
                preempted = True
                budget = self.max_num_batched_tokens - sum(spends(r, n) for r, n in rows.items())
            if fits:
                self.block_manager.append_slots(request, reserved)
                rows[request] = num_new
                if ahead_here:
                    ahead[request] = reserved
                budget -= spends(request, num_new)
        if not preempted:  # as vLLM: no admissions in a step that had to preempt
            self._admit_waiting(rows, budget)
        if self.admission == "reserve":
            self.reserve_ratio = RESERVE_INIT if preempted else max(
                RESERVE_FLOOR, self.reserve_ratio - (RESERVE_INIT - RESERVE_FLOOR) / RESERVE_DECAY_STEPS)
        # Speculative only when every row decodes (a prefill chunk runs every loop of its tokens anyway).
        speculative = (bool(rows) and len(ahead) == len(rows) and self.num_speculative_tokens > 0
                       and not self.pipelined)
        return ScheduledBatch(
            requests=list(rows),
            num_new_tokens=list(rows.values()),
            sample=[r.num_computed_tokens + n == r.num_tokens for r, n in rows.items()],
            draft_lens=[ahead[r] for r in rows] if speculative else [],
            reserved=[ahead.get(r, n) for r, n in rows.items()]
            if self.pipelined or chains else [],
        )

    def _room(self, request: Request, wanted: int, budget: int) -> int:
        """How many positions a decode row reserves: `wanted` (k drafts, or the tokens of chained passes), or
        fewer where max_tokens, max_model_len or the step's token budget leave less room (at least 1: the
        token it must produce)."""
        room = min(wanted, self.max_model_len - request.num_tokens, budget)
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        return max(1, room)

    def update(self, batch: ScheduledBatch, sampled: list[int | list[int] | None],
               errors: dict[int, str] | None = None, accepted: dict[int, int] | None = None,
               mid_token: frozenset[int] = frozenset(), verified: dict[int, int] | None = None
               ) -> list[Request]:
        """Advance the batch's requests by one step: decide(), then apply(). Returns every request finished
        since the last hand-back, this step's included."""
        self.apply(self.decide(batch, sampled, errors, accepted, mid_token, verified))
        return self.take_finished()

    def decide(self, batch: ScheduledBatch, sampled: list[int | list[int] | None],
               errors: dict[int, str] | None = None, accepted: dict[int, int] | None = None,
               mid_token: frozenset[int] = frozenset(), verified: dict[int, int] | None = None) -> Decision:
        """Every row's outcome for one step, changing nothing (but the requests' cached incremental
        decoders). sampled[i] is read only where batch.sample[i]: a token, or (a speculative step) the row's
        tokens in order; errors: batch row -> why that row failed in this step (its request finishes with
        "error"); accepted: a speculative step's batch row -> how many of its drafts were accepted, for the
        draft-length schedule (pipelined: how many of its verifications accepted their draft, beside
        `verified`, how many verifications it had: the drafts pause); mid_token: decode rows whose token is
        still between its loops (depth batching): they change nothing, and the next step schedules the same
        position again."""
        if len(sampled) != batch.num_seqs:
            raise ValueError(f"update got {len(sampled)} sampled tokens for {batch.num_seqs} rows")
        errors = errors or {}
        outcomes = [None if row in mid_token and row not in errors else
                    self._decide(request, num_new, sample, token, errors.get(row))
                    for row, (request, num_new, sample, token)
                    in enumerate(zip(batch.requests, batch.num_new_tokens, batch.sample, sampled))]
        return Decision(batch, outcomes, dict(accepted or {}), dict(verified or {}))

    def apply(self, decision: Decision) -> None:
        """Apply a decided step: every row not yet applied, each whatever an earlier one raised (the first
        exception is raised after the last row). A row is marked applied as it is taken on, so calling this
        again after an exception resumes the rest and repeats none."""
        first: BaseException | None = None
        for row, outcome in enumerate(decision.outcomes):
            if outcome is None or decision.applied[row]:
                continue
            decision.applied[row] = True
            try:
                self._apply(outcome)
            except BaseException as err:
                first = err if first is None else first
        for row, (request, drafted) in enumerate(zip(decision.batch.requests, decision.batch.draft_lens)):
            if row in decision.accepted:
                request.draft_len = min(self.num_speculative_tokens, drafted + 2) \
                    if decision.accepted[row] == drafted else max(1, drafted - 1)
        for row, verified in decision.verified.items() if self.pipelined else ():
            if 2 * decision.accepted.get(row, 0) < verified:
                request = decision.batch.requests[row]
                request.draft_resume = request.num_output_tokens + PIPELINED_PAUSE
        if first is not None:
            raise first

    def advance(self, batch: ScheduledBatch, errors: dict[int, str] | None = None) -> None:
        """Apply a launched step before its tokens are read (async scheduling): decide_advance(), then
        apply(). resolve() completes the step."""
        self.apply(self.decide_advance(batch, errors))

    def decide_advance(self, batch: ScheduledBatch, errors: dict[int, str] | None = None) -> Decision:
        """A launched step applied provisionally: every row's computed tokens count and each sampling row's
        token stands pending; a row that failed at launch ends its request with "error"."""
        if batch.draft_lens:
            raise ValueError("a speculative step cannot be applied before its tokens are read")
        errors = errors or {}
        outcomes: list[_Outcome | None] = []
        for row, (request, num_new, sample) in enumerate(zip(batch.requests, batch.num_new_tokens,
                                                             batch.sample)):
            if request.is_finished:
                outcomes.append(None)
            elif row in errors:
                outcomes.append(_Outcome(request, 0, finish=("error", None, errors[row])))
            else:
                outcomes.append(_Outcome(request, num_new, provisional=sample))
        return Decision(batch, outcomes)

    def resolve(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Request]:
        """The tokens of a step applied by advance(): decide_pending(), then apply(). Returns every request
        finished since the last hand-back."""
        self.apply(self.decide_pending(batch, sampled))
        return self.take_finished()

    def decide_pending(self, batch: ScheduledBatch, sampled: list[int | None]) -> Decision:
        """Each sampling row whose request still waits for its token gets update()'s outcome for it, decided
        on the request as it was before the pending token (taken off while deciding, then put back)."""
        rows = {row: r for row, (r, sample) in enumerate(zip(batch.requests, batch.sample))
                if sample and r.pending and not r.is_finished}
        for request in rows.values():
            request.token_ids.pop()
            request.pending = False
        try:
            outcomes = [self._decide(rows[row], 0, True, sampled[row], None) if row in rows else None
                        for row in range(batch.num_seqs)]
        finally:
            for request in rows.values():
                request.token_ids.append(PENDING_TOKEN)
                request.pending = True
        for outcome in outcomes:
            if outcome is not None:
                outcome.resolves = True
        return Decision(batch, outcomes)

    def _ends_with_pending(self, request: Request) -> bool:
        """Does the request finish by length once its pending token is read, whatever that token is? (Its
        position is counted: the rules of _decide_token for the token after the others.)"""
        max_tokens = request.params.max_tokens
        num_output = request.num_output_tokens
        return ((max_tokens is not None and num_output >= max_tokens)
                or request.num_tokens >= self.max_model_len or not self._can_grow(request, num_output))

    def _retire(self, request: Request) -> None:
        """Give back the blocks and seat of a request that finishes when its pending token is read. Steps
        run in order on the device, so the step still writing its K/V finishes before any later one reuses
        them."""
        self.running.remove(request)
        request.retired = True
        self._free(request)

    def _decide(self, request: Request, num_new: int, sample: bool, token: int | None,
                error: str | None) -> _Outcome | None:
        """One row's outcome; changes nothing but the request's cached incremental decoder."""
        if request.is_finished:  # aborted after schedule()
            return None
        if error is not None:
            return _Outcome(request, 0, finish=("error", None, error))
        if not sample:
            return _Outcome(request, num_new)
        if token is None or token == []:
            raise ValueError(f"row of request {request.request_id} samples but got no token")
        tokens = token if isinstance(token, list) else [token]
        try:
            return self._decide_tokens(request, num_new, tokens)
        except _DetokenizerFailed as err:  # this request alone ends
            return _Outcome(request, 0, finish=("error", None, f"detokenizing token {err.token} failed: "
                                                                f"{err}"))

    def _decide_tokens(self, request: Request, num_new: int, tokens: list[int]) -> _Outcome:
        """The row's outcome for its tokens appended in order, up to the first that ends it. A speculative
        row's tokens after the first are each one more computed position (num_new grows by one per token:
        the token before it ran every loop in this step)."""
        state: Request | _Ahead = request
        for i, token in enumerate(tokens):
            try:
                outcome = self._decide_token(state, num_new + i, token)
            except _DetokenizerFailed as err:
                err.token = token
                raise
            if outcome.finish is not None or i == len(tokens) - 1:
                outcome.request, outcome.tokens = request, tokens[:i + 1]
                return outcome
            state = _Ahead(request, tokens[:i + 1], outcome.text)
        raise AssertionError("unreachable")

    def _decide_token(self, request: Request | _Ahead, num_new: int, token: int) -> _Outcome:
        """Stop token, stop string, max_tokens, or no room to grow, for `token` appended. Text grows by the
        token's piece only, and a stop string is searched for only where the new piece could complete it."""
        params = request.params
        skip = params.skip_special_tokens
        # As vLLM, stop tokens and stop strings count only from the token after the first min_tokens.
        may_stop = request.num_output_tokens + 1 > params.min_tokens
        if may_stop and (token in params.stop_token_ids
                         or (not params.ignore_eos and token in request.eos_token_ids)):
            # As vLLM: the stop token's text is left out unless include_stop_str_in_output.
            text_ids = request.output_token_ids + ([token] if params.include_stop_str_in_output else [])
            stop_reason = token if token in params.stop_token_ids else None
            return _Outcome(request, num_new, [token],
                            self._detokenize(self.detokenizer.decode, text_ids, skip),
                            ("stop", stop_reason, None))
        before = len(request.output_text)
        text = request.output_text + self._detokenize(self._piece, request, token)
        if params.stop and may_stop:
            hit = _first_stop(text, params.stop, before)
            if hit is not None:
                start, stop = hit
                end = start + len(stop) if params.include_stop_str_in_output else start
                return _Outcome(request, num_new, [token], text[:end], ("stop", stop, None))
        num_output = request.num_output_tokens + 1
        limit = (params.max_tokens is not None and num_output >= params.max_tokens) or (
            request.num_tokens + 1 >= self.max_model_len)
        if limit or not self._can_grow(request, num_output):
            final = self._detokenize(self.detokenizer.decode, request.output_token_ids + [token], skip)
            # As vLLM, a length ending has no stop_reason; one the KV pool forced says so.
            return _Outcome(request, num_new, [token], final,
                            ("length", None if limit else KV_POOL_FULL, None))
        return _Outcome(request, num_new, [token], text)

    @staticmethod
    def _detokenize(call: Callable[..., str], *args) -> str:
        """call(*args), its failure (not KeyboardInterrupt) as _DetokenizerFailed."""
        try:
            return call(*args)
        except Exception as err:
            raise _DetokenizerFailed(f"{type(err).__name__}: {err}") from err

    def _piece(self, request: Request, token: int) -> str:
        """The text `token` adds after the request's output. The request's decoder is taken out while it is
        fed, so one that a failure left mid-token, or that ran ahead of an update never applied, is rebuilt
        by replaying the output."""
        stream, fed = self._streams.pop(request.request_id, (None, -1))
        if fed != request.num_output_tokens:
            stream = self.detokenizer.stream(skip_special_tokens=request.params.skip_special_tokens)
            for earlier in request.token_ids[request.num_prompt_tokens:]:
                stream(earlier)
        piece = stream(token)
        self._streams[request.request_id] = (stream, request.num_output_tokens + 1)
        return piece

    def _apply(self, outcome: _Outcome) -> None:
        """The request's own state changes first, in plain assignments; prefix-cache registration, which only
        saves compute, cannot keep the outcome's finish from being applied."""
        request = outcome.request
        if request.is_finished:  # aborted since the step was decided
            return
        if outcome.resolves and request.pending:
            request.token_ids.pop()
            request.pending = False
        if outcome.finish is not None and outcome.finish[0] == "error":
            self._finish(request, "error", error=outcome.finish[2], text=request.output_text)
            return
        request.num_computed_tokens += outcome.num_new
        if outcome.tokens is not None:
            request.token_ids += outcome.tokens
        if outcome.provisional:
            request.token_ids.append(PENDING_TOKEN)
            request.pending = True
        if outcome.text is not None:
            request.output_text = outcome.text
        try:
            if not request.retired:  # a retired request's blocks went back already
                self.block_manager.cache_full_blocks(request)
        finally:
            if outcome.finish is not None:
                reason, stop_reason, _ = outcome.finish
                self._finish(request, reason, stop_reason, outcome.text)

    def _admission_error(self, request: Request) -> str | None:
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return "prompt is empty"
        if num_prompt > self.max_model_len:
            return f"prompt has {num_prompt} tokens, more than max_model_len {self.max_model_len}"
        bm = self.block_manager
        needed = bm.layout.blocks_per_sequence(num_prompt, 1)
        if needed > bm.num_blocks:
            return (
                f"prompt has {num_prompt} tokens; with one generated token it needs {needed} KV blocks "
                f"of {bm.block_size} tokens, more than the whole pool's {bm.num_blocks}"
            )
        return None

    def _chunk_len(self, request: Request, budget: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.replay_generated_singly:
            prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            num_new = min(num_new, prompt_left if prompt_left > 0 else 1)
        return num_new

    def _make_room(self, request: Request, num_new: int, rows: dict[Request, int]) -> bool:
        """Preempt the most recently admitted requests until `request` can grow by num_new tokens.
        False when `request` itself had to go."""
        while not self.block_manager.can_append(request, num_new):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:  # add() rejects these; never loop on one
                self._finish(request, "error", error="request does not fit in the KV pool even alone")
                return False
            self._preempt(victim)
            rows.pop(victim, None)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _expected_blocks(self, request: Request, num_new: int = 0) -> int:
        """Blocks the request is expected to claim beyond those it holds: its uncomputed tokens (num_new more
        for one being admitted) and the reserve ratio of its remaining output budget."""
        params = request.params
        limit = self.max_model_len - request.num_tokens
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens)
        pending = max(num_new, request.num_tokens - request.num_computed_tokens)
        expected = pending + math.ceil(self.reserve_ratio * min(max(limit, 0), RESERVE_CLIP))
        return sum(self.block_manager.layout.missing_blocks(request, expected))

    def _admit_waiting(self, rows: dict[Request, int], budget: int) -> None:
        bm = self.block_manager
        reserved = None  # admission="reserve": blocks the running requests are expected to claim
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_cached = bm.allocate(request)
            request.num_computed_tokens = num_cached
            num_new = self._chunk_len(request, budget)
            if not bm.can_append(request, num_new):  # FCFS: nobody overtakes the head of the queue
                needed = sum(bm.layout.missing_blocks(request, num_new))
                bm.free(request)
                request.num_computed_tokens = 0
                if self.running:  # they will free blocks
                    return
                # Nothing runs, so no block will ever come back: waiting would be forever.
                self._finish(request, "error", error=(
                    f"cannot be scheduled: its first {num_new} tokens need {needed} KV blocks, only "
                    f"{bm.num_free_blocks} of the pool's {bm.num_blocks} are free, and no running request "
                    f"holds the other {bm.num_blocks - bm.num_free_blocks}"))
                continue
            # Into an idle pool the head always goes (else it could wait forever); after it the reserve holds.
            if self.admission == "reserve" and self.running:
                if reserved is None:
                    reserved = sum(self._expected_blocks(r) for r in self.running)
                if self._expected_blocks(request, num_new) + reserved > bm.num_free_blocks:
                    bm.free(request)  # it would likely force a preemption later: wait for blocks to free
                    request.num_computed_tokens = 0
                    return
            bm.append_slots(request, num_new)
            if reserved is not None:
                reserved += self._expected_blocks(request, num_new)  # beyond the blocks it now holds
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            rows[request] = num_new
            budget -= num_new

    def _can_grow(self, request: Request, num_output: int) -> bool:
        """Would one more token still fit in the whole pool, were this request alone with num_output
        generated tokens?"""
        bm = self.block_manager
        needed = bm.layout.blocks_per_sequence(request.num_prompt_tokens, num_output + 1)
        return needed <= bm.num_blocks

    def _finish(
        self,
        request: Request,
        reason: str,
        stop_reason: int | str | None = None,
        text: str | None = None,
        error: str | None = None,
    ) -> None:
        if request.pending:  # aborted while its last token was still on the device: it never arrives
            request.token_ids.pop()
            request.pending = False
        if text is None:  # decided before anything changes: a failing detokenizer keeps the streamed text
            try:
                text = self.detokenizer.decode(request.output_token_ids,
                                               skip_special_tokens=request.params.skip_special_tokens) \
                    if request.num_output_tokens else ""
            except Exception:
                text = request.output_text
        if not request.retired:  # a retired request gave its seat and blocks back already
            (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        del self._unfinished[request.request_id]
        self._streams.pop(request.request_id, None)
        request.output_text = text
        request.stop_reason = stop_reason
        request.finish(reason, error)
        self._finished.append(request)
        if not request.retired:
            self._free(request)

    def _free(self, request: Request) -> None:
        """Free the request's blocks; if that raises, the next schedule() frees them."""
        try:
            self.block_manager.free(request)
        except BaseException:
            self._unfreed.append(request)
            raise


def _first_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """The earliest (start, stop string) in text that ends after position new_from, else None."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start >= 0 and (best is None or start < best[0]):
            best = (start, stop)
    return best
