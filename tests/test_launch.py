"""triton_runtime/launch.py's CompiledLaunch after its first call: it hands Triton's launcher (compiled.run)
each call's tensor addresses as ints, and every call reads its own tensors; with a launch hook registered it
hands over the tensors and the hook runs at every launch."""

import types

import pytest
import torch
import triton
import triton.language as tl

from triton_runtime.launch import DIRECT_LAUNCH, CompiledLaunch


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


def _compiled_launch_after_its_first_call(calls: list) -> CompiledLaunch:
    """A CompiledLaunch in the state its first call leaves on CUDA: a compiled kernel (a stand-in recording
    how it is launched into `calls`) and the positions of its tensor arguments, 0 and 2."""
    launch = CompiledLaunch(None, (3, 2, 1), 4, 1)
    compiled = types.SimpleNamespace(function=1, packed_metadata=(4, 1, 0))
    compiled.run = lambda *args: calls.append(args)
    compiled.launch_metadata = lambda grid, stream, *args: ("metadata", grid, stream, args)
    launch.compiled, launch.pointers = compiled, (0, 2)
    return launch


def test_after_its_first_call_a_launch_hands_compiled_run_each_calls_tensor_addresses():
    """The direct path, run on a CPU with a stand-in: each call's tensors go to compiled.run as their
    addresses, the other arguments as they are."""
    calls = []
    x, y = torch.zeros(4), torch.zeros(8)
    launch = _compiled_launch_after_its_first_call(calls)
    launch(7, (x, 5, y, 2.5))
    launch(7, (y, 6, x, 1.5))
    launcher_args = (3, 2, 1, 7, 1, (4, 1, 0), None, None, None)  # grid, stream, function, metadata, no hooks
    assert calls == [launcher_args + (x.data_ptr(), 5, y.data_ptr(), 2.5),
                     launcher_args + (y.data_ptr(), 6, x.data_ptr(), 1.5)]


def test_with_a_launch_hook_registered_a_launch_hands_over_tensors_and_metadata():
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(metadata) -> None:
        pass

    calls = []
    x, y = torch.zeros(4), torch.zeros(8)
    launch = _compiled_launch_after_its_first_call(calls)
    hooks.add(hook)
    try:
        launch(7, (x, 5, y))
    finally:
        hooks.remove(hook)
    args, = calls
    assert args[:6] == (3, 2, 1, 7, 1, (4, 1, 0))
    assert args[6] == ("metadata", (3, 2, 1), 7, (x, 5, y)) and args[7] is hooks
    assert args[9] is x and args[10] == 5 and args[11] is y


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
