"""The engine's output bookkeeping: which call reads each request's outputs, and each finished output handed
out once. A request is a SequenceGroup of its n sampled sequences (one scheduler Request each), held in the
inbox of the call that reads it (generate(), a stream(), or step()); what a step hands back waits here until
it has reached those inboxes. Also generate()'s progress bar, which counts the groups' tokens. It never
schedules or runs anything (stepping.py and engine.py do).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import sys
import time

from request import CompletionOutput, Request, RequestOutput, SamplingParams
from runner.interrupts import deferred_interrupts


@dataclasses.dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request as its caller sees it: the n sequences sampled from its prompt (one scheduler Request
    each), and the inbox of the call that reads its outputs (generate(), a stream(), or step())."""

    request_id: str
    requests: list[Request]
    inbox: dict[str, SequenceGroup]

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.requests)


# A call's groups whose requests advanced or finished since it last looked, by request id, oldest first.
Inbox = dict[str, SequenceGroup]


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The scheduler ids of a request's n sequences: its own id when n == 1, else vLLM's f"{i}_{id}"."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s own parameters: n = 1 and, with a seed, seed + index (vLLM's derivation, so
    sample i of a seeded request is reproducible on its own)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def take_all(inbox: Inbox) -> list[SequenceGroup]:
    groups = list(inbox.values())
    inbox.clear()
    return groups


def request_output(group: SequenceGroup) -> RequestOutput:
    """The group's RequestOutput as it stands: every completion so far."""
    first = group.requests[0]
    params = first.params
    completions = [CompletionOutput(index, r.output_text, r.output_token_ids, r.finish_reason,
                                    r.stop_reason, r.error, list(r.traces) or None,
                                    list(r.logprobs) if params.logprobs is not None else None,
                                    r.speculative.copy() if r.speculative is not None else None,
                                    r.depth.copy() if r.depth is not None else None)
                   for index, r in enumerate(group.requests)]
    prompt_logprobs = [None, *first.prompt_logprobs] if params.prompt_logprobs is not None else None
    return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions,
                         group.finished, first.num_cached_tokens, prompt_logprobs)


