"""A launch cache for the model's kernels that hands the choice of Programmatic Dependent Launch on a device
(attention/pdl.py: the mechanism, its rules and where it is on) both to the kernel, as its PDL constexpr,
and to its launch."""

from __future__ import annotations

import torch

from attention.launch import LaunchCache
from attention.pdl import pdl_supported
from attention.workspace import current_stream


class PdlLaunchCache:
    """attention/launch.py's LaunchCache for a kernel whose last parameter is `PDL: tl.constexpr`: appends it
    to the arguments and launches with `launch_pdl` where it is on."""

    def __init__(self, fn, **options) -> None:
        self.caches = {False: LaunchCache(fn, **options), True: LaunchCache(fn, launch_pdl=True, **options)}

    def __call__(self, grid: tuple[int, ...], args: tuple, num_warps: int, device: torch.device) -> None:
        pdl = pdl_supported(device)
        self.caches[pdl](grid, args + (pdl,), num_warps, current_stream(device))
