"""What the server answers: OpenAI's completion and chat completion objects, whole or as server-sent-event
chunks, built from the engine's cumulative RequestOutputs. ChoiceStream keeps what each choice has sent, so a
stream and a whole response come from the same code; logprobs take OpenAI's two shapes (the legacy
completions one, which lm-eval reads, and chat's), and a requested loop trace rides along per token."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from model.tokenizer import Tokenizer
from exit_policy import LoopTrace
from request import CompletionOutput, Logprob, RequestOutput
from server.protocol import Plan

# vLLM's floor for a logprob in JSON, which has no -inf.
LOGPROB_FLOOR = -9999.0


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclasses.dataclass(slots=True)
class Delta:
    """What one choice adds in one chunk (all of it in a whole response). prompt_*: the echoed prompt, in the
    choice's first chunk only; entries: per new token its logprob dict (None without logprobs)."""

    index: int
    text: str
    token_ids: list[int]
    entries: list[dict[int, Logprob]] | None
    traces: list[LoopTrace] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_entries: list[dict[int, Logprob] | None] | None = None


@dataclasses.dataclass(slots=True)
class _Sent:
    text: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False
    offset: int = 0  # the text offset of the next token in the legacy logprobs (echoed prompt included)


class ChoiceStream:
    """The choices of one HTTP request: prompt i's completion j is choice i * n + j (vLLM's order). While a
    choice runs, text that could still turn out to begin a stop string (the last len(longest stop) - 1
    characters) is held back, as vLLM holds it, since the engine cuts a stop string from the final text."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.n = plan.params.n
        self.hold = max((len(s) for s in plan.params.stop), default=1) - 1
        self.sent = [_Sent() for _ in range(len(plan.prompts) * self.n)]
        self.outputs: list[RequestOutput | None] = [None] * len(plan.prompts)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sent)

    def update(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        """The deltas of prompt `prompt_index`'s choices that have something new in `output`."""
        self.outputs[prompt_index] = output
        deltas = []
        for completion in output.outputs:
            delta = self._delta(prompt_index * self.n + completion.index, output, completion)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _delta(self, index: int, output: RequestOutput, completion: CompletionOutput) -> Delta | None:
        sent, plan = self.sent[index], self.plan
        if sent.finished:
            return None
        finished = completion.finish_reason is not None
        hidden = plan.hide_generated
        text = "" if hidden else completion.text
        token_ids = [] if hidden else completion.token_ids
        end = len(text) if finished else max(sent.text, len(text) - self.hold)
        new_tokens = token_ids[sent.tokens:]
        if sent.started and not finished and end == sent.text and not new_tokens:
            return None
        entries = None
        if plan.logprobs is not None:
            entries = [] if hidden else (completion.logprobs or [])[sent.tokens:len(token_ids)]
        traces = None
        if plan.params.loop_trace:
            traces = [] if hidden else (completion.traces or [])[sent.tokens:len(token_ids)]
        delta = Delta(index, text[sent.text:end], new_tokens, entries, traces,
                      completion.finish_reason if finished else None,
                      completion.stop_reason if finished else None, first=not sent.started)
        if delta.first and plan.echo:
            delta.prompt_token_ids = output.prompt_token_ids
            delta.prompt_entries = output.prompt_logprobs if plan.logprobs is not None else None
        sent.text, sent.tokens, sent.started, sent.finished = end, len(token_ids), True, finished
        return delta

    def usage(self) -> dict[str, int]:
        """OpenAI's usage: prompt tokens (each prompt once, whatever n) and generated tokens so far."""
        prompt = sum(len(p.token_ids) for p in self.plan.prompts)
        completion = 0 if self.plan.hide_generated else sum(
            len(c.token_ids) for out in self.outputs if out is not None for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -- /v1/completions ------------------------------------------------------------------------------------

def completion_choice(delta: Delta, stream: ChoiceStream, tokenizer: Tokenizer) -> dict[str, Any]:
    """One choice of a text_completion object (or of a chunk of one)."""
    sent = stream.sent[delta.index]
    text = delta.text
    logprobs = None
    if delta.entries is not None:
        token_ids, entries = delta.token_ids, list(delta.entries)
        if delta.first and stream.plan.echo:
            token_ids = delta.prompt_token_ids + token_ids
            entries = list(delta.prompt_entries or []) + entries
        logprobs, sent.offset = legacy_logprobs(token_ids, entries, sent.offset, tokenizer)
    if delta.first and stream.plan.echo:
        prompt = stream.plan.prompts[delta.index // stream.n]
        text = prompt.text + text
    choice = {"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
              "stop_reason": delta.stop_reason}
    if delta.traces is not None:
        choice["loop_trace"] = [trace_json(t) for t in delta.traces]
    return choice


def legacy_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], offset: int,
                    tokenizer: Tokenizer) -> tuple[dict[str, list], int]:
    """The completions API's logprobs: per token its text, its logprob, {text: logprob} of it and the top N
    (None for the prompt's first token, which nothing predicts), and its character offset; and the offset
    after the last token."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry.get(token) if entry is not None else None
        text = chosen.decoded_token if chosen is not None else tokenizer.token_text(token)
        tokens.append(text)
        token_logprobs.append(clamp(chosen.logprob) if chosen is not None else None)
        top_logprobs.append({lp.decoded_token: clamp(lp.logprob) for lp in entry.values()}
                            if entry is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, offset


def completion_response(request_id: str, model: str, choices: list[dict], usage: dict | None,
                        created: int | None = None, loops: int | None = None) -> dict[str, Any]:
    """A text_completion object; loops: the loops the request's tokens ran (echoed where given)."""
    body = {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model, "choices": choices}
    if loops is not None:
        body["loops"] = loops
    if usage is not None:
        body["usage"] = usage
    return body


