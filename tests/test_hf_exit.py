"""exit_policy="hf": the official remote code's exit rule bit for bit. Its exit CDF is computed in the model
dtype, so it can round to 1 before the last loop (often in bf16, rarely in fp32), and then Q = 1 reads out an
earlier loop; threshold:Q's float64 CDF never does. The oracle's rule is tests/reference.py: hf_exit_loop."""

import math

import pytest
import torch

from engine import Engine, SamplingParams
from exit_policy import ExitPolicy, exit_pdf, hf_exit_loops, parse_exit_policy, threshold_exit_loops
from tests.reference import ReferenceOuro, hf_exit_loop

PROMPTS = ["A looped language model", "Hello", "0123456789 + - * / = 42"]
NEW_TOKENS = 6
# With a zero gate weight every loop's lambda is sigmoid(bias) ~ 1 - 2^-12: in fp32 the CDF is 1 - 2^-12 after
# loop 0, 1 - 2^-24 after loop 1, and 1 - 2^-36 after loop 2, which rounds to exactly 1.0.
ROUNDS_TO_ONE_AT_LOOP_2 = math.log(4095.0)


def test_hf_policy_parses_with_or_without_q_and_is_readout_only():
    assert parse_exit_policy("hf") == ExitPolicy("hf")
    assert parse_exit_policy("hf:0.7") == ExitPolicy("hf", 0.7)
    assert parse_exit_policy("hf").readout_only
    for bad in ("hf:", "hf:x", "hf:-1", "hf:inf"):
        with pytest.raises(ValueError, match="exit_policy"):
            parse_exit_policy(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_engine_rule_equals_the_oracle_rule_row_for_row(dtype):
    gates = (torch.randn(4, 512, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)
    for q in (0.5, 0.9, 1.0):
        assert hf_exit_loops(gates, q).tolist() == [hf_exit_loop(gates[:, r], q) for r in range(512)], q
    early_at_one = int((hf_exit_loops(gates, 1.0) < 3).sum())
    assert early_at_one > (100 if dtype != torch.float32 else 10)  # the model-dtype CDF reached 1 early
    assert threshold_exit_loops(exit_pdf(gates), 1.0).tolist() == [3] * 512  # float64: never before the last
    assert hf_exit_loops(gates, None).tolist() == [3] * 512  # no threshold in the config: the last loop


def _rounding_gate(engine: Engine, reference: ReferenceOuro) -> None:
    for weights in ((engine.model.early_exit_gate.weight, engine.model.early_exit_gate.bias),
                    (reference.w["model.early_exit_gate.weight"], reference.w["model.early_exit_gate.bias"])):
        with torch.no_grad():
            weights[0].zero_()
            weights[1].fill_(ROUNDS_TO_ONE_AT_LOOP_2)


def _traced(policy: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, loop_trace=True,
                          exit_policy=policy)


def test_hf_reads_out_where_the_fp32_cdf_rounds_to_one_even_at_q_one(tiny_checkpoint):
    reference = ReferenceOuro(tiny_checkpoint)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", verbose=False) as engine:
        _rounding_gate(engine, reference)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        default, hf, step2 = (engine.generate(PROMPTS, _traced(policy), use_tqdm=False)
                              for policy in (None, "hf", "step:2"))
        assert engine.config.early_exit_threshold == 1.0  # hf's Q comes from the config
    for ids, d, h, s in zip(prompts, default, hf, step2):
        d, h, s = d.outputs[0], h.outputs[0], s.outputs[0]
        assert {t.exit_loop for t in d.traces} == {3}  # the default stays `full`
        assert {t.exit_loop for t in h.traces} == {2}
        assert h.token_ids == s.token_ids == reference.decode(ids, NEW_TOKENS, "hf")[0]
        assert h.token_ids != d.token_ids


def test_hf_with_q_matches_the_oracle_in_a_mixed_batch(tiny_checkpoint):
    reference = ReferenceOuro(tiny_checkpoint)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", exit_policy="hf:0.5",
                max_num_batched_tokens=6, verbose=False) as engine:
        outputs = engine.generate(PROMPTS, _traced(None), use_tqdm=False)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    exit_loops = set()
    for ids, out in zip(prompts, outputs):
        tokens, traces = reference.decode(ids, NEW_TOKENS, "hf:0.5")
        assert out.outputs[0].token_ids == tokens
        assert [t.exit_loop for t in out.outputs[0].traces] == [t["exit_loop"] for t in traces]
        exit_loops |= {t.exit_loop for t in out.outputs[0].traces}
    assert len(exit_loops) > 1  # random weights exit at mixed loops


def test_in_bf16_hf_reads_out_an_earlier_loop_where_fp32_reads_the_last(tiny_checkpoint):
    """lambda = sigmoid(4) ~ 0.982 at every loop: the CDF after loop 1 is 1 - 3.2e-4, which is 1.0 in bf16
    (8 mantissa bits) but not in fp32."""
    exit_loops = {}
    for dtype in ("bfloat16", "float32"):
        with Engine(tiny_checkpoint, device="cpu", dtype=dtype, exit_policy="hf", verbose=False) as engine:
            with torch.no_grad():
                engine.model.early_exit_gate.weight.zero_()
                engine.model.early_exit_gate.bias.fill_(4.0)
            out = engine.generate(PROMPTS[0], _traced(None), use_tqdm=False)[0].outputs[0]
        exit_loops[dtype] = {t.exit_loop for t in out.traces}
    assert exit_loops == {"bfloat16": {1}, "float32": {3}}
