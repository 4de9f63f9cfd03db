"""Next-token sampling: the logits processors that read a request's tokens (min_tokens, then the
repetition, frequency and presence penalties), then greedy argmax, or temperature / top-k / top-p / min-p
with exponential-noise (Gumbel-max) sampling, with per-request seeded generators; and logprobs in vLLM's
shape.

argmax(p / E), E ~ Exp(1), draws from p exactly; it needs no host sync and no torch.multinomial.
A temperature below request.GREEDY_BELOW is greedy, as in vLLM: logits / 1e-39 overflow fp32 to inf and
the softmax to NaN.
Per-row parameters reach the device from pinned memory without a blocking copy (`_per_row`): a blocking one
would wait for every queued step, which async scheduling must not.
Logprobs are of the raw model distribution (vLLM's default, logprobs_mode="raw_logprobs"): log_softmax
of the readout logits before temperature and the filters, so they do not change with the sampling knobs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from request import Logprob, Request, SamplingParams
from runner.host_to_device import to_device


def _per_row(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A per-row parameter vector on `device`, copied without waiting for the device's queued work."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Row r's logits [R, V] under requests[r]'s min_tokens and penalties, in vLLM's order (min_tokens, then
    penalties); float32 where any row changes, else `logits` itself. Greedy rows are processed too."""
    suppress = [_stop_ids_to_suppress(r) for r in requests]
    penalized = [r.params.penalized for r in requests]
    if not any(suppress) and not any(penalized):
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    for row, ids in enumerate(suppress):
        ids = [t for t in ids if t < vocab]
        if ids:
            logits[row, ids] = float("-inf")
    rows = [i for i, p in enumerate(penalized) if p]
    if rows:
        chosen = [requests[i] for i in rows]
        prompts, outputs = [r.prompt_token_ids for r in chosen], [r.output_token_ids for r in chosen]
        logits[rows] = apply_penalties(logits[rows], [r.params for r in chosen], prompts, outputs)
    return logits


def _stop_ids_to_suppress(request: Request) -> list[int]:
    """The tokens that would stop a request still short of min_tokens (vLLM's MinTokensLogitsProcessor)."""
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else request.eos_token_ids
    return [*params.stop_token_ids, *eos]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                    output_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's penalties on logits [R, V] float32: repetition over the prompt and the output (a seen token's
    logit divided by the penalty when positive, multiplied when not), then frequency (penalty x the token's
    count in the output) and presence (penalty once per token in the output) subtracted."""
    device, (rows, vocab) = logits.device, logits.shape
    output_counts = _token_counts(output_ids, rows, vocab, device)
    seen = (output_counts > 0) | (_token_counts(prompt_ids, rows, vocab, device) > 0)
    repetition = _per_row([p.repetition_penalty for p in params], device)[:, None]
    penalty = torch.where(seen, repetition, 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    frequency = _per_row([p.frequency_penalty for p in params], device)[:, None]
    presence = _per_row([p.presence_penalty for p in params], device)[:, None]
    return logits - frequency * output_counts - presence * (output_counts > 0)


def _token_counts(token_ids: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's list (padding counts in an extra
    column, dropped)."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((rows, width), vocab, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        padded[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    counts = torch.zeros(rows, vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(rows, width, device=device))
    return counts[:, :vocab]


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as vLLM applies them. logits: [R, V] float32. A greedy
    row divides by 1 (its draw is replaced by the argmax)."""
    temperature = _per_row([1.0 if p.greedy else p.temperature for p in params], logits.device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k = _per_row(top_k, logits.device, torch.int64)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        p = _per_row(top_p, logits.device)[:, None]
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        probs = logits.softmax(-1)
        floor = _per_row(min_p, logits.device)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of logits [R, V]."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    probs = apply_filters(logits.float(), params).softmax(-1)
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    drawn = (probs / noise).argmax(dim=-1)
    is_greedy = _per_row([p.greedy for p in params], logits.device, torch.bool)
    return torch.where(is_greedy, greedy, drawn)


@dataclasses.dataclass(slots=True)
class TopLogprobs:
    """Per row: a given token, its logprob and 1-based rank, and the n most likely tokens with their logprobs.
    token_ids [R] and token_ranks [R] int64, token_logprobs [R] float32, top_ids [R, n] int64, top_logprobs
    [R, n] float32."""

    token_ids: torch.Tensor
    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def logprobs_topn(logits: torch.Tensor, token_ids: torch.Tensor, n: int) -> TopLogprobs:
    """log_softmax of logits [R, V] in fp32: each row's token_ids[r] logprob and rank (1 + the number of
    tokens strictly more likely, as vLLM counts it), and the top n."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long()[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(n, dim=-1)
    return TopLogprobs(token_ids.long(), chosen.squeeze(1), ranks, top.indices, top.values)


def logprob_dicts(top: TopLogprobs, counts: list[int],
                  token_text: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """Row r as vLLM's {token id: Logprob}: the given token first, then the top counts[r] (a token in both
    appears once). `top` must hold at least max(counts) top tokens."""
    rows = zip(top.token_ids.tolist(), top.token_logprobs.tolist(), top.token_ranks.tolist(),
               top.top_ids.tolist(), top.top_logprobs.tolist(), counts)
    out = []
    for token, logprob, rank, ids, logprobs, n in rows:
        entry = {token: Logprob(logprob, rank, token_text(token) if token_text else None)}
        for i, (other, value) in enumerate(zip(ids[:n], logprobs[:n])):
            if other not in entry:
                entry[other] = Logprob(value, i + 1, token_text(other) if token_text else None)
        out.append(entry)
    return out
