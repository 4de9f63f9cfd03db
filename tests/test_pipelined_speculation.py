"""Self-speculation pipelined in depth-batched passes (Engine(depth_batching=True, speculative="loops:d"),
runner/pipelined_speculation.py): greedy tokens equal plain decoding's for d = 1, 2, 3 of 4 loops, with
drafts accepted (the trained tiny model) and rejected (random weights), chunked prefill, staggered arrivals,
stops and max_tokens inside a run of tokens in flight, an abort and preemption (no block or token in flight
left behind); the stats count verifications and passes per token; drafts pause where most are rejected, and
under async scheduling the paused steps run ahead with the same outputs (faults too); what it does not take
yet is refused by name. All on CPU, fp32, the torch backend."""

import functools

import pytest

from engine import DEFAULT_MODEL, Engine, SamplingParams
from scheduler import scheduler
from tests.test_pass_chains import shadowed_fused_steps, skinny_head, static_chain_graphs
from tests.test_pass_graphs import static_pass_graphs
from tests.test_speculative import assert_same_distribution
from tests.conftest import ROOT
from tests.test_step_faults import hook_calls, interrupted_run
from tests.test_step_faults import outputs_of, outputs_without_faults, small_engine
from tests.test_step_faults import assert_clean as assert_released

PROMPTS = ["12+7=19\n31+5=", "Hello", "4821+337=5158\n96+4=100\n7+", "0123456789 + - * / = 42"]
NEW_TOKENS = 10
TRAINED = DEFAULT_MODEL
LOOPS = 4


def greedy(**extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True, **extra})


def engine_of(checkpoint, pipelined: bool, d: int = 2, **engine_args) -> Engine:
    """Chunked prefill (12 tokens a step): prompt chunks and decode rows share steps."""
    if pipelined:
        engine_args = {"depth_batching": True, "speculative": f"loops:{d}", **engine_args}
    engine_args = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 12, "verbose": False,
                   "loops": LOOPS, **engine_args}
    return Engine(checkpoint, **engine_args)


def assert_clean(engine: Engine) -> None:
    """Nothing in flight, no block held."""
    assert not engine.runner.in_flight and not engine.runner.mid_tokens
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def run(checkpoint, params, pipelined: bool, prompts=PROMPTS, d: int = 2, **engine_args):
    with engine_of(checkpoint, pipelined, d, **engine_args) as engine:
        outputs = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
        stats = engine.speculative_stats
        preemptions = engine.scheduler.num_preemptions
        assert_clean(engine)
    return outputs, stats, preemptions


@pytest.fixture(scope="module")
def plain():
    outputs, _, _ = run(TRAINED, greedy(), False)
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def pipelined():
    """The pipelined greedy run of PROMPTS at draft depth d (outputs, stats), each d run once."""
    runs = {}

    def of(d: int):
        if d not in runs:
            outputs, stats, _ = run(TRAINED, greedy(), True, d=d)
            runs[d] = outputs, stats
        return runs[d]

    return of


@pytest.mark.parametrize("d", [1, 2, 3])
def test_greedy_tokens_equal_plain_decoding(plain, pipelined, d):
    outputs, stats = pipelined(d)
    assert [o.token_ids for o in outputs] == plain
    assert 0 < stats.num_accepted <= stats.num_drafted  # the trained model's drafts are mostly accepted
    for out in outputs:
        # the first token comes from the prompt's last chunk; the others from passes
        assert out.depth.tokens == NEW_TOKENS - 1 and out.depth.loops_per_token == LOOPS
        assert out.speculative is not None and out.speculative.num_drafted > 0
    # tokens in flight overlap: fewer passes a token than loops (d a token when every draft is accepted)
    assert sum(o.depth.passes for o in outputs) < LOOPS * sum(o.depth.tokens for o in outputs)
    assert all(o.depth.passes_per_token >= d for o in outputs)