class OutputBook:
    """Every request between add_request() (or generate(), stream()) and the caller's reading of its last
    output: the ids in use, each group by request and sequence id, step()'s inbox, and what a step handed
    back until it is delivered."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}  # every sequence the scheduler may still hand back, by id
        self.groups: dict[str, SequenceGroup] = {}  # by request id, until its finished output is handed out
        self.group_of: dict[str, SequenceGroup] = {}  # by sequence id, as long as the group
        self.step_inbox: Inbox = {}  # add_request()'s groups, read by step()
        self.unreported: list[Request] = []  # finished, but their outputs never reached a caller
        self.handed_back: list[Request] = []  # what the last step returned, until it was delivered
        self._ids = itertools.count()

    def has_unread(self) -> bool:
        """Does step() have an output it has not handed out, or a finished request one to hand back?"""
        return bool(self.step_inbox) or bool(self.unreported)

    # -- ids -----------------------------------------------------------------------------------------

    def id_is_free(self, request_id: str, n: int) -> bool:
        """Neither the id nor its sequences' ids name a request, sequence or unread group."""
        return all(i not in self.requests and i not in self.groups and i not in self.group_of
                   for i in (request_id, *sequence_ids(request_id, n)))

    def new_ids(self, ns: list[int]) -> list[str]:
        """Automatic ids for requests of ns[i] sequences: the counter's next values, skipping any a caller
        chose, so an automatic id never clashes. Digit strings, so they never clash with each other's
        sequence ids (f"{i}_{id}") either."""
        ids = []
        for n in ns:
            request_id = str(next(self._ids))
            while not self.id_is_free(request_id, n):
                request_id = str(next(self._ids))
            ids.append(request_id)
        return ids

    def open_group(self, request_id: str, inbox: Inbox) -> SequenceGroup:
        """A new group, its outputs for `inbox`; its sequences join it with track()."""
        self.groups[request_id] = group = SequenceGroup(request_id, [], inbox)
        return group

    def track(self, group: SequenceGroup, request: Request) -> None:
        group.requests.append(request)
        self.requests[request.request_id] = request
        self.group_of[request.request_id] = group

    def release(self, request: Request) -> None:
        """A finished request's id may name a new one (once its group's output is read too)."""
        self.requests.pop(request.request_id, None)

    # -- a step's requests to the inboxes ------------------------------------------------------------

    def hand_back(self, touched: list[Request]) -> list[Request]:
        """A step's touched requests, after those finished earlier whose outputs never reached a caller."""
        touched, self.unreported = self.unreported + touched, []
        self.handed_back = touched
        return touched

    def requeue_handed_back(self) -> None:
        """The last step's requests did not reach their inboxes: its finished ones come back next step."""
        with deferred_interrupts():
            self.unreported += [r for r in self.handed_back if r.is_finished]
            self.handed_back = []

    def deliver(self, touched: list[Request]) -> None:
        """Put the group of each request that advanced or finished into the inbox of the call that reads
        it. A request whose group is gone (its call ended and aborted it) goes nowhere."""
        for request in touched:
            group = self.group_of.get(request.request_id)
            if group is not None and request in group.requests:
                group.inbox[group.request_id] = group

    # -- inboxes to the caller -----------------------------------------------------------------------

    def hand_out_all(self, inbox: Inbox) -> list[RequestOutput]:
        """Every group in the inbox as an output; the inbox is emptied only once all are built, so an
        exception while building them leaves them for the next call."""
        groups = list(inbox.values())
        outputs = [request_output(group) for group in groups]
        taken: list[tuple[SequenceGroup, bool]] = []
        try:
            with deferred_interrupts():
                for group, output in zip(groups, outputs):
                    inbox.pop(group.request_id, None)
                    if output.finished:
                        self.forget(group)
                    taken.append((group, output.finished))
        except BaseException:  # a Ctrl-C deferred to the block's end: the outputs never reach the caller
            with deferred_interrupts():
                for group, forgotten in taken:
                    if forgotten:
                        self.remember(group)
                    inbox[group.request_id] = group
            raise
        return outputs

    def hand_out(self, group: SequenceGroup) -> RequestOutput:
        """The group's output; once it has finished, the group is forgotten (its ids become free)."""
        output = request_output(group)
        if output.finished:
            self.forget(group)
        return output

    def forget(self, group: SequenceGroup) -> None:
        del self.groups[group.request_id]
        for request in group.requests:
            del self.group_of[request.request_id]
        group.inbox.pop(group.request_id, None)

    def remember(self, group: SequenceGroup) -> None:
        """Undo forget: the group's output is to be handed out again."""
        self.groups[group.request_id] = group
        for request in group.requests:
            self.group_of[request.request_id] = group


class TokenProgress:
    """generate()'s progress bar, in generated tokens (tqdm shows tok/s). Its total starts at the most each
    request may generate (n x max_tokens, capped by max_model_len) and drops by what a request leaves unused
    when it finishes, so the bar moves with the tokens and ends at 100%."""

    def __init__(self, groups: list[SequenceGroup], max_model_len: int, prompt_tokens: int) -> None:
        """prompt_tokens: the engine's count of prompt tokens computed so far, for the prompt tok/s."""
        self.budget = {g.request_id: sum(_token_budget(r, max_model_len) for r in g.requests) for g in groups}
        self.counted = dict.fromkeys(self.budget, 0)
        self.bar = progress_bar_class()(total=sum(self.budget.values()), desc="generating", unit="tok",
                                        dynamic_ncols=True)
        self.start, self.prompt_tokens0 = time.perf_counter(), prompt_tokens

    def advance(self, group: SequenceGroup) -> None:
        done = sum(r.num_output_tokens for r in group.requests)
        new = done - self.counted[group.request_id]
        self.counted[group.request_id] = done
        if group.finished:
            self.bar.total -= self.budget[group.request_id] - done
        self.bar.update(new)

    def show_prompt_rate(self, prompt_tokens: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"prompt {(prompt_tokens - self.prompt_tokens0) / elapsed:.0f} tok/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def _token_budget(request: Request, max_model_len: int) -> int:
    room = max(max_model_len - request.num_prompt_tokens, 0)
    return room if request.params.max_tokens is None else min(request.params.max_tokens, room)


def progress_bar_class() -> type:
    """tqdm's notebook widget inside a Jupyter kernel that has ipywidgets, else the plain text bar: without
    ipywidgets, tqdm.auto warns ("IProgress not found") and draws no widget."""
    ipython = sys.modules.get("IPython")  # a Jupyter kernel has imported it; a script need not
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and "IPKernelApp" in getattr(shell, "config", {}) \
            and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm
    else:
        from tqdm import tqdm
    return tqdm
