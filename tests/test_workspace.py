"""The eager decode workspace: reuse on a hit, grow-only, at most 16 entries with the oldest evicted
first, and safe when it crosses torch.inference_mode boundaries."""

import pytest
import torch

from tests.paged_cases import assert_matches, bound, make_case, reference, run
from triton_runtime.stream import current_stream
from triton_runtime.workspace import MAX_ENTRIES, Workspace

CPU = torch.device("cpu")


def test_hit_returns_the_same_buffers():
    workspace = Workspace()
    first = workspace.get(CPU, 7, 100, 10)
    again = workspace.get(CPU, 7, 60, 4)
    assert again.partials is first.partials and again.tickets is first.tickets
    assert len(workspace) == 1


def test_growth_is_grow_only_and_keeps_the_entry_age():
    workspace = Workspace()
    workspace.get(CPU, 1, 10, 2)
    workspace.get(CPU, 2, 10, 2)
    grown = workspace.get(CPU, 1, 500, 2)
    assert grown.partials.numel() == 500 and grown.tickets.numel() == 2
    assert workspace.get(CPU, 1, 20, 2).partials is grown.partials  # smaller asks never shrink it
    more_tickets = workspace.get(CPU, 1, 20, 9)
    assert more_tickets.partials is grown.partials and more_tickets.tickets.numel() == 9
    assert not more_tickets.tickets.any()
    assert workspace.oldest_first() == [(-1, 1), (-1, 2)]


def test_at_most_16_entries_and_the_oldest_goes_first():
    workspace = Workspace()
    kept = {stream: workspace.get(CPU, stream, 8, 1) for stream in range(MAX_ENTRIES)}
    workspace.get(CPU, 0, 8, 1)  # a hit does not make an entry younger
    workspace.get(CPU, 100, 8, 1)
    workspace.get(CPU, 101, 8, 1)
    assert len(workspace) == MAX_ENTRIES
    assert workspace.oldest_first() == [(-1, s) for s in range(2, MAX_ENTRIES)] + [(-1, 100), (-1, 101)]
    assert workspace.get(CPU, 5, 8, 1).partials is kept[5].partials
    assert workspace.get(CPU, 0, 8, 1).partials is not kept[0].partials  # evicted, so allocated anew


def test_keys_are_device_and_stream():
    workspace = Workspace()
    assert current_stream(CPU) == current_stream(CPU) == 0
    workspace.get(CPU, current_stream(CPU), 4, 1)
    assert workspace.oldest_first() == [(-1, 0)]


def _multi_split_backend(case):
    backend = bound("triton", case)
    backend.workspace = Workspace()
    backend.decode_block_n, backend.split_min_keys, backend.short_context = 16, 8, 0
    return backend


@pytest.mark.interpreter
def test_workspace_made_in_inference_mode_serves_decode_outside_it():
    case = make_case([1, 1], [17, 30])
    expected, _ = reference(case)
    backend = _multi_split_backend(case)
    with torch.inference_mode():
        inside = run(backend, case)
    entry = backend.workspace.get(CPU, 0, 0, 0)
    assert entry.tickets.is_inference()
    outside = run(backend, case)
    assert backend.workspace.get(CPU, 0, 0, 0) is entry
    assert torch.equal(inside, outside)
    assert_matches(outside, expected)
    assert not entry.tickets.any()  # the merging split put every ticket back to 0


@pytest.mark.interpreter
def test_workspace_made_outside_inference_mode_serves_decode_inside_it():
    case = make_case([1, 1], [17, 30])
    backend = _multi_split_backend(case)
    outside = run(backend, case)
    with torch.inference_mode():
        inside = run(backend, case)
    assert torch.equal(inside, outside)
    assert len(backend.workspace) == 1