@pytest.mark.parametrize("d", [1, 2])
def test_one_pass_a_step_gives_the_chains_tokens_and_passes(plain, monkeypatch, d):
    """passes_per_step=1: greedy rows run a pass a step on the host's decisions
    (runner/pipelined_speculation.py) instead of chains of passes (runner/speculative_chains.py): the same
    tokens, drafts and passes. Drafts never pause here: a pause starts at the end of a step, so a chain's
    drafts after a rejection are not a single pass's."""
    monkeypatch.setattr(scheduler, "PIPELINED_PAUSE", 0)
    chained, chained_stats, _ = run(TRAINED, greedy(), True, d=d)
    outputs, stats, _ = run(TRAINED, greedy(), True, d=d, passes_per_step=1)
    assert [o.token_ids for o in outputs] == plain
    assert (stats.num_drafted, stats.num_accepted) == (chained_stats.num_drafted, chained_stats.num_accepted)
    assert [o.depth.passes for o in outputs] == [o.depth.passes for o in chained]


def test_a_row_that_cannot_chain_hands_its_steps_to_one_pass_and_back():
    """A request with logprobs reads its logits on the host: while it decodes, every step runs one pass; once
    it has finished, the others' tokens in flight go on in chains. Every request keeps plain decoding's
    tokens."""
    params = [greedy(logprobs=1, max_tokens=4)] + [greedy()] * (len(PROMPTS) - 1)
    base, _, _ = run(TRAINED, params, False)
    outputs, stats, _ = run(TRAINED, params, True)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]
    assert len(outputs[0].logprobs) == 4 and stats.num_drafted > 0


@pytest.mark.parametrize("policy", ["step:1", "weighted", "threshold:0.5"])
def test_readout_policies_and_logprobs_as_plain_decoding(policy):
    """A finished token reads out under the request's policy from all its loops' states, the loops it ran as
    a draft included; its logprobs are plain decoding's, to fp32 rounding."""
    params = greedy(exit_policy=policy, logprobs=2, max_tokens=6)
    base, _, _ = run(TRAINED, params, False, prompts=PROMPTS[:2])
    outputs, stats, _ = run(TRAINED, params, True, prompts=PROMPTS[:2])
    assert stats.num_drafted > 0
    for want, got in zip(base, outputs, strict=True):
        assert got.token_ids == want.token_ids
        for w, g in zip(want.logprobs, got.logprobs, strict=True):
            assert list(g) == list(w)
            assert all(abs(g[t].logprob - w[t].logprob) <= 1e-4 for t in w)


def test_drafts_are_both_accepted_and_rejected_on_the_trained_model(pipelined):
    _, stats = pipelined(1)
    assert 0 < stats.num_accepted < stats.num_drafted


def test_random_weights_reject_and_still_equal(tiny_checkpoint):
    """Random weights: loop d-1's readout rarely agrees with the full model's, so nearly every draft is
    discarded, with its K/V, and the request goes on from the corrected token; after such a step it pauses
    drafting (PIPELINED_PAUSE tokens), so most tokens are verified by nobody."""
    base, _, _ = run(tiny_checkpoint, greedy(), False, prompts=PROMPTS[:3])
    outputs, stats, _ = run(tiny_checkpoint, greedy(), True, prompts=PROMPTS[:3])
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]
    assert stats.num_drafted > 0 and stats.num_accepted < stats.num_drafted / 4
    assert stats.steps < sum(o.depth.tokens for o in outputs) / 2


def test_drafts_pause_after_a_rejecting_step_and_resume_after_the_pause(plain, monkeypatch):
    """Every draft rejected, a pass a step: after each verification the request decodes PIPELINED_PAUSE (here
    3) tokens as plain decoding, all loops in one step and no draft (Scheduler.apply, ModelRunner
    ._lockstep_tokens), then drafts again. Of 10 tokens: the prompt's, token 2 verified, 3-5 plain, token 6
    verified, 7-9 plain, token 10 without a draft (max_tokens leaves it no room). The tokens stay plain
    decoding's."""
    monkeypatch.setattr(scheduler, "PIPELINED_PAUSE", 3)
    with engine_of(TRAINED, True, passes_per_step=1, max_num_batched_tokens=512) as engine:
        engine.runner.speculation.forced_acceptance = False
        lockstep, rows = engine.runner._lockstep_tokens, []
        engine.runner._lockstep_tokens = lambda batch, decode: rows.append(len(decode)) or lockstep(batch,
                                                                                                  decode)
        [out] = [o.outputs[0] for o in engine.generate(PROMPTS[:1], greedy(), use_tqdm=False)]
        assert_clean(engine)
    assert out.token_ids == plain[0]
    assert out.speculative.steps == 2 and rows == [1] * 6
    assert out.depth.passes == LOOPS * out.depth.tokens