# -- /v1/chat/completions ---------------------------------------------------------------------------------

def chat_choice(delta: Delta, stream: ChoiceStream, whole: bool) -> dict[str, Any]:
    """One choice of a chat.completion (whole: its message) or of a chat.completion.chunk (its delta)."""
    logprobs = None
    if delta.entries is not None:
        logprobs = {"content": [chat_logprob(token, entry, stream.plan.logprobs)
                                for token, entry in zip(delta.token_ids, delta.entries)]}
    if whole:
        content = {"message": {"role": "assistant", "content": delta.text}}
    else:
        content = {"delta": {"role": "assistant", "content": delta.text} if delta.first
                   else ({"content": delta.text} if delta.text else {})}
    choice = {"index": delta.index, **content, "logprobs": logprobs, "finish_reason": delta.finish_reason,
              "stop_reason": delta.stop_reason}
    if delta.traces is not None:
        choice["loop_trace"] = [trace_json(t) for t in delta.traces]
    return choice


def chat_logprob(token: int, entry: dict[int, Logprob], top: int) -> dict[str, Any]:
    """Chat's logprob of one token: its own, and the `top` most likely tokens by rank."""
    chosen = entry[token]
    ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
    return {**_chat_token(chosen), "top_logprobs": [_chat_token(lp) for lp in ranked]}


def _chat_token(logprob: Logprob) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    return {"token": text, "logprob": clamp(logprob.logprob), "bytes": list(text.encode())}


def chat_response(request_id: str, model: str, choices: list[dict], usage: dict | None, chunk: bool,
                  created: int | None = None, loops: int | None = None) -> dict[str, Any]:
    """A chat.completion object (or chunk); loops: the loops the request's tokens ran (echoed where given)."""
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created or int(time.time()), "model": model, "choices": choices}
    if loops is not None:
        body["loops"] = loops
    if usage is not None:
        body["usage"] = usage
    return body


def trace_json(trace: LoopTrace) -> dict[str, Any]:
    """One token's loop trace: exit pdf per loop run, exit loop, each loop's top token and its logprob."""
    return {"exit_pdf": trace.exit_pdf, "exit_loop": trace.exit_loop, "top_token_ids": trace.top_token_ids,
            "top_logprobs": [clamp(lp) for lp in trace.top_logprobs]}
