"""Next-token sampling: greedy argmax, or temperature / top-k / top-p / min-p with exponential-noise
(Gumbel-max) sampling, with per-request seeded generators.

argmax(p / E), E ~ Exp(1), draws from p exactly; it needs no host sync and no torch.multinomial.
"""

from __future__ import annotations

import torch

from request import SamplingParams


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
