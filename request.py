"""The types every package shares: SamplingParams (vLLM's names and meanings), the Request state machine, the
ScheduledBatch a step runs, and what a request gives back (RequestOutput).

This module is the leaf of the import graph but for exit_policy.py (the exit policies its SamplingParams
name and the loop traces its outputs carry), so the scheduler, the KV cache and the step runner can all speak
of requests without importing each other.

WAITING -> RUNNING -> FINISHED; a preempted request goes back to WAITING and is recomputed.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from typing import Any

from exit_policy import LoopTrace, TraceTensors, parse_exit_policy, stack_traces

# How the scheduler admits waiting requests (scheduler/scheduler.py: Scheduler's admission).
ADMISSION = ("reserve", "greedy")
# Under async scheduling, a token sampled on the device and not yet read stands at the end of token_ids as
# this id (Request.pending), until the step that sampled it is resolved; the runner feeds the real token
# from the device to the next step (runner/model_runner.py).
PENDING_TOKEN = -1


# -- sampling parameters ----------------------------------------------------------------------------

GREEDY_BELOW = 1e-5  # vLLM's rule: a temperature below this is greedy (dividing by it would overflow fp32)
MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """vLLM's sampling fields and meanings. temperature < 1e-5 (0 included) is greedy; top_k 0 or -1 and
    top_p 1 disable those filters. n > 1 samples n sequences from one prompt; with a seed, sample i uses
    seed + i (as vLLM does). Penalties (vLLM's semantics, applied before temperature and the filters):
    repetition_penalty divides a positive logit (multiplies a negative one) of every token seen in the
    prompt or the output; frequency_penalty subtracts penalty x count and presence_penalty subtracts penalty
    once, for each token in the output. min_tokens: stop tokens, EOS and stop strings take effect only
    after that many generated tokens.

    The fields may be set after construction, as in vLLM: validate() runs at construction and again when a
    request is added (Engine.add_request, generate, stream), which queues a checked copy, so a later change
    to these params never reaches a queued request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # per generated token: its logprob and the top N (runner/sampler.py)
    prompt_logprobs: int | None = None  # per prompt token after the first: the same, given the tokens before
    loop_trace: bool = False  # per token: exit pdf, exit loop, each loop's top token (LoopTrace)
    exit_policy: str | None = None  # readout-only override: full | threshold:Q | step:K | weighted | hf[:Q]
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # The loops every token of this request runs, reading out after the last of them (Huginn's num_steps per
    # request); at most the Engine's loops, which is checked when the request is added. None: the Engine's.
    loops: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it); `stop` becomes a list of strings, `stop_token_ids` a list
        of ids, each a new list."""
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0:
            raise ValueError("SamplingParams.top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_int("n", self.n, low=1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
            if self.seed + self.n - 1 > MAX_SEED:
                raise ValueError(f"SamplingParams.seed must be at most 2**64 - n = {MAX_SEED - self.n + 1} "
                                 f"(torch.Generator's range; sample i of n uses seed + i), got {self.seed}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be at most max_tokens "
                             f"({self.max_tokens})")
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty == 0:
            raise ValueError("SamplingParams.repetition_penalty must be > 0, got 0")
        for name in ("ignore_eos", "include_stop_str_in_output", "loop_trace", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not (stop is None or isinstance(stop, (list, tuple))
                and all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, got "
                             f"{self.stop!r}")
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids (integers >= 0), "
                             f"got {self.stop_token_ids!r}")
        self.stop, self.stop_token_ids = list(stop or []), list(self.stop_token_ids or [])
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        if self.loops is not None:  # at most the Engine's loops: checked when the request is added
            _check_int("loops", self.loops, low=1)
        if self.exit_policy is not None:  # the loop count is checked by the engine
            parse_exit_policy(self.exit_policy, name="SamplingParams.exit_policy")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """True when a penalty changes the logits (they need the request's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"SamplingParams.{name} must be {bound}, got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"SamplingParams.{name} must be an integer >= {low}, got {value!r}")


# -- requests -----------------------------------------------------------------------------------------

class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_request_counter = itertools.count()


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One sequence: its prompt, its generated tokens, and where it is in the state machine.

    token_ids is the whole sequence (prompt, then generated tokens), one list appended in place, so no step
    rebuilds it. num_computed_tokens counts tokens whose K/V sit in the pool; block_table lists the blocks
    that hold them (one table for all loop x layer slots); generated_block_table holds the pages of
    generated tokens under a KV layout that stores them apart (cache/layout.py).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None  # the prompt's text, when it was given as text
    token_ids: list[int] = dataclasses.field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = dataclasses.field(default_factory=list)
    generated_block_table: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    output_text: str = ""  # the generated text so far, detokenized incrementally
    arrival: int = dataclasses.field(default_factory=lambda: next(_request_counter))
    num_preemptions: int = 0
    traces: list[Any] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)  # one per output token
    prompt_logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)  # prompt tokens 1..
    speculative: SpeculativeStats | None = None  # its drafts, under speculative decoding
    depth: DepthStats | None = None  # its tokens' loops and loop passes, under depth batching
    draft_len: int = 0  # what its next speculative step drafts at most (scheduler/scheduler.py); 0: not yet
    # Pipelined speculation (scheduler/scheduler.py): the output token count from which it drafts again
    draft_resume: int = 0
    # A KVarN pool's side rows (cache/side_rows.py): the blocks whose side blocks it holds, and per block of
    # block_table the side block it may read (-1: none); under kv_sharing="last" also per generated tile its
    # side tile (-1: none)
    side_held: list[int] = dataclasses.field(default_factory=list)
    side_table: list[int] = dataclasses.field(default_factory=list)
    generated_side_table: list[int] = dataclasses.field(default_factory=list)
    # Async scheduling (scheduler/scheduler.py): token_ids ends with PENDING_TOKEN, a token still on the
    # device; and `retired`: certain to finish once that token is read, it gave its blocks and its seat back
    # ahead of it, as the synchronous path would have before the next step
    pending: bool = False
    retired: bool = False
    # The seed of its tokens' drawn initial states, for a model that draws them (runner/initial_states.py):
    # SamplingParams.seed, else one drawn when it is added. It salts the prefix cache's block hashes, since
    # its K/V depends on it. None: the model draws none.
    state_seed: int | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, a pending one included (it holds a position)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def drafts_paused(self) -> bool:
        """Under pipelined speculation: does it decode without drafts for now (Scheduler.apply)?"""
        return self.num_output_tokens < self.draft_resume

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens known on the host (a pending one left out)."""
        return self.token_ids[len(self.prompt_token_ids):len(self.token_ids) - self.pending]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error


@dataclasses.dataclass(slots=True)
class ScheduledBatch:
    """One step. Row i computes num_new_tokens[i] tokens of requests[i], at positions
    num_computed_tokens .. num_computed_tokens + num_new_tokens[i] - 1 (block_table already covers
    them), and samples a next token only where sample[i]: its chunk reaches the end of token_ids."""

    requests: list[Request] = dataclasses.field(default_factory=list)
    num_new_tokens: list[int] = dataclasses.field(default_factory=list)
    sample: list[bool] = dataclasses.field(default_factory=list)
    # A speculative decode step (docs/speculative.md) only: every row decodes, and row i drafts up to
    # draft_lens[i] tokens, whose positions its block table already covers. Empty: an ordinary step.
    draft_lens: list[int] = dataclasses.field(default_factory=list)
    # Speculation pipelined in depth-batched passes (runner/pipelined_speculation.py) only: per row, how many
    # positions from num_computed_tokens on its block table covers in this step, which bounds the tokens it
    # may have in flight. Empty: an ordinary step.
    reserved: list[int] = dataclasses.field(default_factory=list)

    def without_finished(self) -> ScheduledBatch:
        """The batch without the rows of requests that finished since it was scheduled."""
        if not any(r.is_finished for r in self.requests):
            return self
        return self.select([i for i, r in enumerate(self.requests) if not r.is_finished])

    def select(self, rows: list[int]) -> ScheduledBatch:
        """These rows of the batch, in order."""
        return ScheduledBatch([self.requests[i] for i in rows], [self.num_new_tokens[i] for i in rows],
                              [self.sample[i] for i in rows],
                              [self.draft_lens[i] for i in rows] if self.draft_lens else [],
                              [self.reserved[i] for i in rows] if self.reserved else [])

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


# -- what comes back ----------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class Logprob:
    """vLLM's Logprob: a token's log-probability under the raw model distribution (log_softmax of the
    readout logits, before temperature and the top-k/top-p/min-p filters), its 1-based rank there, and
    its text decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    error: str | None = None
    traces: list[LoopTrace] | None = None  # one per token with SamplingParams(loop_trace=True)
    # SamplingParams(logprobs=N): per token, {token id: Logprob}, the sampled token first, then the top N.
    logprobs: list[dict[int, Logprob]] | None = None
    speculative: SpeculativeStats | None = None  # drafts made and accepted, under speculative decoding
    depth: DepthStats | None = None  # loops and loop passes per token, under depth batching

    def trace_tensors(self) -> TraceTensors:
        """The traces stacked into tensors."""
        return stack_traces(self.traces or [])


