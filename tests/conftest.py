"""Shared fixtures. Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1), set
before anything imports triton, and patched once per launch (tests/interpreter_patching.py)."""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tests.interpreter_patching import patch_language_once_per_launch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    patch_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    """Without CUDA the `gpu` tests are skipped; with it the `interpreter` tests are (they put the Triton
    backend or kernels on CPU tensors, which runs only under TRITON_INTERPRET=1, set here only without CUDA;
    the `gpu` tests cover the same paths on the device)."""
    cuda = torch.cuda.is_available()
    marker, reason = ("interpreter", "runs Triton on CPU: needs TRITON_INTERPRET=1, set only without CUDA") \
        if cuda else ("gpu", "needs CUDA")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random-weight tiny Ouro checkpoint in the exact HF layout (fp32)."""
    from model.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def reference(tiny_checkpoint):
    from tests.reference import ReferenceOuro

    return ReferenceOuro(tiny_checkpoint)

# The tests run many tiny ops, where OpenMP's thread hand-off costs more than it saves (and CI has 2 cores).
torch.set_num_threads(1)
