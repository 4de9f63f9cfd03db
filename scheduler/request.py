"""SamplingParams (vLLM's names and meanings), the Request state machine, and RequestOutput.

WAITING -> RUNNING -> FINISHED; a preempted request goes back to WAITING and is recomputed.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """vLLM's sampling fields. temperature 0 means greedy; top_k 0 or -1 and top_p 1 disable those filters."""

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
    logprobs: int | None = None  # per generated token: its logprob and the top N (model/sampler.py)
    prompt_logprobs: int | None = None  # per prompt token after the first: the same, given the tokens before
    loop_trace: bool = False  # per token: exit pdf, exit loop, each loop's top token (model/exit_policy.py)
    exit_policy: str | None = None  # readout-only override: full | threshold:Q | step:K | weighted

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0:
            raise ValueError("SamplingParams.top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        if self.exit_policy is not None:
            from model.exit_policy import parse_exit_policy  # the loop count is checked by the engine

            parse_exit_policy(self.exit_policy, name="SamplingParams.exit_policy")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"SamplingParams.{name} must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"SamplingParams.{name} must be {bound}, got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"SamplingParams.{name} must be an integer >= {low}, got {value!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_request_counter = itertools.count()


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One sequence: its prompt, its generated tokens, and where it is in the state machine.

    num_computed_tokens counts tokens whose K/V sit in the pool; block_table lists the blocks
    that hold them (one table for all loop x layer slots).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = dataclasses.field(default_factory=list)
    generated_block_table: list[int] = dataclasses.field(default_factory=list)  # kv_sharing="last" pages
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    output_text: str = ""
    arrival: int = dataclasses.field(default_factory=lambda: next(_request_counter))
    num_preemptions: int = 0
    traces: list[Any] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)  # one per output token
    prompt_logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)  # prompt tokens 1..

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error


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
    traces: list[Any] | None = None  # LoopTrace per token with SamplingParams(loop_trace=True)
    # SamplingParams(logprobs=N): per token, {token id: Logprob}, the sampled token first, then the top N.
    logprobs: list[dict[int, Logprob]] | None = None

    def trace_tensors(self):
        """The traces stacked into tensors (model.exit_policy.TraceTensors)."""
        from model.exit_policy import stack_traces

        return stack_traces(self.traces or [])


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