def test_async_scheduling_runs_the_steps_whose_drafts_pause_ahead_with_the_same_tokens(monkeypatch):
    """async_scheduling=True (what None resolves to on CUDA): a step whose decode rows all pause their drafts
    is plain decoding, so it is launched before the step ahead of it is read (stepping.py: OverlappedStepper);
    loop passes still run synchronously. Every draft rejected (forced), a pause of 3 tokens, staggered
    lengths, a stop and a seeded sampled request: each request's tokens and text, its drafts and passes are
    the synchronous run's, and the greedy tokens plain decoding's."""
    monkeypatch.setattr(scheduler, "PIPELINED_PAUSE", 3)
    plain_run = run(TRAINED, greedy(max_tokens=24), False)[0]
    stop = plain_run[2].token_ids[17]
    params = [greedy(max_tokens=24), greedy(max_tokens=7), greedy(max_tokens=24, stop_token_ids=[stop]),
              SamplingParams(temperature=1.0, top_k=4, max_tokens=20, seed=3, ignore_eos=True)]
    runs = []
    for overlapped in (False, True):
        with engine_of(TRAINED, True, max_num_batched_tokens=512, async_scheduling=overlapped) as engine:
            engine.runner.speculation.forced_acceptance = False
            launch, launched = engine.runner.launch, []  # per launched step: its decode rows' pauses

            def spy(batch, previous=None, launch=launch, launched=launched):
                launched.append([r.drafts_paused for r in batch.requests
                                 if r.num_computed_tokens >= r.num_prompt_tokens])
                return launch(batch, previous)

            engine.runner.launch = spy
            outputs = [o.outputs[0] for o in engine.generate(PROMPTS, params, use_tqdm=False)]
            assert_clean(engine)
        runs.append((outputs, launched))
    (sync, none), (overlapped, launched) = runs
    assert not none and any(len(paused) > 1 for paused in launched)
    assert all(all(paused) for paused in launched)
    for want, got in zip(sync, overlapped, strict=True):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert (got.speculative.num_drafted, got.depth.passes) == (want.speculative.num_drafted,
                                                                    want.depth.passes)
    assert [o.token_ids for o in overlapped[:3]] == [plain_run[0].token_ids, plain_run[1].token_ids[:7],
                                                      plain_run[2].token_ids[:18]]
    assert overlapped[2].finish_reason == "stop" and sum(o.speculative.num_drafted for o in overlapped) > 0


def forced(checkpoint, pipelined: bool, accept: int, d: int = 2):
    """Outputs of a greedy run whose acceptance answer (SelfSpeculation.accept, asked by the speculative step
    and by pipelined speculation) is forced: every draft kept (accept=1) or none (accept=0). A token budget
    wide enough that every row reserves its k positions."""
    with engine_of(checkpoint, pipelined, d, speculative=f"loops:{d}", max_num_batched_tokens=512) as engine:
        engine.runner.speculation.forced_acceptance = bool(accept)
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS, greedy(), use_tqdm=False)]
        assert_clean(engine)
    return outputs


def test_acceptance_is_self_speculations_greedy_rule_and_an_accepted_draft_is_the_token(plain):
    """Pipelined speculation asks SelfSpeculation.accept whether a finished token confirms the draft behind
    it, as a speculative step does. Answered never: the trained model's drafts are all discarded, each token
    runs its T passes and the tokens stay plain decoding's. Answered always: each draft is the request's
    token, as a speculative step's accepted drafts are (the same tokens: both are the first d loops' greedy
    readout of the token before; the last token has no draft behind it, being no token's input, so it is the
    full model's), and every token after the first in flight takes d passes."""
    d = 2
    rejected = forced(TRAINED, True, accept=0, d=d)
    assert [o.token_ids for o in rejected] == plain
    for out in rejected:
        assert out.speculative.num_accepted == 0 < out.speculative.num_drafted
        assert out.depth.passes == LOOPS * out.depth.tokens
    pipelined, stepwise = forced(TRAINED, True, accept=1, d=d), forced(TRAINED, False, accept=1, d=d)
    assert [o.token_ids[:-1] for o in pipelined] == [o.token_ids[:-1] for o in stepwise]
    assert [o.token_ids for o in pipelined] != plain
    for out in pipelined:
        assert out.speculative.num_accepted == out.speculative.num_drafted == out.depth.tokens - 1
        assert out.depth.passes == LOOPS + d * (out.depth.tokens - 1)


