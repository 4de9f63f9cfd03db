"""benchmarks/depth_batching.py on CPU with the tiny model, end to end in a few seconds: the gate-bias
calibration reaches each target mean (and a fresh engine without prefix caching measures the same at that
bias), the JSON and the table carry every row with the fields docs/performance.md's reproduction reads, and
depth batching gives lockstep early exit's tokens (fp32)."""

import json

import pytest

from benchmarks.depth_batching import (DEPTH, FULL, LOCKSTEP, calibration_prompts, lockstep_loops, main,
                                       parse_args, set_gate_bias)
from engine import Engine

TOLERANCE = 0.05  # loops per decode token: the benchmark's default --tolerance
ARGS = ["--device", "cpu", "--batches", "1", "4", "--prompt", "16", "--steps", "4", "--warm", "1",
        "--calibration-batch", "16", "--tolerance", str(TOLERANCE)]


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("depth") / "depth_batching.json"
    returned = main(["--model", str(tiny_checkpoint), *ARGS, "--out", str(out)])
    return returned, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_the_calibration_reaches_each_target_mean_with_tokens_exiting_at_several_loops(run):
    _, written, _ = run
    calibrations = written["calibration"]
    assert [c["target_loops"] for c in calibrations] == [2.0, 3.0]
    for c in calibrations:
        assert abs(c["loops_per_token"] - c["target_loops"]) <= TOLERANCE and c["hit"]
        assert sum(c["histogram"]) == pytest.approx(1, abs=1e-3)
        assert sum(share > 0 for share in c["histogram"]) >= 3  # a spread of exits, not one forced loop
    assert calibrations[0]["gate_bias"] > calibrations[1]["gate_bias"]  # more loops: a lower exit bias


def test_a_fresh_engine_at_the_calibrated_bias_runs_the_target_loops(run, tiny_checkpoint):
    _, written, _ = run
    args = parse_args(ARGS)
    with Engine(tiny_checkpoint, device="cpu", exit_policy="early:0.5", enable_prefix_caching=False,
                max_num_seqs=16, max_model_len=64, verbose=False) as engine:
        for c in written["calibration"]:
            set_gate_bias(engine, c["gate_bias"])
            loops, _ = lockstep_loops(engine, calibration_prompts(engine, args), args.calibration_tokens)
            assert abs(loops - c["target_loops"]) <= TOLERANCE


def test_every_row_is_timed_and_depth_batching_gives_locksteps_tokens(run):
    returned, written, table = run
    rows = written["rows"]
    assert rows == returned["rows"] and written["dtype"] == "float32"
    assert [(r["row"], r["target_loops"], r["batch"]) for r in rows] == [
        (FULL, None, 1), (FULL, None, 4),
        *[(label, target, batch) for label in (LOCKSTEP, DEPTH) for target in (2.0, 3.0) for batch in (1, 4)]]
    bias = {c["target_loops"]: c["gate_bias"] for c in written["calibration"]}
    for r in rows:
        assert r["tok_s"] > 0 and r["tpot_ms"] == pytest.approx(r["batch"] / r["tok_s"] * 1e3, rel=0.01)
        assert r["gbps"] >= 0 and r["mode"] == "eager" and r["dtype"] == "float32"
        assert 1 <= r["loops_per_token"] <= 4
        assert r["bound_vs_full"] == pytest.approx(4 / r["loops_per_token"], rel=1e-3)
        assert r["speedup_vs_full"] > 0
        if r["row"] == FULL:
            assert r["loops_per_token"] == 4 and r["speedup_vs_full"] == 1
        else:
            assert r["gate_bias"] == bias[r["target_loops"]] and r["exit_policy"] == "early:0.5"
        if r["row"] == DEPTH:
            assert r["depth_batching"] and r["passes_per_step"] == 16  # four times the loops: chains
            assert r["timed_steps"] == max(1, round(4 * r["target_loops"] / 16))
            assert r["same_tokens_as_lockstep"] and r["requests_equal"] == r["batch"]
            assert r["tokens_compared"] >= r["batch"] * 4  # the first token and one at least every 4 passes
    assert "| 2.0 | depth batching | eager | 4 |" in table and "True (±0.05)" in table


def test_every_row_is_resident_at_once_when_the_pool_holds_the_expected_tokens_only(tiny_checkpoint, tmp_path,
                                                                                    monkeypatch):
    """A pool that holds 16 rows' expected tokens but not their budgets (the worst case of every token exiting
    at loop 0: 16 a chained step): every row is admitted at once and timed, where reserving for the budgets
    held rows back until the first ones had run their whole budget (a row "finished in the timed steps")."""
    import functools

    import benchmarks.depth_batching as benchmark
    monkeypatch.setattr(benchmark, "Engine", functools.partial(Engine, num_kv_blocks=100))
    returned = main(["--model", str(tiny_checkpoint), *ARGS[:2], "--batches", "16", "--mean-loops", "2.0",
                     *ARGS[5:], "--out", str(tmp_path / "depth.json")])
    depth = [r for r in returned["rows"] if r["row"] == DEPTH]
    assert len(depth) == 1 and "note" not in depth[0] and depth[0]["requests_equal"] == 16


def test_the_kv_format_reaches_every_engine_and_depth_batching_stays_lossless_in_it(run, tiny_checkpoint,
                                                                                    tmp_path):
    """--kv-cache-dtype fp8_e4m3 (what lets 64 x 2K of Ouro-1.4B fit an 80 GB GPU): every engine stores its
    K/V so (a byte an element, against fp32's four in the default run), and depth batching still gives
    lockstep's tokens."""
    out = tmp_path / "fp8.json"
    argv = ["--model", str(tiny_checkpoint), "--device", "cpu", "--batches", "2", "--prompt", "16", "--steps",
            "2", "--warm", "1", "--mean-loops", "2.0", "--calibration-batch", "8", "--tolerance", "0.5",
            "--kv-cache-dtype", "fp8_e4m3", "--out", str(out)]
    rows = main(argv)["rows"]
    assert json.loads(out.read_text())["kv_cache_dtype"] == "fp8_e4m3"
    assert "K/V fp8_e4m3" in out.with_suffix(".md").read_text()
    fp32_bytes = {r["kv_slot_token_bytes"] for r in run[1]["rows"]}
    assert {r["kv_format"] for r in run[1]["rows"]} == {"auto"} and len(fp32_bytes) == 1  # the model dtype
    assert {r["kv_format"] for r in rows} == {"fp8_e4m3"}
    assert {4 * r["kv_slot_token_bytes"] for r in rows} == fp32_bytes
    depth = [r for r in rows if r["row"] == DEPTH]
    assert depth and all(r["requests_equal"] == r["batch"] for r in depth)
