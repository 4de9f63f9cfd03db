"""tests/interpreter_patching.py: under the interpreter a launch patches triton.language's builtins a fixed
number of times, however many programs it runs and helpers they call (tl.zeros and tl.sum, triton's own, and
one of this file); the kernel computes what it did, and the builtins are restored when the launch ends."""

import inspect

import pytest
import torch

import triton
import triton.language as tl


@triton.jit
def _sum_plus_one(x):
    return tl.sum(x + tl.zeros(x.shape, tl.float32) + 1.0, axis=0)


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    tl.store(out_ptr + row, _sum_plus_one(x) + _sum_plus_one(x))


@pytest.mark.interpreter
def test_a_launch_patches_the_language_a_fixed_number_of_times_and_computes_as_before(monkeypatch):
    getmembers, scans = inspect.getmembers, []

    def counted(obj, *args):
        scans.append(obj)
        return getmembers(obj, *args)

    monkeypatch.setattr(inspect, "getmembers", counted)
    per_launch = []
    for rows in (2, 1, 3):  # the first launch also rewrites the helpers, adding to their modules' globals
        x = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
        out = torch.empty(rows)
        scans.clear()
        _row_sums_kernel[(rows,)](x, out, 4)
        per_launch.append(len(scans))
        assert out.tolist() == (2 * (x + 1).sum(1)).tolist()
    assert per_launch[1] == per_launch[2] > 0  # not once per program, nor per helper call
    assert tl.core.is_builtin(tl.arange) and tl.core.is_builtin(tl.tensor.__add__)  # restored
