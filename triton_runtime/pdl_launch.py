"""A launch cache for kernels whose last parameter is `PDL: tl.constexpr`: it hands the choice of Programmatic
Dependent Launch on a device (triton_runtime/pdl.py: the mechanism, its rules and where it is on) both to the
kernel, as that constexpr, and to its launch."""

from __future__ import annotations

import torch

from triton_runtime.launch import LaunchCache
from triton_runtime.pdl import pdl_supported
from triton_runtime.stream import current_stream


class PdlLaunchCache:
    """triton_runtime/launch.py's LaunchCache for a kernel whose last parameter is `PDL: tl.constexpr`:
    appends it to the arguments and launches with `launch_pdl` where it is on."""

    def __init__(self, fn, **options) -> None:
        self.caches = {False: LaunchCache(fn, **options), True: LaunchCache(fn, launch_pdl=True, **options)}

    def __call__(self, grid: tuple[int, ...], args: tuple, num_warps: int, device: torch.device) -> None:
        pdl = pdl_supported(device)
        self.caches[pdl](grid, args + (pdl,), num_warps, current_stream(device))
