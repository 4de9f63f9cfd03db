"""Tolerances derived from rounding, not tuned to one build or machine.

Where a result has an exact answer (the same math in fp64) and a plain oracle that computes it in the same
precision, the result must be no farther from the exact answer than NOISE_FACTOR times the oracle is: both
round the same arithmetic, in different orders (other BLAS blockings, fused kernels, another torch build),
so their errors are of one size. A few units in the last place of the answer's scale are allowed on top, for
answers that the oracle happens to round exactly.
"""

from __future__ import annotations

import torch

NOISE_FACTOR = 4.0
FLOOR_ULPS = 4


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp at 1: the largest relative error of one round-to-nearest in `dtype` (2^-24 for fp32,
    2^-11 for fp16, 2^-8 for bf16)."""
    return torch.finfo(dtype).eps / 2


def noise_bound(oracle: torch.Tensor, exact: torch.Tensor) -> float:
    """NOISE_FACTOR x max |oracle - exact|, plus FLOOR_ULPS ulps (in the oracle's dtype) of max |exact|."""
    noise = (oracle.double() - exact.double()).abs().max().item()
    return NOISE_FACTOR * noise + FLOOR_ULPS * torch.finfo(oracle.dtype).eps * exact.abs().max().item()


def assert_within_noise(got: torch.Tensor, oracle: torch.Tensor, exact: torch.Tensor, what: str = "") -> None:
    """max |got - exact| <= noise_bound(oracle, exact): `got` is no farther from the exact answer than the
    oracle in the same precision is, times NOISE_FACTOR."""
    error = (got.double() - exact.double()).abs().max().item()
    bound = noise_bound(oracle, exact)
    oracle_error = (oracle.double() - exact.double()).abs().max().item()
    assert error <= bound, (f"{what}: max |got - exact| = {error:.3g} > {bound:.3g} "
                            f"(the oracle's own error is {oracle_error:.3g})")
