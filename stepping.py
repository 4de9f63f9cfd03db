"""One engine iteration, in one of two ways chosen once when the engine is built (as vLLM's step_fn):
SyncStepper schedules a step, runs it and applies its tokens; OverlappedStepper (async scheduling) schedules
and launches the next step before it waits for this one's tokens. Each step returns the requests it advanced
or finished; their outputs are outputs.py's business.

A step is decided, then applied in full. schedule() and the commit run with Ctrl-C deferred
(runner/interrupts.py), and the commit is safe for any exception besides: until the point of no return (the
scheduler has decided every row's outcome and the runner's undo record is taken), a failure applies nothing,
and the runner undoes what its run changed (seeded generators, loop counters); after it, every part of the
application runs whatever an earlier part raised, a part that raised is resumed before the next step runs
(run_parts, settle), what the step touched is handed back, and only then is the first exception raised. So no
finished output is lost and no seeded request samples with a generator out of step with its tokens. What
schedule() decided (admissions, block allocations, preemptions) stands: each is a consistent state that the
next schedule() starts from, and none changes a request's tokens, text or logprobs. A failure of one request
(its sampling, its detokenizing) finishes it alone with finish_reason "error".
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Callable

from outputs import OutputBook
from request import Request, ScheduledBatch
from runner.interrupts import deferred_interrupts
from runner.model_runner import LaunchedStep, ModelRunner, StepResult
from scheduler.scheduler import Scheduler


class Stepper(ABC):
    """What both ways of stepping share: running a batch whose tokens the host waits for, applying a step
    (commit), and resuming the parts of an applied step that raised. Counts the prompt and decode tokens the
    steps computed."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputBook) -> None:
        self.scheduler, self.runner, self.outputs = scheduler, runner, outputs
        self.unsettled: list[Callable[[], None]] = []  # parts of an applied step that raised (run_parts)
        self.num_prefill_tokens = self.num_decode_tokens = 0

    @abstractmethod
    def step(self) -> list[Request]:
        """One iteration; the requests that advanced or finished in it, after those finished earlier whose
        outputs never reached a caller. A caller that fails to deliver them calls
        OutputBook.requeue_handed_back()."""

    def busy(self) -> bool:
        """Is part of an applied step (or, overlapped, a launched one) still to be completed?"""
        return bool(self.unsettled)

    def _begin(self) -> None:
        """The last step's hand-back is delivered; resume what of its application raised."""
        self.outputs.handed_back = []
        with deferred_interrupts():
            self.settle()

    def run_now(self, batch: ScheduledBatch, touched: list[Request] | None = None) -> list[Request]:
        """Run the batch, wait for its tokens and apply it; hand back what it touched, after `touched` (an
        earlier part of this step's)."""
        result = None
        if batch.requests:
            try:
                result = self.runner.run(batch)
            except BaseException:
                self.runner.rollback()
                raise
        try:
            with deferred_interrupts():
                return self.commit(batch, result, touched or [])
        except BaseException:  # before the point of no return: nothing applied; after it: rollback is a no-op
            self.runner.rollback()
            self.outputs.requeue_handed_back()
            raise

    def commit(self, batch: ScheduledBatch, result: StepResult | None,
               touched: list[Request]) -> list[Request]:
        """Apply the step and hand back the requests it advanced or finished, after `touched`. Deciding every
        row's outcome changes nothing; once the runner's undo record is taken, the step is applied in full
        (run_parts)."""
        if result is None:
            return self.conclude(touched, self.scheduler.take_finished())
        decode = [r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests]
        before = [r.num_tokens for r in batch.requests]
        mid_token = result.mid_token_rows
        accepted = {row: sum(check[1] for check in checks if check) for row, checks in result.drafts.items()}
        verified = {row: sum(1 for check in checks if check) for row, checks in result.drafts.items()}
        decision = self.scheduler.decide(batch, result.tokens, result.errors, accepted, mid_token, verified)
        staged = self.runner.take_staged()  # the point of no return
        self.count_tokens(batch, set(result.errors) | mid_token, decode, decision.appended)
        error = self.run_parts([functools.partial(self.scheduler.apply, decision),
                                functools.partial(self.runner.commit, result, staged, decision.appended,
                                                  decision.advances)])
        advanced = [r for r, n in zip(batch.requests, before) if r.num_tokens > n or r.is_finished]
        return self.conclude(touched + advanced, self.scheduler.take_finished(), error)

    def count_tokens(self, batch: ScheduledBatch, skip: set[int], decode: list[bool],
                     appended: list[int] | None = None) -> None:
        """Count the step's prompt and decode tokens, but for the rows in `skip`; decode[row]: was the row a
        decode row before the step; appended[row]: the tokens it appends (a decode row that appends several,
        speculative or of chained passes, computed as many)."""
        for row, (is_decode, num_new) in enumerate(zip(decode, batch.num_new_tokens)):
            if row not in skip:
                if is_decode:
                    self.num_decode_tokens += max(num_new, appended[row]) if appended else num_new
                else:
                    self.num_prefill_tokens += num_new

    def run_parts(self, parts: list[Callable[[], None]],
                  error: BaseException | None = None) -> BaseException | None:
        """Run every part of an applied step, each whatever an earlier one raised. A part that raises is kept
        to be resumed before the next step (settle); each part is safe to run again (Scheduler.apply and
        ModelRunner.commit skip what they have taken on; a release repeats nothing). Returns the first
        exception, `error` if one came before."""
        for part in parts:
            try:
                part()
            except BaseException as err:
                self.unsettled.append(part)
                error = err if error is None else error
        return error

    def settle(self) -> None:
        """Resume the parts of an applied step that raised, before anything else runs (KV blocks, seeded
        generators and outputs are then as if nothing had); one that raises again stays, and is raised."""
        parts, self.unsettled = self.unsettled, []
        error = self.run_parts(parts)
        if error is not None:
            raise error

    def conclude(self, touched: list[Request], finished: list[Request],
                 error: BaseException | None = None) -> list[Request]:
        """The end of an applied step: release the finished requests, hand back the touched ones and the
        finished ones not among them, then raise `error` (what a part of the step raised) or the first
        exception of a release."""
        error = self.run_parts([functools.partial(self.release, r) for r in finished], error)
        seen = {id(r) for r in touched}
        handed = self.outputs.hand_back(touched + [r for r in finished if id(r) not in seen])
        if error is not None:
            raise error
        return handed

    def release(self, request: Request) -> None:
        """A finished request gives back its runner state; its id stays in use until it has."""
        self.runner.release(request)
        self.outputs.release(request)


