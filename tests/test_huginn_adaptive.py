"""Huginn-0125's per-token adaptive compute served by the Engine (the embedded model/checkpoints/tiny-huginn,
fp32, zero initial states): under each exit criterion the greedy tokens, each token's readout loop and the
loops it ran equal tests/reference_huginn.py's per-token adaptive loop, whose checks read the next-token
distribution through the coda (its K/V stored at every check, the last write kept) as the official adaptive
generation does. The engine's steps mix prefill chunks with decode rows, so the eager checks read out the
looping rows among other rows' tokens.

As in tests/test_exit_criteria_engine.py, each threshold comes from the reference's own values (halfway
between two middle values at the last check before the last loop when nothing exits), and each test asserts
that its tokens mix early exits with full-depth ones and that no value the reference compared lies within
rounding of the threshold.
"""

import pytest

from engine import Engine, SamplingParams
from exit_policy import ExitPolicy, parse_exit_policy
from model.exit_criteria import ExitCriterion
from tests.conftest import ROOT
from tests.test_exit_criteria_engine import graph_and_eager_exits
from tests.reference_huginn import Generation, ReferenceHuginn

CHECKPOINT = ROOT / "model" / "checkpoints" / "tiny-huginn"
PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9], [100, 3, 77, 250, 251, 252, 19, 5, 6, 60, 61]]
LOOPS = 8
NEW_TOKENS = 6
MARGIN = 1e-3  # no compared value within this relative distance of the threshold


@pytest.fixture(scope="module")
def reference():
    return ReferenceHuginn(CHECKPOINT)


def reference_runs(reference: ReferenceHuginn, policy: ExitPolicy, loops: int = LOOPS,
                   new_tokens: int = NEW_TOKENS, strategy: str = "latest", warm_start: str | None = None
                   ) -> list[Generation]:
    criterion = ExitCriterion.from_policy(policy)
    return [reference.generate(p, new_tokens, loops, strategy, criterion, warm_start=warm_start)
            for p in PROMPTS]


