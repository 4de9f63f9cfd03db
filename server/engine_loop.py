"""The one thread that drives the Engine. HTTP handlers run on the event loop; the Engine is not thread-safe,
so every call into it (add_request, abort, step, close) happens on this thread, which takes commands from a
queue between steps and hands each step's outputs back to the event loop, one callback a step. It bounds
the requests it holds (one more is refused with QueueFull, which the server answers 429) and refuses new ones
once draining (ShuttingDown, 503)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from engine import Engine
from request import RequestOutput, SamplingParams


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Mailbox:
    """Where a submission's outputs arrive, on the event loop: per prompt only the latest (each output holds
    everything so far, so a newer one replaces one not yet read, and a slow reader holds one per prompt), or
    the exception that failed it, which nothing replaces."""

    def __init__(self) -> None:
        self.latest: dict[int, RequestOutput | BaseException] = {}
        self.arrived = asyncio.Event()

    def put(self, index: int, item: RequestOutput | BaseException) -> None:
        if not isinstance(self.latest.get(index), BaseException):
            self.latest[index] = item
        self.arrived.set()

    async def take(self) -> list[tuple[int, RequestOutput | BaseException]]:
        """Wait for something, then take all that arrived, as (prompt index, output or exception)."""
        await self.arrived.wait()
        self.arrived.clear()
        items, self.latest = list(self.latest.items()), {}
        return items


@dataclasses.dataclass(slots=True, eq=False)
class Submission:
    """One HTTP request's engine requests (one per prompt), the mailbox their outputs arrive in, and the event
    loop it belongs to."""

    request_ids: list[str]
    mailbox: Mailbox
    loop: asyncio.AbstractEventLoop


@dataclasses.dataclass(slots=True)
class LoopStats:
    """Counts since the loop started: requests admitted, finished (by their own stop or length), aborted (a
    client that left, or shutdown), failed (finish_reason "error"), refused because the queue was full."""

    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    refused: int = 0


class EngineLoop:
    """Owns the Engine from start() to stop(). submit() and abort() are called from the event loop;
    call(fn) runs fn(engine) on the engine thread between steps (for tests and statistics)."""

    def __init__(self, engine: Engine, max_pending_requests: int) -> None:
        if not isinstance(max_pending_requests, int) or max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be a positive integer, got {max_pending_requests!r}")
        self.engine = engine
        self.max_pending_requests = max_pending_requests
        self.stats = LoopStats()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _pending and stats between the two threads
        self._pending = 0  # engine requests submitted and not yet finished
        self._routes: dict[str, tuple[Submission, int]] = {}  # engine thread only
        self._ids = itertools.count()
        self._draining = False  # set from a signal handler too: a plain store, no lock
        self._stopping = False
        self.leaked_blocks: int | None = None  # KV blocks held when the Engine closed (None: not closed yet)
        self.failure: str | None = None  # why the engine loop stopped on its own (a step raised)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    @property
    def pending(self) -> int:
        """Engine requests the loop holds now, waiting or running."""
        return self._pending

    @property
    def draining(self) -> bool:
        return self._draining

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Submission:
        """Queue one engine request per prompt, all or none: QueueFull if they do not all fit under
        max_pending_requests, ShuttingDown once draining. Called on the event loop."""
        with self._lock:
            if self._draining or self._stopping:
                raise ShuttingDown("the server is shutting down and takes no new requests")
            if self._pending + len(prompts) > self.max_pending_requests:
                self.stats.refused += 1
                raise QueueFull(f"the server holds {self._pending} requests, and takes at most "
                                f"{self.max_pending_requests} at once (--max-pending-requests); retry later")
            self._pending += len(prompts)
            self.stats.admitted += len(prompts)
            ids = [f"srv-{next(self._ids)}" for _ in prompts]
            submission = Submission(ids, Mailbox(), asyncio.get_running_loop())
            self._send("add", (submission, prompts, params))  # under the lock: never after stop() began
        return submission

    def abort(self, submission: Submission) -> None:
        """Abort the submission's unfinished requests (their KV blocks are freed by the next step)."""
        self._send("abort", submission)

    def abort_all(self) -> None:
        """Abort every request in flight; each answers finish_reason "abort" (shutdown's grace has ended)."""
        self._send("abort_all", None)

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """fn(engine) on the engine thread, between two steps; its result (or exception) in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (fn, future))
        return future

    def drain(self) -> None:
        """Take no new requests from now on; those in flight go on. Safe inside a signal handler."""
        self._draining = True

    def stop(self, timeout: float | None = None) -> None:
        """Abort whatever is still in flight, let the engine hand back their outputs (freeing every block),
        close the Engine and end the thread. Idempotent."""
        self._draining = True
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------------

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wake.clear()
                self._take_commands()
                if self._stopping:
                    self._abort_all()
                busy = engine.has_unfinished()
                if busy:
                    self._route(engine.step())
                elif self._stopping:
                    break
                else:
                    self._wake.wait()
        except Exception as err:  # the engine is broken: fail every request, refuse new ones (503)
            self.failure = f"{type(err).__name__}: {err}"
            self._draining = True
            print("loop-engine serve: the engine loop stopped; the requests in flight fail:", file=sys.stderr)
            traceback.print_exc()
            self._fail_all(err)
        finally:
            with self._lock:
                self._stopping = True
            self._take_commands(refuse=True)
            manager = engine.block_manager
            self.leaked_blocks = manager.num_blocks - manager.num_free_blocks
            engine.close()

    def _take_commands(self, refuse: bool = False) -> None:
        """Run the queued commands; with `refuse` (the loop is ending), fail queued requests instead."""
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and refuse:
                submission = payload[0]
                for index in range(len(submission.request_ids)):
                    self._finish_one(failed=True)
                    self._deliver([(submission, (index, ShuttingDown("the server stopped")))])
            elif kind == "add":
                self._add(*payload)
            elif kind == "abort":
                for request_id in payload.request_ids:
                    if request_id in self._routes:
                        self.engine.abort(request_id)
            elif kind == "abort_all":
                self._abort_all()
            else:
                fn, future = payload
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:
                    future.set_exception(err)

    def _add(self, submission: Submission, prompts: list[list[int]], params: SamplingParams) -> None:
        for index, (request_id, prompt) in enumerate(zip(submission.request_ids, prompts)):
            try:
                self.engine.add_request({"prompt_token_ids": prompt}, params, request_id)
            except (ValueError, RuntimeError) as err:
                self._finish_one(failed=True)
                self._deliver([(submission, (index, err))])
                continue
            self._routes[request_id] = (submission, index)

    def _route(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            submission, index = route
            if output.finished:
                del self._routes[output.request_id]
                reasons = {c.finish_reason for c in output.outputs}
                self._finish_one(aborted="abort" in reasons, failed="error" in reasons)
            batch.append((submission, (index, output)))
        self._deliver(batch)

    def _finish_one(self, aborted: bool = False, failed: bool = False) -> None:
        with self._lock:
            self._pending -= 1
            if failed:
                self.stats.failed += 1
            elif aborted:
                self.stats.aborted += 1
            else:
                self.stats.finished += 1

    @staticmethod
    def _deliver(batch: list[tuple[Submission, tuple[int, Any]]]) -> None:
        """Put each item in its submission's mailbox, one event-loop callback per loop (not per item)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for submission, item in batch:
            by_loop.setdefault(submission.loop, []).append((submission.mailbox, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass

    def _abort_all(self) -> None:
        for request_id in list(self._routes):
            self.engine.abort(request_id)

    def _fail_all(self, err: BaseException) -> None:
        batch = []
        for request_id, (submission, index) in list(self._routes.items()):
            self._finish_one(failed=True)
            batch.append((submission, (index, RuntimeError(f"the engine failed: {err}"))))
        self._routes.clear()
        self._deliver(batch)


def _put_all(items: list[tuple[Mailbox, tuple[int, Any]]]) -> None:
    for mailbox, (index, item) in items:
        mailbox.put(index, item)
