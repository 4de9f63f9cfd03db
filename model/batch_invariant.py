"""Torch ops whose result for one row never depends on the other rows of the call: the layer's projections,
norms and activation for Engine(deterministic=True) on the torch ops path (the CPU).

What torch's CPU ops allow (MKL, measured with torch 2.14; tests/test_batch_invariant_ops.py pins each):
- A matrix product's per-element sum order depends on its shape: F.linear of 1, 2-8 and 16+ rows takes
  three kernels, and the output width N changes the order of a matrix-vector product too. A product of a
  fixed shape, though, gives the same bits whatever the other rows hold, whatever the batch count of a bmm
  and whatever the thread count. So a projection row here is one matrix-vector product of the weight's
  fixed shape: one bmm of [1, K] x [K, N] per row, the weight expanded without a copy.
- Elementwise silu, sigmoid and rsqrt round differently in the vectorized body of a tensor and its scalar
  tail, so an element's bits depend on where it sits in the flattened tensor; exp, sqrt, division, cos and
  sin do not. So silu is x / (1 + exp(-x)) and the norm divides by a square root.
- A row sum goes through the same per-row matrix-vector product (a norm's sum of squares: [1, H] x [H, 1]).
Attention's tiles are attention/tiled_reference.py's; row-wise log_softmax (the sampler's) is per row already.
"""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), each row of x [..., K] by itself: one [1, K] x [K, N] product a row, the
    operands always in one memory layout (MKL's kernel, and so its sum order, follows the layout too): a
    contiguous row, and the [N, K] weight's transpose as a view."""
    shape = x.shape
    rows = x.reshape(-1, 1, shape[-1]).contiguous()
    y = torch.bmm(rows, weight.t().expand(rows.shape[0], -1, -1)).view(*shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def row_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [..., 1]: each row's sum of squares, one [1, H] x [H, 1] product a row, as linear's."""
    rows = x.reshape(-1, 1, x.shape[-1]).contiguous()
    return torch.bmm(rows, rows.transpose(1, 2)).view(*x.shape[:-1], 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (normalise in fp32, cast back, then scale by the weight), row by row."""
    xf = x.float()
    mean_square = row_sum_of_squares(xf) / xf.shape[-1]
    return weight * (xf / torch.sqrt(mean_square + eps)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)): exp and division round the same wherever an element sits."""
    return x / (1.0 + torch.exp(-x))