def threshold_for(reference: ReferenceHuginn, policy: ExitPolicy, loops: int = LOOPS,
                  new_tokens: int = NEW_TOKENS) -> float:
    """A threshold that stops some generated tokens early and not others (argmax-stability: a run of 2)."""
    if policy.kind == "argmax-stability":
        return 2
    never = ExitPolicy(policy.kind, 1e-30, policy.min_loops, policy.check_every)
    checks = [check for run in reference_runs(reference, never, loops, new_tokens)
              for token in run.checks for check in token]
    last = max(t for t, _ in checks if t < loops - 1)
    values = sorted(value for t, value in checks if t == last)
    return (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def engine_runs(spec: str, loops: int = LOOPS, new_tokens: int = NEW_TOKENS, **options):
    """Per prompt: greedy tokens, readout loops and loops run of each token; and the decode loops counted."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, loop_trace=True)
    options = {"device": "cpu", "dtype": "float32", "init_scale": 0, "max_num_batched_tokens": 4,
               "verbose": False, **options}
    with Engine(CHECKPOINT, loops=loops, exit_policy=spec, **options) as engine:
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS, params, use_tqdm=False)]
        engine_runs.preemptions = engine.scheduler.num_preemptions
        decode_loops = engine.loop_stats.decode_loops
    return [(list(o.token_ids), [t.exit_loop for t in o.traces], [len(t.exit_pdf) for t in o.traces])
            for o in outputs], decode_loops


def check_against_reference(reference: ReferenceHuginn, policy: ExitPolicy, loops: int = LOOPS,
                            new_tokens: int = NEW_TOKENS, strategy: str = "latest",
                            warm_start: str | None = None, **options) -> list[tuple[int, int]]:
    """The engine's tokens, readout loops, loops run and decode-loop count are the reference's, no compared
    value sits within MARGIN of the threshold, and the generated tokens mix early exits with full depth.
    Returns (readout loop, loops run) of every generated token after the first."""
    runs = reference_runs(reference, policy, loops, new_tokens, strategy, warm_start)
    got, decode_loops = engine_runs(str(policy), loops, new_tokens, continuous_compute=warm_start, **options)
    generated = []
    for run, (tokens, readout_loops, ran) in zip(runs, got):
        assert tokens == run.tokens
        # the reference's steps: the recurrences behind each token's logits' state; its readout loop is
        # where it stopped, else the criterion's readout loop
        want_ran = run.steps
        want_loops = [loops - 1] + [n - 1 if n < loops else policy.readout_loop(loops) for n in want_ran[1:]]
        assert ran == want_ran and readout_loops == want_loops
        generated += list(zip(readout_loops[1:], ran[1:]))
        if policy.kind != "argmax-stability":
            values = [value for token in run.checks for t, value in token if t < loops - 1]
            assert min(abs(v - policy.value) for v in values) > MARGIN * policy.value
    if not engine_runs.preemptions:  # a recomputed token's loops count again
        assert decode_loops == sum(n for _, n in generated)
    assert min(n for _, n in generated) < loops and max(n for _, n in generated) == loops
    return generated


@pytest.mark.parametrize("kind", ["kl", "minp-kl", "entropy-diff", "argmax-stability", "latent-diff"])
def test_each_criterion_gives_the_references_tokens_and_exit_loops(reference, kind):
    threshold = threshold_for(reference, ExitPolicy(kind, 1.0))
    check_against_reference(reference, parse_exit_policy(f"{kind}:{threshold!r}", LOOPS))


def test_min_and_every_schedule_the_checks_and_the_unchecked_last_loop_reads_out_the_last_check():
    """kl,min=2,every=2 over 8 loops checks loops 2, 4 and 6: a token stops only there, and one that never
    stops runs all 8 loops but reads out loop 6 through the coda, the last check's readout, as the official
    code keeps it (the step's final coda runs on loop 6's state for that token, not loop 7's)."""
    reference = ReferenceHuginn(CHECKPOINT)
    threshold = threshold_for(reference, ExitPolicy("kl", 1.0, 2, 2))
    policy = parse_exit_policy(f"kl:{threshold!r},min=2,every=2", LOOPS)
    assert policy.readout_loop(LOOPS) == 6
    generated = check_against_reference(reference, policy)
    assert {n for _, n in generated} <= {3, 5, 7, LOOPS}
    assert all(loop == 6 for loop, n in generated if n == LOOPS)


def test_a_ring_layout_under_a_criterion_and_without_gives_the_references_tokens(reference):
    """latest-compress:6 (a ring of 3 of the 8 loops, 2 core layers each) under kl against the reference's
    compress:6 (the official latest-m4-compress-s{k}: a ring row the token never reached reads its deepest);
    compress:4 at fixed depth against the reference's compress:4; compress:k alone under a criterion would
    read ring rows an early exit left unwritten, and is refused by name. Prompts are prefilled whole, as the
    reference does (over a ring, a prompt chunk reads an earlier chunk's tokens at their last ring write)."""
    threshold = threshold_for(reference, ExitPolicy("kl", 1.0))
    policy = parse_exit_policy(f"kl:{threshold!r}", LOOPS)
    check_against_reference(reference, policy, strategy="compress:6", kv_layout="latest-compress:6",
                            max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with Engine(CHECKPOINT, device="cpu", dtype="float32", loops=LOOPS, init_scale=0, kv_layout="compress:4",
                verbose=False) as engine:
        tokens = [list(o.outputs[0].token_ids) for o in engine.generate(PROMPTS, params, use_tqdm=False)]
    assert tokens == [reference.generate(p, NEW_TOKENS, LOOPS, "compress:4").tokens for p in PROMPTS]
    with pytest.raises(ValueError, match="kv_layout='compress:4' cannot be combined with exit_policy="):
        Engine(CHECKPOINT, device="cpu", loops=LOOPS, exit_policy="kl", kv_layout="compress:4", verbose=False)


def test_a_raw_warm_start_under_a_criterion_starts_from_where_the_previous_token_stopped(reference):
    """continuous_compute="raw" (the official adaptive path's warm start): a token's initial state is the raw
    state of the previous token where it stopped (or its last loop), and the tokens and exits are the
    reference's."""
    threshold = threshold_for(reference, ExitPolicy("kl", 1.0))
    check_against_reference(reference, parse_exit_policy(f"kl:{threshold!r}", LOOPS), warm_start="raw")


def test_preempted_requests_replay_their_exits_and_match_the_reference(reference):
    """A pool too small for the three prompts at once: preempted requests recompute their generated tokens,
    stop where they stopped the first time, and give the reference's tokens and exit loops."""
    loops, new_tokens = 4, 12
    threshold = threshold_for(reference, ExitPolicy("kl", 1.0), loops, new_tokens)
    policy = parse_exit_policy(f"kl:{threshold!r}", loops)
    check_against_reference(reference, policy, loops, new_tokens, num_kv_blocks=7, block_size=4,
                            admission="greedy", max_model_len=28)
    assert engine_runs.preemptions > 0


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["kl:0.05", "kl:0.05,min=2,every=2", "argmax-stability:2"])
def test_per_loop_graphs_give_the_eager_exit_loops_and_tokens(spec):
    """The coda and the head run inside each checked loop's graph; 6 rows of the tiny Huginn model."""
    graph_and_eager_exits(CHECKPOINT, spec, PROMPTS * 2, LOOPS, NEW_TOKENS, init_scale=0)