class SyncStepper(Stepper):
    def step(self) -> list[Request]:
        """Schedule a step, run it, wait for its tokens and apply them."""
        self._begin()
        with deferred_interrupts():
            batch = self.scheduler.schedule()
        return self.run_now(batch)


class OverlappedStepper(Stepper):
    """Async scheduling: schedule and launch the next step before waiting for this one's tokens, so the host's
    work (this step's update and outputs, the next one's scheduling and inputs) runs while the device
    computes. The next step's rows whose last token is still on the device read it there
    (runner/model_runner.py); the scheduler applies a launched step provisionally (advance) and then with its
    tokens (resolve), with update()'s rules, so each request gets the tokens the synchronous path gives it. A
    step whose rows read their tokens on the host (penalties, logprobs, traces) runs synchronously once the
    one ahead of it is resolved. step() hands back what the step it resolves touched: the same step it would
    synchronously, one more already running behind it."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputBook) -> None:
        super().__init__(scheduler, runner, outputs)
        self.pending: LaunchedStep | None = None  # the step launched ahead, unresolved

    def busy(self) -> bool:
        pending = self.pending
        return super().busy() or (pending is not None
                                  and not all(r.is_finished for r in pending.batch.requests))

    def step(self) -> list[Request]:
        """Launch a step if none runs ahead; schedule and launch the next; resolve the one ahead of it."""
        self._begin()
        if self.pending is None:
            with deferred_interrupts():
                batch = self.scheduler.schedule()
            if not (batch.requests and self._launchable(batch)):
                return self.run_now(batch)
            launched = self.runner.launch(batch)
            try:
                with deferred_interrupts():
                    self._advance(launched)
            except BaseException:  # not applied (once it is, it is the pending step, and kept)
                if self.pending is not launched:
                    self.runner.drop(launched)
                raise
        pending = self.pending
        with deferred_interrupts():
            batch = self.scheduler.schedule()
        launched = self.runner.launch(batch, pending) if batch.requests and self._launchable(batch) else None
        try:
            with deferred_interrupts():
                touched = self._resolve(pending)
                if launched is not None:
                    self._advance(launched)
        except BaseException:  # what was resolved is handed back by the next step (Engine._advance)
            if launched is not None and self.pending is not launched:
                self.runner.drop(launched)
            raise
        if launched is None and batch.requests:  # run it now, without the rows whose requests just finished
            return self.run_now(batch.without_finished(), touched)
        return touched

    def _launchable(self, batch: ScheduledBatch) -> bool:
        """Can the batch run ahead of its tokens? Not where a row reads tokens or logits on the host, nor a
        step the runner cannot launch (ModelRunner.launchable)."""
        if not self.runner.launchable(batch):
            return False
        for request in batch.requests:
            p = request.params
            if p.penalized or p.logprobs is not None or p.prompt_logprobs is not None or p.loop_trace:
                return False
        return True

    def _advance(self, launched: LaunchedStep) -> None:
        """Apply a launched step provisionally (its tokens pending) and make it the one to resolve next; once
        decided, it is the pending step whatever applying it raises (the rest is resumed by settle)."""
        batch = launched.batch
        # Rows of requests that finished meanwhile (a stop in the step before) ran for nothing: not counted,
        # as the synchronous path never runs them.
        skipped = set(launched.result.errors) | {row for row, r in enumerate(batch.requests) if r.is_finished}
        decode = [r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests]
        decision = self.scheduler.decide_advance(batch, launched.result.errors)
        self.pending = launched  # the point of no return
        self.count_tokens(batch, skipped, decode)
        error = self.run_parts([functools.partial(self.scheduler.apply, decision)])
        if error is not None:
            raise error

    def _resolve(self, launched: LaunchedStep) -> list[Request]:
        """Wait for a launched step's tokens and apply them; hand back the requests it advanced or
        finished."""
        result = self.runner.finish(launched)
        batch = launched.batch
        waiting = [r for r, samples in zip(batch.requests, batch.sample) if samples and r.pending]
        decision = self.scheduler.decide_pending(batch, result.tokens)
        self.pending = None  # the point of no return
        error = self.run_parts([functools.partial(self.scheduler.apply, decision),
                                functools.partial(self.runner.commit, result, launched.staged,
                                                  decision.appended, decision.advances)])
        return self.conclude([r for r in waiting if not r.pending], self.scheduler.take_finished(), error)
