"""A Triton kernel launched directly once compiled: the first call goes through Triton's JIT, which
compiles or finds the variant for these argument types; later calls skip the JIT's per-call argument
binding and launch the compiled kernel. Used by the attention backend and the model's kernels, where
Ouro's 96 layer applications per token make host cost per launch count."""

from __future__ import annotations

import os

import triton

# TRITON_INTERPRET is read once, at import, as Triton itself reads it when decorating kernels.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# From Triton 3.3 the JIT launches compiled kernels with every bound argument, constexprs included;
# the direct launch below mirrors that call, so it is only taken there.
DIRECT_LAUNCH = not INTERPRETED and hasattr(triton, "knobs")


class CompiledLaunch:
    """One kernel at one grid. The caller rebuilds it whenever the argument layouts change."""

    __slots__ = ("compiled", "direct", "fn", "grid", "options")

    def __init__(self, fn, grid: tuple[int, int, int], num_warps: int, num_stages: int,
                 direct: bool = True) -> None:
        self.fn = fn
        self.grid = grid
        self.options = {"num_warps": num_warps, "num_stages": num_stages}
        self.direct = direct and DIRECT_LAUNCH
        self.compiled = None

    def __call__(self, stream: int, args: tuple) -> None:
        compiled = self.compiled
        if compiled is None:
            compiled = self.fn[self.grid](*args, **self.options)
            if self.direct:
                self.compiled = compiled.result() if hasattr(compiled, "result") else compiled
            return
        grid = self.grid
        knobs = triton.knobs.runtime
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *args), knobs.launch_enter_hook,
                     knobs.launch_exit_hook, *args)
