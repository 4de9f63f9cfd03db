"""Backend selection: a requirement switches a capability on for the returned instance only."""

import pytest
import torch

from attention.registry import available, select
from attention.triton_backend import PACKED_PREFILL_TOLERANCE, TritonBackend

CPU = torch.device("cpu")


def test_triton_is_registered_and_runs_on_cpu_under_the_interpreter():
    assert "triton" in available() and "torch" in available()
    backend = select("triton", CPU)
    assert isinstance(backend, TritonBackend)
    assert backend.capabilities.cuda_graphs and not backend.capabilities.packed_prefill


def test_packed_prefill_requirement_stays_on_its_instance():
    packed = select("triton", CPU, {"packed_prefill": True})
    caps = packed.capabilities
    assert caps.packed_prefill and not caps.packed_matches_decode
    assert caps.packed_prefill_tolerance == PACKED_PREFILL_TOLERANCE
    plain = select("triton", CPU)
    for later in (plain.capabilities, TritonBackend.default_capabilities):
        assert not later.packed_prefill and later.packed_matches_decode
        assert later.packed_prefill_tolerance is None
    assert caps is not plain.capabilities


def test_changing_one_instance_capabilities_leaks_nowhere():
    first = select("triton", CPU)
    first.capabilities.packed_prefill = True
    first.capabilities.dtypes = (torch.float32,)
    second = select("triton", CPU)
    assert not second.capabilities.packed_prefill and torch.bfloat16 in second.capabilities.dtypes
    assert torch.bfloat16 in TritonBackend.default_capabilities.dtypes


def test_a_false_requirement_switches_nothing_on():
    assert not select("triton", CPU, {"packed_prefill": False}).capabilities.packed_prefill


@pytest.mark.parametrize("name,requirement", [("triton", "cuda_graphs_off"), ("torch", "packed_prefill")])
def test_a_requirement_the_backend_cannot_meet_is_refused(name, requirement):
    with pytest.raises(ValueError, match=requirement):
        select(name, CPU, {requirement: True})


def test_auto_is_torch_on_cpu():
    assert select("auto", CPU).name == "torch"
