"""The loop driver (runner/loop_driver.py): running loops 0..d-1 and then d..T-1 from loop d-1's output is the
full run bit for bit, for decode rows and prefill chunks alike. This is what a draft of a looped model's first
d loops rests on (each loop reads only its own slots' K/V and the previous loop's output)."""

import dataclasses

import pytest
import torch

from engine import Engine, SamplingParams
from runner.loop_driver import EagerLoops, run_loops


def step_inputs(engine: Engine, decode: bool):
    """The next step's inputs: every row decoding (after a prefill step), or the first prefill chunks."""
    for i in range(3):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request([5 + i] * (4 + 3 * i), params)
    if decode:
        engine.step()
    batch = engine.scheduler.schedule()
    assert all(n == 1 for n in batch.num_new_tokens) == decode
    return engine.runner.prepare(batch)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("draft_loops", [1, 2, 3])
def test_loops_split_at_d_equal_the_full_run_bitwise(tiny_checkpoint, decode, draft_loops):
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", verbose=False) as engine, \
            torch.inference_mode():
        loops = engine.config.total_ut_steps
        inputs = dataclasses.replace(step_inputs(engine, decode), readout=None)  # every token reads out
        executor = EagerLoops(engine.model, engine.backend)
        draft = run_loops(executor, engine.model, inputs, range(draft_loops))
        rest = run_loops(executor, engine.model, dataclasses.replace(inputs, hidden=draft.hidden[-1]),
                         range(draft_loops, loops))
        full = run_loops(executor, engine.model, inputs, range(loops))
    assert draft.hidden.shape[0] == draft_loops and rest.hidden.shape[0] == loops - draft_loops
    assert torch.equal(torch.cat([draft.hidden, rest.hidden]), full.hidden)
    assert torch.equal(torch.cat([draft.gate_logits, rest.gate_logits]), full.gate_logits)