def test_at_one_draft_loop_k_tokens_in_flight_keep_the_pipeline_full():
    """d = 1, k = T = 4: every draft kept, four tokens are in flight at loops 0..3, and each pass finishes
    one: after the first token (T passes), a token a pass. The draft behind the last in flight is made in the
    pass whose first token finishes, when the next pass's reservation reaches one position further."""
    for out in forced(TRAINED, True, accept=1, d=1):
        assert out.speculative.num_accepted == out.speculative.num_drafted == out.depth.tokens - 1
        assert out.depth.passes == LOOPS + (out.depth.tokens - 1)


def test_stops_and_max_tokens_inside_tokens_in_flight(plain):
    """A stop token, or max_tokens, reached while drafts are in flight ends the sequence there, as plain
    decoding ends it; the drafts behind it go with the request."""
    params = [greedy(max_tokens=1), greedy(max_tokens=3), greedy(stop_token_ids=[plain[2][5]]),
              greedy(max_tokens=6)]
    base, _, _ = run(TRAINED, params, False)
    outputs, _, _ = run(TRAINED, params, True)
    for want, got in zip(base, outputs, strict=True):
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert len(outputs[1].token_ids) == 3 and outputs[2].finish_reason == "stop"


def drive(engine: Engine, arrivals: dict[int, list[str]], abort_when=None) -> dict[str, list[int]]:
    """Add each step's arrivals, step until done; abort_when(engine) -> a request id to abort now (or None).
    The tokens of every request that finished without an abort."""
    tokens, step = {}, 0
    while engine.has_unfinished() or step <= max(arrivals):
        for prompt in arrivals.get(step, []):
            engine.add_request(prompt, greedy(), request_id=prompt)
        if abort_when is not None and (victim := abort_when(engine)) is not None:
            engine.abort(victim)
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 400
    return tokens


def test_staggered_arrivals_and_an_abort_mid_flight_keep_tokens_and_leak_nothing(plain):
    """Requests arrive while others have tokens in flight; one is aborted while it has two in flight: its
    blocks and tokens in flight go, and the others' tokens are plain decoding's."""
    arrivals = {0: [PROMPTS[0]], 2: [PROMPTS[1]], 5: [PROMPTS[2], PROMPTS[3]]}
    aborted = []

    def abort_when(engine):
        chain = engine.runner.in_flight.get(PROMPTS[1])
        if not aborted and chain is not None and len(chain) > 1:
            aborted.append(PROMPTS[1])
            return PROMPTS[1]
        return None

    with engine_of(TRAINED, True) as engine:
        tokens = drive(engine, arrivals, abort_when)
        assert_clean(engine)
    assert aborted and PROMPTS[1] not in tokens
    assert tokens == {p: plain[i] for i, p in enumerate(PROMPTS) if i != 1}


def test_preemption_drops_tokens_in_flight_and_keeps_greedy_tokens():
    """A pool too small for every sequence at once preempts: a preempted request's tokens in flight are
    dropped and its recompute starts at loop 0; no block is left behind and the tokens stay plain's."""
    prefix = "A long prefix shared by every request, long enough to fill blocks: "
    prompts = [prefix + p for p in PROMPTS]
    params = greedy(max_tokens=20)
    small = {"num_kv_blocks": 20, "block_size": 4, "admission": "greedy"}
    base, _, _ = run(TRAINED, params, False, prompts=prompts, **small)
    outputs, stats, preemptions = run(TRAINED, params, True, prompts=prompts, **small)
    assert preemptions > 0 and stats.num_accepted > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]


@pytest.mark.parametrize("engine_args, names", [
    ({"kv_layout": "latest"}, ["depth_batching=True", "speculative='loops:2'", "kv_layout='latest'"]),
    ({"exit_policy": "early:0.5"}, ["speculative='loops:2'", "exit_policy='early:0.5'"]),  # as today's
])
def test_unsupported_engine_options_are_refused_by_name(engine_args, names):
    with pytest.raises(ValueError) as err:
        engine_of(TRAINED, True, **engine_args)
    assert all(name in str(err.value) for name in names)


