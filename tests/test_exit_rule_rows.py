"""ExitRule.decide_rows and reset_rows (runner/exit_rules.py), which a chained pass uses for the rows whose
loop decides or whose token starts: the memory and decisions of those rows are decide's and reset's, bit for
bit, and every other row's memory keeps its bits. early:Q's CDF (lambda 0 elsewhere) and an exit criterion's
memory (latent-diff: a state per row; argmax-stability: a run length too)."""

import pytest
import torch

from model.exit_criteria import ExitCriterion
from runner.exit_rules import CriterionRows, GateCDFRows

ROWS, HIDDEN, VOCAB, LOOPS = 6, 8, 11, 4


def rule_of(kind: str, capacity: int):
    if kind == "early":
        return GateCDFRows(0.4, LOOPS, capacity, torch.device("cpu"))
    criterion = ExitCriterion.parse(kind)
    head = torch.randn(HIDDEN, VOCAB, generator=torch.Generator().manual_seed(3))
    readout = (lambda state, coda: state @ head) if criterion.reads_logits else (lambda state, coda: state)
    return CriterionRows(criterion, readout, LOOPS, capacity, HIDDEN, VOCAB, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["early", "latent-diff:0.9", "argmax-stability:2"])
def test_rows_variants_are_the_whole_rule_on_those_rows_and_leave_the_others(kind):
    generator = torch.Generator().manual_seed(0)
    whole, masked = rule_of(kind, ROWS + 2), rule_of(kind, ROWS + 2)  # more rows than the pass: a bucket's
    rows = torch.tensor([True, False, True, True, False, True])
    for step in range(3):
        state = torch.randn(ROWS, HIDDEN, generator=generator)
        gates = torch.randn(ROWS, generator=generator).to(torch.bfloat16)
        if step == 0:
            whole.reset(ROWS, state)
            masked.reset(ROWS, state)
        before = [buffer.clone() for buffer in masked.buffers]
        fired = whole.decide(ROWS, state, gates)
        got = masked.decide_rows(rows, state, gates)
        assert torch.equal(got, rows & fired)
        for expected, old, buffer in zip(whole.buffers, before, masked.buffers):
            assert torch.equal(buffer[:ROWS][rows], expected[:ROWS][rows])
            assert torch.equal(buffer[:ROWS][~rows], old[:ROWS][~rows])
            assert torch.equal(buffer[ROWS:], old[ROWS:])
        for expected, buffer in zip(whole.buffers, masked.buffers):  # in step again for the next round
            buffer.copy_(expected)
    starts = torch.tensor([False, True, True, False, False, False])
    state = torch.randn(ROWS, HIDDEN, generator=generator)
    before = [buffer.clone() for buffer in masked.buffers]
    whole.reset(ROWS, state)
    masked.reset_rows(starts, state)
    for expected, old, buffer in zip(whole.buffers, before, masked.buffers):
        assert torch.equal(buffer[:ROWS][starts], expected[:ROWS][starts])
        assert torch.equal(buffer[:ROWS][~starts], old[:ROWS][~starts])
