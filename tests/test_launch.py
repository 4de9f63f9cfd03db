"""attention/launch.py's CompiledLaunch after its first call: it hands Triton's launcher each call's tensor
addresses as ints, straight into the C launch function on the Triton versions that path ran on, and every
call reads its own tensors; with a launch hook registered it hands over the tensors and the hook runs at
every launch."""

import types

import pytest
import torch
import triton
import triton.language as tl

from attention import launch as launch_module
from attention.launch import C_LAUNCH_VERSIONS, DIRECT_LAUNCH, CompiledLaunch, c_launcher, triton_version

C_LAUNCH_HERE = triton_version() in C_LAUNCH_VERSIONS


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
    assert (launch.c_launch is not None) == (DIRECT_LAUNCH and C_LAUNCH_HERE)  # the path just run


@pytest.mark.gpu
def test_a_launch_through_compiled_run_reads_its_own_tensors_too():
    launch = CompiledLaunch(_scaled_copy_kernel, (1, 1, 1), 4, 1)
    _launch_twice(launch)
    launch.c_launch = None
    _launch_twice(launch)


def _compiled(**run_fields):
    """A stand-in for a compiled kernel, with the fields c_launcher reads of it and its launcher."""
    fields = {"launch": lambda *args: None, "launch_cooperative_grid": False, "launch_pdl": True,
              "global_scratch_size": 0, "global_scratch_align": 1, "profile_scratch_size": 0,
              "profile_scratch_align": 1, "num_ctas": 1, "gsan_enabled": False,
              "arg_annotations": ("annotations",), "kernel_signature": b"signature", **run_fields}
    run = types.SimpleNamespace(**fields)
    return types.SimpleNamespace(run=run, function=1, packed_metadata=(4, 1, 0))


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1+git0a1b2c3", "3.8.0"])
def test_the_c_launcher_is_taken_on_the_triton_versions_checked_and_without_scratch(monkeypatch, version):
    monkeypatch.setattr(launch_module.triton, "__version__", version)
    assert c_launcher(_compiled(), (1, 1, 1)) is not None
    assert c_launcher(_compiled(global_scratch_size=8), (1, 1, 1)) is None
    assert c_launcher(_compiled(profile_scratch_size=8), (1, 1, 1)) is None
    assert c_launcher(_compiled(gsan_enabled=True), (1, 1, 1)) is None


def test_the_c_launch_passes_what_tritons_own_launcher_frame_passes(monkeypatch):
    """c_launcher's function against the frame it stands in for, the installed Triton's
    CudaLauncher.__call__, both calling one recording stand-in for the C launch function: the same arguments
    in the same order (the kernel's arguments as a list from CompiledLaunch, a tuple from Triton)."""
    if triton_version() not in C_LAUNCH_VERSIONS:
        pytest.skip(f"Triton {triton.__version__} launches through compiled.run: no C launch to check")
    from triton.backends.nvidia.driver import CudaLauncher

    calls = []
    compiled = _compiled(launch=lambda *args: calls.append(args))
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=None))  # 3.8 reads it first
    args = (0x7F0000001000, 5, 0x7F0000002000, 2.5)
    CudaLauncher.__call__(compiled.run, 3, 2, 1, 7, compiled.function, compiled.packed_metadata, None, None,
                          None, *args)
    c_launcher(compiled, (3, 2, 1))(7, list(args))

    def as_tuples(call):
        return [tuple(arg) if isinstance(arg, list) else arg for arg in call]

    frame, direct = calls
    assert as_tuples(direct) == as_tuples(frame)


@pytest.mark.parametrize("version", ["3.5.1", "3.7.0", "4.0.0", "3.x"])
def test_other_triton_versions_launch_through_compiled_run(monkeypatch, version):
    monkeypatch.setattr(launch_module.triton, "__version__", version)
    assert c_launcher(_compiled(), (1, 1, 1)) is None


def _compiled_launch_after_its_first_call(calls: list) -> CompiledLaunch:
    """A CompiledLaunch in the state its first call leaves on CUDA with the C launcher: a compiled kernel
    and a C launcher (stand-ins recording how they are called into `calls`) and the positions of its tensor
    arguments, 0 and 2."""
    launch = CompiledLaunch(None, (3, 2, 1), 4, 1)
    compiled = _compiled()
    compiled.run = lambda *args: calls.append(("run", args))
    compiled.launch_metadata = lambda grid, stream, *args: ("metadata", grid, stream, args)
    launch.compiled, launch.pointers = compiled, (0, 2)
    launch.c_launch = lambda stream, args: calls.append(("c", stream, args))
    return launch


def test_after_its_first_call_a_launch_hands_over_addresses_and_takes_the_c_launcher():
    """The direct path, run on a CPU with stand-ins: each call's tensors go to the C launcher as their
    addresses, the other arguments as they are; without a C launcher, through compiled.run."""
    calls = []
    x, y = torch.zeros(4), torch.zeros(8)
    launch = _compiled_launch_after_its_first_call(calls)
    launch(7, (x, 5, y, 2.5))
    assert calls == [("c", 7, [x.data_ptr(), 5, y.data_ptr(), 2.5])]
    calls.clear()
    launch.c_launch = None
    launch(7, (y, 6, x, 1.5))
    launcher_args = (3, 2, 1, 7, 1, (4, 1, 0), None, None, None)  # grid, stream, function, metadata, no hooks
    assert calls == [("run", launcher_args + (y.data_ptr(), 6, x.data_ptr(), 1.5))]


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
    (name, args), = calls
    assert name == "run" and args[:6] == (3, 2, 1, 7, 1, (4, 1, 0))
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
