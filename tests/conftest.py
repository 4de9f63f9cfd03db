"""Shared fixtures. Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1), set
before anything imports triton, and patched once per launch, with exact tile products
(tests/interpreter_patching.py)."""

import gc
import os
import sys
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tests.interpreter_patching import exact_tile_dots, patch_language_once_per_launch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    patch_language_once_per_launch()
    exact_tile_dots()


def pytest_collection_modifyitems(config, items):
    """Without CUDA the `gpu` tests are skipped; with it the `interpreter` tests are (they put the Triton
    backend or kernels on CPU tensors, which runs only under TRITON_INTERPRET=1, set here only without CUDA;
    the `gpu` tests cover the same paths on the device)."""
    marker, reason = ("interpreter", "runs Triton on CPU: needs TRITON_INTERPRET=1, set only without CUDA") \
        if CUDA else ("gpu", "needs CUDA")
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


# Engine.close() runs gc.collect(), which scans every object the process tracks: in a test worker, torch,
# triton, every imported test module and the session's fixtures, many times what one test makes. Without
# CUDA, each test file starts by collecting what earlier files left and freezing the rest (gc.freeze: left
# out of later collections), and each test ends by freezing what it leaves alive, so a collection scans only
# what the running test made (a cycle among the frozen waits for the next file's collection). With CUDA
# nothing is frozen: an engine's device memory goes back when close() says.

@pytest.fixture(autouse=True, scope="module")
def heap_collected_then_frozen():
    if not CUDA:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def heap_frozen_after_each_test(heap_collected_then_frozen):
    yield
    if not CUDA:
        gc.freeze()


# The tests run many tiny ops, where OpenMP's thread hand-off costs more than it saves (and CI has 2 cores).
torch.set_num_threads(1)