@dataclasses.dataclass(slots=True)
class SpeculativeStats:
    """Drafts of self-speculative decoding (docs/speculative.md), summed over steps: at draft position i of a
    step (0-based), proposed[i] drafts were made and accepted[i] of them were accepted. A step that drafts
    k tokens and accepts a of them appends a + 1 tokens (k when a = k)."""

    steps: int = 0
    tokens: int = 0  # tokens the steps yielded (before any stop cut them short)
    proposed: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)

    def add(self, num_drafted: int, num_accepted: int) -> None:
        grow = num_drafted - len(self.proposed)
        if grow > 0:
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        self.steps += 1
        self.tokens += num_accepted + (num_accepted < num_drafted)
        for i in range(num_drafted):
            self.proposed[i] += 1
            self.accepted[i] += i < num_accepted

    def copy(self) -> SpeculativeStats:
        return SpeculativeStats(self.steps, self.tokens, list(self.proposed), list(self.accepted))

    def merge(self, other: SpeculativeStats) -> None:
        for i, (p, a) in enumerate(zip(other.proposed, other.accepted)):
            if i == len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[i] += p
            self.accepted[i] += a
        self.steps += other.steps
        self.tokens += other.tokens

    @property
    def num_drafted(self) -> int:
        return sum(self.proposed)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafts made (NaN before any)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else math.nan

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position i: accepted[i] / proposed[i]."""
        return [a / p if p else math.nan for p, a in zip(self.proposed, self.accepted)]

    @property
    def tokens_per_step(self) -> float:
        """Tokens a speculative step yields: its accepted drafts, plus the target's token where it rejected
        one (NaN before any step)."""
        return self.tokens / self.steps if self.steps else math.nan


@dataclasses.dataclass(slots=True)
class DepthStats:
    """A request's generated tokens under depth batching (Engine(depth_batching=True)), summed: the loops they
    ran, and the loop passes they spanned, from the pass each token started in to the one it finished in
    (one pass per loop, unless a row waited a step unscheduled). A pass runs every decode row's own next
    loop, so the engine's passes (LoopStats.decode_passes) are fewer than the requests' loops together. Under
    pipelined speculation a token's passes count from the later of its start and its predecessor's finish
    (runner/pipelined_speculation.py), so an accepted draft's token counts d passes, not T."""

    tokens: int = 0
    loops: int = 0
    passes: int = 0

    def add(self, loops: int, passes: int) -> None:
        self.tokens += 1
        self.loops += loops
        self.passes += passes

    def copy(self) -> DepthStats:
        return DepthStats(self.tokens, self.loops, self.passes)

    @property
    def loops_per_token(self) -> float:
        return self.loops / self.tokens if self.tokens else math.nan

    @property
    def passes_per_token(self) -> float:
        return self.passes / self.tokens if self.tokens else math.nan


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """vLLM's shape: one per request, outputs[0] the completion so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # SamplingParams(prompt_logprobs=N): None for the first prompt token, then as CompletionOutput.logprobs.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
