"""benchmarks/speculative.py's TPOT rows on CPU with the tiny model, in a few seconds: every path's rows at
every batch, speed-ups against the non-speculative row, and the forced acceptance doing what the rows say: the
speculative step appends k tokens a step at 100% and one at 0%; pipelined, a token every d passes after the
first token's T at 100%, T passes a token at 0%, as depth batching at full depth."""

import json

import pytest

from benchmarks.speculative import DEPTH_FULL, NON_SPECULATIVE, decode_tpot, force_acceptance, main
from engine import Engine

BATCHES, TOKENS, D, K, LOOPS = (1, 2), 8, 2, 4, 4  # TOKENS <= 8: no warm-up run


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("speculative") / "speculative.json"
    returned = main(["--model", str(tiny_checkpoint), "--device", "cpu", "--dtype", "float32",
                     "--batches", *map(str, BATCHES), "--prompt", "8", "--tokens", str(TOKENS),
                     "--d", str(D), "--k", str(K), "--out", str(out)])
    return returned, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def rows_of(run) -> dict[tuple[str, int], dict]:
    returned, written, _ = run
    assert written["rows"] == returned["rows"] and written["rows"]["projected"] is None
    return {(r["mode"], r["batch"]): r for r in written["rows"]["measured"]}


def test_every_path_has_its_rows_with_speedups_over_non_speculative(run):
    rows = rows_of(run)
    step, pipelined = f"loops:{D}, k={K}", f"pipelined loops:{D}, k={K}"
    modes = [NON_SPECULATIVE, DEPTH_FULL, *[f"{path}, acceptance forced {share}" for path in (step, pipelined)
                                           for share in ("100%", "0%")]]
    assert list(rows) == [(mode, batch) for mode in modes for batch in BATCHES]
    for (mode, batch), r in rows.items():
        assert r["tpot_ms"] > 0 and r["step_ms"] > 0 and r["cuda_graphs"] is False
        assert r["speedup"] == pytest.approx(rows[NON_SPECULATIVE, batch]["tpot_ms"] / r["tpot_ms"], rel=1e-2)
        assert r["tpot_ms"] == pytest.approx(r["step_ms"] / r["tokens_per_step"], rel=1e-2)
    _, _, table = run
    assert f"| {pipelined}, acceptance forced 100% | 2 |" in table and "| passes / token |" in table


def test_forced_acceptance_gives_each_path_its_exact_tokens_per_step(run):
    """N timed tokens a row: the speculative step appends k a step at 100% and one at 0%; pipelined
    speculation takes T + d(N - 1) passes at 100% (the first token's T, then one token every d), T a token at
    0%, as depth batching without speculation; depth batching's row runs a pass a step, except that a lone
    row's token (batch 1 without speculation) runs its loops in one step; pipelined greedy rows chain passes,
    several tokens a step."""
    rows = rows_of(run)
    pipelined = f"pipelined loops:{D}, k={K}, acceptance forced"
    for batch in BATCHES:
        assert rows[NON_SPECULATIVE, batch]["tokens_per_step"] == 1
        assert rows[NON_SPECULATIVE, batch]["passes_per_token"] is None
        for share, accepted, per_step in (("100%", 1, K), ("0%", 0, 1)):
            r = rows[f"loops:{D}, k={K}, acceptance forced {share}", batch]
            assert (r["accepted"], r["tokens_per_step"], r["passes_per_token"]) == (accepted, per_step, None)
        for mode, accepted, passes in ((DEPTH_FULL, None, LOOPS * TOKENS),
                                       (f"{pipelined} 100%", 1, LOOPS + D * (TOKENS - 1)),
                                       (f"{pipelined} 0%", 0, LOOPS * TOKENS)):
            r = rows[mode, batch]
            assert r["accepted"] == accepted
            assert r["passes_per_token"] == round(passes / TOKENS, 3)
            if mode == DEPTH_FULL:  # a pass a step
                lone = batch == 1
                assert r["tokens_per_step"] == (1 if lone else round(TOKENS / passes, 3))
            else:  # pipelined greedy rows chain 4T passes a step
                assert r["tokens_per_step"] > 1


def test_the_bound_at_forced_100_percent_is_loops_over_the_loops_a_token_costs(run):
    rows = rows_of(run)
    for (mode, _), r in rows.items():
        if mode.startswith("pipelined") and mode.endswith("100%"):
            assert r["bound"] == LOOPS / D
        elif mode.endswith("100%"):
            assert r["bound"] == round(K * LOOPS / (K * D + LOOPS - D), 3)
        else:
            assert r["bound"] is None


def test_async_pipelined_rows_time_the_tokens_after_the_step_that_reads_the_first(tiny_checkpoint):
    """Under async scheduling (the CUDA default) the step that reads a row's first token runs the next step
    on at once when that is a chain of loop passes, which appends several tokens: they are left out of the
    timed window (prefill_until_first_tokens counts them), so every timed token took d passes at forced 100%,
    and the row ends instead of waiting for a first token that never comes alone."""
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", depth_batching=True, speculative=f"loops:{D}",
                num_speculative_tokens=K, async_scheduling=True, enable_prefix_caching=False,
                verbose=False) as engine:
        force_acceptance(engine, True)
        row = decode_tpot(engine, 1, 8, 16, seed=1)
    assert row["accepted"] == 1 and row["passes_per_token"] == D
    assert row["tpot_ms"] == pytest.approx(row["step_ms"] / row["tokens_per_step"], rel=1e-2)


def test_chains_longer_than_the_warm_up_still_time_their_tokens(tiny_checkpoint):
    """With 32 passes a step at d loops a token, the first step's chain runs up to 16 tokens: the warm-up (8
    tokens) finishes inside it untimed, and the timed run counts only the tokens after it; fewer timed tokens
    than the first chain runs is refused by name."""
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", depth_batching=True, speculative=f"loops:{D}",
                num_speculative_tokens=K, passes_per_step=32, async_scheduling=True,
                enable_prefix_caching=False, verbose=False) as engine:
        force_acceptance(engine, True)
        row = decode_tpot(engine, 1, 8, 40, seed=1)
        assert row["accepted"] == 1 and row["passes_per_token"] == D
        with pytest.raises(ValueError, match="--tokens 9"):
            decode_tpot(engine, 1, 8, 9, seed=2)
