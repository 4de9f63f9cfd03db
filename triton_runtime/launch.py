"""A Triton kernel launched directly once compiled: the first call goes through Triton's JIT, which
compiles or finds the variant for these argument types; later calls skip the JIT's per-call argument
binding and launch the compiled kernel. Used by the attention backend and the model's kernels, where
Ouro's 96 layer applications per token make host cost per launch count."""

from __future__ import annotations

import os

import torch
import triton

# TRITON_INTERPRET is read once, at import, as Triton itself reads it when decorating kernels.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# From Triton 3.3 the JIT launches compiled kernels with every bound argument, constexprs included;
# the direct launch below mirrors that call, so it is only taken there.
DIRECT_LAUNCH = not INTERPRETED and hasattr(triton, "knobs")


class CompiledLaunch:
    """One kernel at one grid. The caller rebuilds it whenever the argument layouts change. Options beyond
    num_warps and num_stages (enable_fp_fusion, say) go to the first, compiling call."""

    __slots__ = ("compiled", "direct", "fn", "grid", "options", "pointers")

    def __init__(self, fn, grid: tuple[int, int, int], num_warps: int, num_stages: int,
                 direct: bool = True, **options) -> None:
        self.fn = fn
        self.grid = grid
        self.options = {"num_warps": num_warps, "num_stages": num_stages, **options}
        self.direct = direct and DIRECT_LAUNCH
        self.compiled = None
        self.pointers = ()  # the positions of the tensor arguments, found at the first call

    def __call__(self, stream: int, args: tuple) -> None:
        compiled = self.compiled
        if compiled is None:
            compiled = self.fn[self.grid](*args, **self.options)
            if self.direct:
                self.compiled = compiled.result() if hasattr(compiled, "result") else compiled
                self.pointers = tuple(i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor))
            return
        grid = self.grid
        runtime = triton.knobs.runtime
        enter, leave = _registered(runtime.launch_enter_hook), _registered(runtime.launch_exit_hook)
        if enter is None and leave is None:
            metadata = None
            if self.pointers:
                # Addresses as ints: given a tensor, Triton's C launcher (3.6 and 3.8 checked) calls its
                # data_ptr() and then asks the driver about the address (cuPointerGetAttribute), for every
                # pointer argument of every launch; an int it takes as the address. The plans checked each
                # tensor's device when they were built.
                args = list(args)
                for i in self.pointers:
                    args[i] = args[i].data_ptr()
        else:  # the hooks get the tensors, and the metadata, which exists for them alone
            metadata = compiled.launch_metadata(grid, stream, *args)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, leave, *args)


def _registered(hook):
    """A launch hook, or None where nothing is registered. In Triton 3.6 and 3.8 (the versions checked) the
    hooks are HookChains, never None, so Triton's own launch builds the hooks' metadata and calls both empty
    chains at every launch (three Python calls, about 1.5 µs of host time on this project's CI CPU); its C
    launcher skips a None hook."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (calls is not None and not calls) else hook


def specialization(args: tuple) -> tuple:
    """What Triton specializes a kernel on, of each argument: a tensor's dtype, device and 16-byte alignment,
    an int's value (Triton keys on == 1 and divisibility by 16; the exact value is a superset), None, a
    bool; floats are passed as they are and not specialized on."""
    key = []
    for arg in args:
        if hasattr(arg, "data_ptr"):
            key.append((arg.dtype, arg.device, arg.data_ptr() & 15))
        elif isinstance(arg, float):
            key.append(float)
        else:
            key.append(arg)
    return tuple(key)


class LaunchCache:
    """A kernel's CompiledLaunch per grid and specialization: after the first call of each, launches skip
    Triton's per-call JIT dispatch (tens of µs of host time each, which an eager Ouro step pays about 400
    times for the elementwise kernels alone)."""

    def __init__(self, fn, num_stages: int = 1, **options) -> None:
        self.fn, self.num_stages, self.options = fn, num_stages, options
        self.launches: dict[tuple, CompiledLaunch] = {}

    def __call__(self, grid: tuple[int, ...], args: tuple, num_warps: int, stream: int) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        key = (grid, num_warps, specialization(args))
        launch = self.launches.get(key)
        if launch is None:
            if len(self.launches) > 4096:  # a bound: shapes are few, but nothing else would limit them
                self.launches.clear()
            launch = self.launches[key] = CompiledLaunch(self.fn, grid, num_warps, self.num_stages,
                                                         **self.options)
        launch(stream, args)
