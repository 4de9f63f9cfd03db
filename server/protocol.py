"""What a request may say: OpenAI's /v1/completions and /v1/chat/completions bodies (with vLLM's extra
sampling fields and this engine's loop controls), checked field by field and turned into token-id prompts
and one SamplingParams. Every refusal is an APIError 400 naming the field; nothing here changes the engine."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from engine import Engine
from exit_policy import request_policy
from request import SamplingParams
from server.errors import bad_request, from_sampling_error

# The most logprobs a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
LOOP_FIELDS = "loops, exit_policy, loop_trace"  # per request; every response echoes the loops it ran


class OpenAIBody(BaseModel):
    """Strict: a string is no number and a bool no integer, and an unknown field is refused by name (vLLM
    ignores it with a warning; a misspelt loop control would then pass silently)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class SamplingFields(OpenAIBody):
    """The fields both endpoints share: OpenAI's, vLLM's extra sampling fields, and the loop controls."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # The looped model's controls (docs/looped_controls.md)
    loops: int | None = None
    exit_policy: str | None = None
    loop_trace: bool = False


class CompletionRequest(SamplingFields):
    prompt: Any  # a string, token ids, or a list of either: checked by completion_prompts
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None


class ChatMessage(OpenAIBody):
    role: str
    content: Any = None  # a string or a list of text parts: checked by chat_prompt
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt as the engine gets it (token ids) and as echo shows it (its text)."""

    token_ids: list[int]
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A checked request: its prompts, one SamplingParams for each, and what the response leaves out."""

    prompts: list[PromptInput]
    params: SamplingParams
    echo: bool = False
    hide_generated: bool = False  # echo with max_tokens 0: the engine samples one token, which is dropped
    logprobs: int | None = None  # per token, the top N in the response (None: no logprobs)
    loops: int | None = None  # the loops its tokens run (SamplingParams.loops, else the engine's): echoed


def parse_body(model: type[OpenAIBody], body: Any) -> Any:
    """The JSON body as `model`, or a 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"])[1:]
        if first["type"] == "extra_forbidden":
            raise bad_request(f"unknown field {where!r}: this server takes OpenAI's fields, vLLM's extra "
                              f"sampling fields and the loop controls ({LOOP_FIELDS})", field) from None
        raise bad_request(f"{where}: {first['msg']}, got {first.get('input')!r:.100}", field) from None


def completion_plan(req: CompletionRequest, engine: Engine) -> Plan:
    """/v1/completions: prompts, parameters and the echo rules (echo with max_tokens 0 returns the prompt's
    logprobs alone, as vLLM does)."""
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of={req.best_of} is not supported: it must equal n ({req.n})", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    hide_generated = req.echo and req.max_tokens == 0
    max_tokens = 1 if hide_generated else req.max_tokens
    prompts = completion_prompts(req.prompt, engine)
    params = sampling_params(req, engine, max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=req.logprobs if req.echo else None)
    for i, prompt in enumerate(prompts):
        check_length(prompt, max_tokens, engine, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    return Plan(prompts, params, req.echo, hide_generated, req.logprobs, engine.request_loops(params))


def chat_plan(req: ChatCompletionRequest, engine: Engine) -> Plan:
    """/v1/chat/completions: the conversation through the checkpoint's chat template."""
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                              "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = chat_prompt(req, engine)
    params = sampling_params(req, engine, max_tokens, logprobs=logprobs, prompt_logprobs=None,
                             renames={"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"})
    check_length(prompt, max_tokens, engine, "messages")
    return Plan([prompt], params, logprobs=logprobs, loops=engine.request_loops(params))


def sampling_params(req: SamplingFields, engine: Engine, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, renames: dict[str, str] | None = None) -> SamplingParams:
    """One SamplingParams for every prompt of the request, checked as the engine checks it at add_request."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    try:
        params = SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            loop_trace=req.loop_trace, exit_policy=req.exit_policy, loops=req.loops)
        request_policy(params.exit_policy, engine.exit_policy, engine.request_loops(params))
    except ValueError as err:
        raise from_sampling_error(err, renames) from None
    return params


def completion_prompts(prompt: Any, engine: Engine) -> list[PromptInput]:
    """A string, a list of token ids, or a non-empty list of strings or token-id lists."""
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        items = prompt
    else:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of strings or "
                          f"of token-id lists, got {prompt!r:.100}", "prompt")
    tokenizer = engine.tokenizer
    prompts = []
    for i, item in enumerate(items):
        name = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            prompts.append(PromptInput(tokenizer.encode(item), item))
            continue
        bad = [t for t in item if not 0 <= t < engine.config.vocab_size]
        if bad:
            raise bad_request(f"{name}: token id {bad[0]} is outside the vocabulary (vocab_size "
                              f"{engine.config.vocab_size})", "prompt")
        prompts.append(PromptInput(list(item), tokenizer.decode(item, skip_special_tokens=False)))
    return prompts


def chat_prompt(req: ChatCompletionRequest, engine: Engine) -> PromptInput:
    """The conversation rendered by the checkpoint's chat template (ChatML if it has none), tokenized."""
    messages = []
    for i, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, list):
            parts = [part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
                     for part in content]
            if None in parts or not all(isinstance(p, str) for p in parts):
                raise bad_request(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                  "...}) are supported", "messages")
            content = "\n".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts, got "
                              f"{content!r:.100}", "messages")
        messages.append({"role": message.role, "content": content})
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    kwargs = req.chat_template_kwargs or {}
    try:
        text = engine.tokenizer.apply_chat_template(messages, req.add_generation_prompt, **kwargs)
    except (ValueError, TypeError) as err:
        raise bad_request(f"messages: {err}", "messages") from None
    return PromptInput(engine.tokenizer.encode(text), text)


def check_length(prompt: PromptInput, max_tokens: int | None, engine: Engine, name: str) -> None:
    """vLLM's rule: the prompt plus max_tokens must fit max_model_len (a 400, not a shortened answer)."""
    limit, length, field = engine.max_model_len, len(prompt.token_ids), name.split("[")[0]
    if length == 0:
        raise bad_request(f"{name} is empty: the model needs at least one token to continue", field)
    completion = max_tokens or 1
    if length + completion > limit:
        if length < limit:
            field = "max_completion_tokens" if field == "messages" else "max_tokens"
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{length + completion} tokens ({length} in the {name}, {completion} in the "
                          "completion). Please reduce the length of the prompt or completion.", field)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

