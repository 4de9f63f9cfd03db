"""attention/launch.py's CompiledLaunch after its first call: it hands Triton's launcher each call's tensor
addresses as ints, and every call reads its own tensors; with a launch hook registered it hands over the
tensors and the hook runs at every launch."""

import pytest
import torch
import triton
import triton.language as tl

from attention.launch import DIRECT_LAUNCH, CompiledLaunch


@triton.jit
def _scaled_copy_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def _launch_twice(launch: CompiledLaunch) -> None:
    stream = torch.cuda.current_stream().cuda_stream
    for scale in (2.0, 3.0):  # new tensors each call: the first compiles, the second launches directly
        x = torch.randn(100, device="cuda")
        y = torch.full((128,), -1.0, device="cuda")
        launch(stream, (x, y, 100, scale, 128))
        torch.cuda.synchronize()
        torch.testing.assert_close(y[:100], x * scale, rtol=0, atol=0)
        assert (y[100:] == -1).all()


@pytest.mark.gpu
def test_a_direct_launch_reads_the_tensors_of_its_own_call():
    launch = CompiledLaunch(_scaled_copy_kernel, (1, 1, 1), 4, 1)
    _launch_twice(launch)
    assert launch.pointers == ((0, 1) if DIRECT_LAUNCH else ())


@pytest.mark.gpu
def test_a_registered_launch_hook_is_called_at_every_launch():
    hooks = triton.knobs.runtime.launch_enter_hook
    seen = []

    def hook(metadata) -> None:
        seen.append(metadata)

    hooks.add(hook)
    try:
        _launch_twice(CompiledLaunch(_scaled_copy_kernel, (1, 1, 1), 4, 1))
    finally:
        hooks.remove(hook)
    assert len(seen) == 2