def test_huginn_is_refused_by_name():
    with pytest.raises(ValueError) as err:
        engine_of(ROOT / "model" / "checkpoints" / "tiny-huginn", True, loops=None)
    assert "depth_batching=True" in str(err.value) and "speculative='loops:2'" in str(err.value)
    assert "Huginn" in str(err.value)


def test_sampled_output_follows_the_plain_distribution():
    """Seeded sampling: a finished token with a sampled draft behind it is that draft, accepted with
    probability min(1, p/q), else a draw from the residual (runner/speculative.py's rule). Three sampled
    tokens (top_k=2: 8 outcomes) of 480 sequences, pipelined against plain decoding, as a two-sample
    chi-square test of homogeneity; drafts are both accepted and rejected. Seeds make it deterministic."""
    params = SamplingParams(temperature=1.5, top_k=2, max_tokens=3, ignore_eos=True, n=480, seed=7)

    def histogram(pipelined: bool):
        sizes = {"max_num_seqs": 256, "max_num_batched_tokens": 512}
        with engine_of(TRAINED, pipelined, d=1, **sizes) as engine:
            out = engine.generate(["Hello"], params, use_tqdm=False)[0]
            stats = engine.speculative_stats
            assert_clean(engine)
        counts: dict[tuple[int, ...], int] = {}
        for completion in out.outputs:
            key = tuple(completion.token_ids)
            counts[key] = counts.get(key, 0) + 1
        return counts, stats

    base, _ = histogram(False)
    spec, stats = histogram(True)
    assert 0 < stats.num_accepted < stats.num_drafted
    assert_same_distribution(base, spec)


def test_pass_graphs_static_path_carries_both_phases_and_keeps_tokens(plain):
    """The loop pass's static buffers (runner/pass_graphs.py, the code a CUDA capture records, run eagerly
    here) take a pipelined pass as any other: verifying and drafting rows of one request in one call, each at
    its own slot offset; every pass goes through them, and the tokens stay plain decoding's."""
    sizes = []
    with engine_of(TRAINED, True, max_num_batched_tokens=48) as engine:  # the requests decode together
        graphs = static_pass_graphs(engine, sizes)
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS, greedy(), use_tqdm=False)]
        assert graphs.passes == len(sizes) == engine.loop_stats.decode_passes and graphs.replays == 0
        assert_clean(engine)
    assert [o.token_ids for o in outputs] == plain
    assert max(sizes) > len(PROMPTS)  # more rows than requests: tokens in flight shared passes


@pytest.mark.parametrize("d", [1, 2])
def test_chain_graphs_body_gives_the_eager_chains_tokens_drafts_and_passes(plain, pipelined, d):
    """Every chained pass through the speculative chain graphs' static buffers (m rows a request, requests
    padded to a bucket as they finish): the eager chains' tokens, verifications and passes."""
    eager, eager_stats = pipelined(d)
    with engine_of(TRAINED, True, d) as engine:
        counts = static_chain_graphs(engine.runner)
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS, greedy(), use_tqdm=False)]
        stats = engine.speculative_stats
        assert_clean(engine)
    assert counts["runs"] > 0 and counts["bodies"] == counts["passes"]
    assert [o.token_ids for o in outputs] == plain
    assert (stats.num_drafted, stats.num_accepted) == (eager_stats.num_drafted, eager_stats.num_accepted)
    assert [o.depth.passes for o in outputs] == [o.depth.passes for o in eager]


@pytest.mark.parametrize("accept", [0, 1])
def test_chain_graphs_body_reads_the_forced_acceptance_from_the_device(accept):
    """A captured step cannot read SelfSpeculation.forced_acceptance on the host: it reads the device copy
    each chain fills. Forced, the passes a token are those of the eager chains."""
    eager = forced(TRAINED, True, accept)
    with engine_of(TRAINED, True, 2, max_num_batched_tokens=512) as engine:
        counts = static_chain_graphs(engine.runner)
        engine.runner.speculation.forced_acceptance = bool(accept)
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS, greedy(), use_tqdm=False)]
        assert_clean(engine)
    assert counts["bodies"] > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    for out in outputs:
        tokens = out.depth.tokens
        assert out.depth.passes == (LOOPS + 2 * (tokens - 1) if accept else LOOPS * tokens)


