"""Next-token sampling: greedy argmax, or temperature / top-k / top-p / min-p with exponential-noise
(Gumbel-max) sampling, with per-request seeded generators; and logprobs in vLLM's shape.

argmax(p / E), E ~ Exp(1), draws from p exactly; it needs no host sync and no torch.multinomial.
Logprobs are of the raw model distribution (vLLM's default, logprobs_mode="raw_logprobs"): log_softmax
of the readout logits before temperature and the filters, so they do not change with the sampling knobs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from request import Logprob, SamplingParams


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as vLLM applies them. logits: [R, V] float32."""
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k = torch.tensor(top_k, device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        p = torch.tensor(top_p, device=logits.device)[:, None]
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        probs = logits.softmax(-1)
        floor = torch.tensor(min_p, device=logits.device)[:, None] * probs.max(-1, keepdim=True).values
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
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
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
