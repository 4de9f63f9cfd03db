"""The fp8_e4m3 KV codec: how a K/V value is stored in and read from an 8-bit float cache, with one fp32
scale per (slot, kv head). Stored = round-to-nearest-even of clamp(x / scale, -448, 448) in float8_e4m3fn
(the clamp first: e4m3fn has no infinity, and a cast past 448 gives NaN); read = stored * scale. The Triton
kernels do the same arithmetic in fp32, so every backend stores the same values (the sign of a zero aside).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in fp8_e4m3, saturated at +-448; scale broadcasts against x (per kv head: [kv_heads, 1])."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return codes.float() * scale