@pytest.mark.parametrize("accept, fused", [
    (None, False), (1, False), pytest.param(1, True, marks=pytest.mark.interpreter)])
def test_a_chain_of_the_last_chains_requests_goes_on_from_the_buffers_as_a_loaded_one(accept, fused):
    """A step whose requests are the last chain's, each with the tokens in flight that chain left, goes on
    from the static buffers (SpeculativeChainGraphs.resume: only reservations, slot and block tables are
    written): its tokens, verifications and passes a token are those of chains that load their rows every
    step (with the tensor step); with the trained model's own verdicts (accept None) and every draft kept
    (1); with the step that CUDA graphs record (fused: runner/chain_step_kernels.py, in the interpreter),
    which leaves the next pass's lengths and slot offsets in the buffers."""
    def generate(resume: bool):
        with engine_of(TRAINED, True, 2, max_num_batched_tokens=512) as engine:
            counts = static_chain_graphs(engine.runner)
            engine.runner.speculative_chains.graphs.fused = fused and resume
            if not resume:
                engine.runner.speculative_chains._seats_left = lambda requests, flights: None
            engine.runner.speculation.forced_acceptance = accept
            outputs = [o.outputs[0] for o in engine.generate(PROMPTS, greedy(max_tokens=40), use_tqdm=False)]
            stats = engine.speculative_stats
            assert_clean(engine)
        return outputs, (stats.num_drafted, stats.num_accepted), counts

    loaded, loaded_stats, none = generate(resume=False)
    resumed, stats, counts = generate(resume=True)
    assert none["resumed"] == 0 < counts["resumed"] < counts["runs"]
    assert [o.token_ids for o in resumed] == [o.token_ids for o in loaded]
    assert [o.depth.passes for o in resumed] == [o.depth.passes for o in loaded]
    assert stats == loaded_stats


def test_chains_load_their_rows_again_when_the_batch_or_its_tokens_in_flight_change():
    """Through the chain graphs' buffers, requests arrive and finish while others have tokens in flight, one
    with logprobs (its steps run one pass through the pass graphs' buffers, no chain) and one preempted:
    chains load their rows after such steps and go on from the buffers between them (both happen), and every
    request's tokens are plain decoding's."""
    prefix = "A long prefix shared by every request, long enough to fill blocks: "
    prompts = [prefix + p for p in PROMPTS]
    arrivals = {0: [0, 1], 4: [2], 9: [3]}
    params = {i: greedy(max_tokens=24) for i in range(4)}
    params[2] = greedy(max_tokens=5, logprobs=1)
    small = {"num_kv_blocks": 20, "block_size": 4, "admission": "greedy", "max_num_batched_tokens": 512}
    base = {i: o.token_ids for i, o in enumerate(run(TRAINED, [params[i] for i in range(4)], False, prompts,
                                                     **small)[0])}
    tokens, step = {}, 0
    with engine_of(TRAINED, True, **small) as engine:
        counts = static_chain_graphs(engine.runner)
        while engine.has_unfinished() or step <= max(arrivals):
            for i in arrivals.get(step, []):
                engine.add_request(prompts[i], params[i], request_id=str(i))
            for out in engine.step():
                if out.finished:
                    tokens[int(out.request_id)] = out.outputs[0].token_ids
            step += 1
            assert step < 400
        preemptions = engine.scheduler.num_preemptions
        assert_clean(engine)
    assert tokens == base
    assert preemptions > 0 and 0 < counts["resumed"] < counts["runs"]


# the hook points a decode pass reaches (a pass reads out and samples; the step's outcome is decided, applied
# and committed; a finished request is released); tests/test_step_faults.py covers the rest of a step
PASS_HOOKS = ["readout", "sample", "decide", "apply", "commit", "release"]


STOP = "e"
PIPELINED = {"depth_batching": True, "speculative": "loops:2"}
STEPPING = {"sync": {}, "async": {"async_scheduling": True}}  # async: the steps whose drafts pause run ahead


@pytest.fixture(scope="module")
def fault_free(tiny_checkpoint):
    """The outputs of a pipelined run without faults, per way of stepping (STEPPING), each run once."""
    return functools.cache(lambda stepping: outputs_without_faults(tiny_checkpoint, STOP, **PIPELINED,
                                                                   **STEPPING[stepping]))


@pytest.fixture(scope="module")
def pipelined_hook_calls(tiny_checkpoint):
    """Each hook point's calls in such a run, per way of stepping."""
    return functools.cache(lambda stepping: hook_calls(tiny_checkpoint, STOP, **PIPELINED,
                                                       **STEPPING[stepping]))


def test_the_fault_workload_runs_paused_steps_ahead_with_the_synchronous_outputs(tiny_checkpoint, fault_free):
    """The workload below, async: some steps are launched ahead (its drafts, on random weights, are rejected
    and pause), and the outputs are the synchronous run's."""
    launched = []
    with pytest.MonkeyPatch.context() as monkeypatch, small_engine(tiny_checkpoint, **PIPELINED,
                                                                   **STEPPING["async"]) as engine:
        launch = engine.runner.launch
        monkeypatch.setattr(engine.runner, "launch", lambda *args: launched.append(1) or launch(*args))
        assert outputs_of(engine, STOP) == fault_free("sync")
    assert launched and fault_free("async") == fault_free("sync")


@pytest.mark.parametrize("stepping", list(STEPPING))
@pytest.mark.parametrize("hook", PASS_HOOKS)
def test_a_keyboard_interrupt_mid_pass_loses_nothing(tiny_checkpoint, monkeypatch, fault_free,
                                                      pipelined_hook_calls, hook, stepping):
    """tests/test_step_faults.py's workload (preemption, logprobs, prompt logprobs, a trace, a stop string, a
    seeded row): a KeyboardInterrupt at a hook point of a step with tokens in flight (the middle one of its
    calls in a run) applies nothing of it (the tokens in flight stay as they were, the seeded generator too),
    and stepping on gives the outputs of a pipelined run without faults; async too, where paused steps run
    ahead."""
    with small_engine(tiny_checkpoint, **PIPELINED, **STEPPING[stepping]) as engine:
        assert interrupted_run(engine, monkeypatch, STOP, hook, pipelined_hook_calls(stepping)) == \
            fault_free(stepping)
        assert_released(engine)
        assert not engine.runner.in_flight and engine.speculative_stats.num_drafted > 0


@pytest.mark.interpreter
def test_a_pass_where_no_token_finishes_or_drafts_skips_the_head_and_changes_no_token():
    """At d = 2 of 4 loops a pass whose rows are at loops 0 and 2 reads out nothing: its head reads no
    weights (compute_logits' skip), and the tokens are those of the same run with every head computed,
    drafts forced accepted (a token every other pass, each draft's readout needed)."""
    tokens, flags = [], []
    for honour in (False, True):
        with engine_of(TRAINED, True, 2, max_num_batched_tokens=512) as engine:
            flags.append(skinny_head(engine, honour))
            engine.runner.speculation.forced_acceptance = True
            outputs = engine.generate(PROMPTS[:1], greedy(max_tokens=5), use_tqdm=False)
            tokens.append([o.outputs[0].token_ids for o in outputs])
            assert_clean(engine)
    assert tokens[0] == tokens[1] and flags[0] == flags[1]
    assert any(flags[1]) and not all(flags[1])


@pytest.mark.interpreter
@pytest.mark.parametrize("accept", [None, 0, 1])
@pytest.mark.parametrize("d", [1, 2])
def test_fused_step_between_passes_writes_the_tensor_steps_bits(plain, d, accept):
    """The fused step (one kernel a pass on CUDA) against the tensor operations it replaces, pass by pass, on
    every buffer: drafts accepted (the trained model), forced all and none (restarts, dropped drafts), at one
    and two draft loops; the tokens stay plain decoding's (the first 6 of them: each pass runs twice)."""
    with engine_of(TRAINED, True, d, max_num_batched_tokens=512) as engine:
        seen = shadowed_fused_steps(engine.runner)
        engine.runner.speculation.forced_acceptance = None if accept is None else bool(accept)
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS, greedy(max_tokens=6), use_tqdm=False)]
        assert_clean(engine)
        rows = len(PROMPTS) * engine.runner.speculative_chains.m
    assert len(seen) > 0 and max(seen) >= rows  # the requests decoded together
    if accept is None:
        assert [o.token_ids for o in outputs] == [tokens[:6] for tokens in plain]
