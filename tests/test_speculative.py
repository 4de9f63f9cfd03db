"""Self-speculative decoding (runner/speculative.py, docs/speculative.md): greedy output equals the
non-speculative engine's and tests/reference.py's, token for token, for every draft depth d and draft length
k, with batching, chunked prefill, preemption, prefix caching and stops; sampled output follows the same
distribution; bad combinations fail at construction, naming both options.

The tests run the embedded trained model (its first loops already predict well, so most drafts are accepted,
and some are not: the tests assert both happen) and, for the rejection path alone, the random-weight tiny
checkpoint, whose shallow loops almost never agree with its full model."""

import math

import pytest
import torch

from engine import DEFAULT_MODEL, Engine, SamplingParams
from request import SpeculativeStats
from runner import sampler
from runner.speculative import SelfSpeculation

PROMPTS = ["12+7=19\n31+5=", "Hello", "4821+337=5158\n96+4=100\n7+", "0123456789 + - * / = 42"]
NEW_TOKENS = 12
TRAINED = DEFAULT_MODEL


def run(checkpoint, params, prompts=PROMPTS, **engine_args):
    engine_args.setdefault("max_num_batched_tokens", 12)  # chunked prefill: prompts and decodes share steps
    with Engine(checkpoint, device="cpu", dtype="float32", verbose=False, **engine_args) as engine:
        outputs = [out.outputs[0] for out in engine.generate(prompts, params, use_tqdm=False)]
        stats = engine.speculative_stats
        preemptions = engine.scheduler.num_preemptions
        ids = [engine.tokenizer.encode(p) for p in prompts]
    return outputs, stats, preemptions, ids


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def plain():
    outputs, _, _, ids = run(TRAINED, greedy())
    return [o.token_ids for o in outputs], ids


@pytest.fixture(scope="module")
def oracle_tokens(plain):
    from tests.reference import ReferenceOuro

    _, ids = plain
    reference = ReferenceOuro(TRAINED)
    return [reference.greedy(prompt, NEW_TOKENS) for prompt in ids]


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_non_speculative_and_reference(plain, oracle_tokens, d, k):
    outputs, stats, _, _ = run(TRAINED, greedy(), speculative=f"loops:{d}", num_speculative_tokens=k)
    tokens = [o.token_ids for o in outputs]
    assert tokens == plain[0]
    assert tokens == oracle_tokens
    assert stats.steps > 0 and stats.num_drafted > 0
    assert len(stats.proposed) <= k
    # Decode rows of steps shared with a prefill chunk produce one token outside any speculative step.
    assert 0 < stats.tokens <= sum(len(t) - 1 for t in tokens)


def test_drafts_are_both_accepted_and_rejected():
    """The equality above means something only if drafts are rejected (the target's token is used) and
    accepted (several tokens per step)."""
    _, stats, _, _ = run(TRAINED, greedy(), speculative="loops:1", num_speculative_tokens=4)
    assert 0 < stats.num_accepted < stats.num_drafted
    assert 1 < stats.tokens_per_step < 4


def test_random_weights_reject_and_still_equal(tiny_checkpoint, reference):
    """Random weights: the drafts are (nearly) all rejected, each step yields the target's token alone."""
    base, _, _, ids = run(tiny_checkpoint, greedy())
    spec, stats, _, _ = run(tiny_checkpoint, greedy(), speculative="loops:2", num_speculative_tokens=4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert [o.token_ids for o in spec][:2] == [reference.greedy(p, NEW_TOKENS) for p in ids[:2]]
    assert stats.num_accepted < stats.num_drafted / 4


def test_preemption_and_prefix_caching_keep_greedy_tokens():
    """A pool too small for every sequence at once preempts and recomputes; shared prefixes hit the cache.
    Drafts never preempt (a row drafts fewer tokens when its blocks are not free), and the tokens stay."""
    prefix = "The same long prefix shared by every request, long enough to fill blocks: "
    prompts = [prefix + p for p in PROMPTS] * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base, _, _, _ = run(TRAINED, params, prompts, num_kv_blocks=24, block_size=4, admission="greedy")
    spec, stats, preemptions, _ = run(TRAINED, params, prompts, num_kv_blocks=24, block_size=4,
                                      admission="greedy", speculative="loops:2", num_speculative_tokens=4)
    assert preemptions > 0
    assert stats.steps > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    with Engine(TRAINED, device="cpu", dtype="float32", verbose=False, speculative="loops:2",
                block_size=4) as engine:  # the cache: a second wave finds the first wave's blocks
        engine.generate(prompts[:1], params, use_tqdm=False)
        again = engine.generate(prompts, params, use_tqdm=False)
    assert all(out.num_cached_tokens > 0 for out in again)
    assert [out.outputs[0].token_ids for out in again] == [o.token_ids for o in base]


def test_stops_and_max_tokens_as_without_speculation(plain):
    """A stop token, a stop string or max_tokens inside a step's accepted tokens ends the sequence there,
    with the same text, finish_reason and stop_reason as one token per step."""
    tokens, _ = plain
    stop_id = tokens[0][5]  # a token the first prompt produces mid-step
    with Engine(TRAINED, device="cpu", dtype="float32", verbose=False) as engine:
        stop_text = engine.tokenizer.decode(tokens[2][3:5]).strip() or "e"
    cases = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_id], ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop=[stop_text], ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop=[stop_text], ignore_eos=True,
                            include_stop_str_in_output=True)]
    for params in cases:
        base, _, _, _ = run(TRAINED, params)
        spec, _, _, _ = run(TRAINED, params, speculative="loops:1", num_speculative_tokens=8)
        for a, b in zip(spec, base):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                (b.token_ids, b.text, b.finish_reason, b.stop_reason)
    assert any(o.finish_reason == "stop" for o in base)


def test_traces_and_logprobs_match_non_speculative():
    """Every token's loop trace and logprobs are the full model's at its position, whether it was an
    accepted draft or the target's own; the trace says which."""
    params = greedy(loop_trace=True, logprobs=3)
    base, _, _, _ = run(TRAINED, params)
    spec, _, _, _ = run(TRAINED, params, speculative="loops:2", num_speculative_tokens=4)
    labels = set()
    for a, b in zip(spec, base):
        assert a.token_ids == b.token_ids
        assert len(a.traces) == len(b.traces) == len(a.logprobs) == len(a.token_ids)
        for ta, tb in zip(a.traces, b.traces):
            assert ta.top_token_ids == tb.top_token_ids and ta.exit_loop == tb.exit_loop
            assert ta.exit_pdf == pytest.approx(tb.exit_pdf, abs=1e-5)
            labels.add(ta.draft)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert list(la) == list(lb)
            assert [x.logprob for x in la.values()] == \
                pytest.approx([x.logprob for x in lb.values()], abs=1e-4)
        assert a.speculative is not None and a.speculative.steps > 0
    assert {"accepted", "target"} <= labels  # the first token (prefill) has None


def test_readout_policies_other_than_full():
    """The verify reads out under the request's policy from all loops' states (draft loops included)."""
    for policy in ("step:1", "weighted", "threshold:0.5"):
        params = greedy(exit_policy=policy)
        base, _, _, _ = run(TRAINED, params)
        spec, _, _, _ = run(TRAINED, params, speculative="loops:2", num_speculative_tokens=4)
        assert [o.token_ids for o in spec] == [o.token_ids for o in base], policy


def test_speculative_sampling_keeps_the_target_distribution():
    """Leviathan et al.'s rule on a 6-token vocabulary: drafts from q, accepted with min(1, p/q), else a
    draw from the residual; the emitted first token follows p (chi-square, 20,000 draws)."""
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03]])
    q = torch.tensor([0.10, 0.10, 0.30, 0.30, 0.10, 0.10])
    generator = torch.Generator().manual_seed(0)

    class Runner:
        def generator_of(self, request):
            return generator

    speculation = SelfSpeculation.__new__(SelfSpeculation)
    speculation.runner = Runner()
    counts = torch.zeros(6)
    draws = 20_000
    for _ in range(draws):
        draft = int(torch.multinomial(q, 1, generator=generator))
        accepted, resampled = speculation._accept_sampled(None, [draft], [q], p)
        counts[draft if accepted else resampled] += 1
    expected = p[0] * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # the 0.999 quantile of chi-square with 5 degrees of freedom


def test_sampled_engine_output_follows_the_non_speculative_distribution(tiny_checkpoint):
    """Through the engine: three sampled tokens (top_k=2, so 8 outcomes) of 480 sequences, speculative
    against not, as a two-sample chi-square test of homogeneity. Seeds make it deterministic."""
    params = SamplingParams(temperature=1.5, top_k=2, max_tokens=3, ignore_eos=True, n=480, seed=7)

    def histogram(**engine_args):
        with Engine(tiny_checkpoint, device="cpu", dtype="float32", verbose=False, max_num_seqs=256,
                    **engine_args) as engine:
            out = engine.generate(["Hello"], params, use_tqdm=False)[0]
        counts: dict[tuple[int, ...], int] = {}
        for completion in out.outputs:
            key = tuple(completion.token_ids)
            counts[key] = counts.get(key, 0) + 1
        return counts

    base = histogram()
    spec = histogram(speculative="loops:1", num_speculative_tokens=2)
    assert_same_distribution(base, spec)


def test_stats_per_position():
    stats = SpeculativeStats()
    stats.add(4, 4)  # every draft accepted: 4 tokens
    stats.add(4, 1)  # one accepted, then the target's: 2 tokens
    stats.add(2, 0)  # none: the target's token alone
    assert stats.proposed == [3, 3, 2, 2] and stats.accepted == [2, 1, 1, 1]
    assert stats.num_drafted == 10 and stats.num_accepted == 5 and stats.acceptance_rate == 0.5
    assert stats.acceptance_by_position == [2 / 3, 1 / 3, 0.5, 0.5]
    assert stats.tokens == 7 and stats.tokens_per_step == 7 / 3


@pytest.mark.parametrize("engine_args, names", [
    (dict(speculative="loops:4"), ["speculative", "1..3"]),
    (dict(speculative="loops:0"), ["speculative"]),
    (dict(speculative="layers:2"), ["speculative", "loops:d"]),
    (dict(speculative="loops:2", num_speculative_tokens=0), ["num_speculative_tokens"]),
    (dict(num_speculative_tokens=4), ["num_speculative_tokens", "speculative"]),
    (dict(speculative="loops:2", exit_policy="early:0.5"), ["speculative", "exit_policy"]),
    (dict(speculative="loops:2", kv_sharing="last"), ["speculative", "kv_sharing"]),
    (dict(speculative="loops:2", loops=2), ["speculative", "1..1"]),
])
def test_bad_combinations_fail_at_construction(tiny_checkpoint, engine_args, names):
    with pytest.raises(ValueError) as error:
        Engine(tiny_checkpoint, device="cpu", verbose=False, **engine_args)
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize("field, value", [("min_tokens", 2), ("repetition_penalty", 1.2),
                                          ("presence_penalty", 0.5), ("frequency_penalty", 0.5)])
def test_unsupported_sampling_params_are_refused_naming_both(tiny_checkpoint, field, value):
    with Engine(tiny_checkpoint, device="cpu", verbose=False, speculative="loops:2") as engine:
        with pytest.raises(ValueError) as error:
            engine.add_request("Hello", SamplingParams(**{field: value}))
        assert field in str(error.value) and "speculative" in str(error.value)
        assert not engine.has_unfinished()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_and_eager_give_the_same_speculative_tokens(tiny_checkpoint, dtype):
    """On the GPU, drafts and verifies replay per-loop graphs (the verify's k rows per request included);
    eager gives the same tokens, and in fp32 both equal the non-speculative engine's."""
    params = greedy()
    outputs = {}
    speculative = dict(speculative="loops:2", num_speculative_tokens=4)
    for name, args in (("graphs", speculative), ("eager", {**speculative, "enforce_eager": True}),
                       ("plain", {})):
        with Engine(tiny_checkpoint, device="cuda", dtype=dtype, verbose=False, max_num_batched_tokens=12,
                    max_num_seqs=8, **args) as engine:
            if name == "graphs":
                assert engine.uses_cuda_graphs
            outputs[name] = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
    assert outputs["graphs"] == outputs["eager"]
    if dtype == "float32":
        assert outputs["graphs"] == outputs["plain"]


def test_a_failing_speculative_step_falls_back_and_isolates_the_row(monkeypatch):
    """A speculative step that raises (here: one row's draft sampling) reruns as a plain step, which isolates
    failing rows: the row whose sampling fails there too ends alone with finish_reason 'error', and the
    other keeps its greedy tokens."""
    original_draft, original_sample = SelfSpeculation.draft_tokens, sampler.sample
    failed = []

    def draft_tokens(self, logits, requests, draft_probs, rows):
        if any(r.params.temperature == 0.7 for r in requests):
            failed.append(True)
            raise RuntimeError("injected draft failure")
        return original_draft(self, logits, requests, draft_probs, rows)

    def sample(logits, params, generators):
        if failed and any(p.temperature == 0.7 for p in params):  # the fallback step's sampling, too
            raise RuntimeError("injected sampling failure")
        return original_sample(logits, params, generators)

    monkeypatch.setattr(SelfSpeculation, "draft_tokens", draft_tokens)
    monkeypatch.setattr("runner.model_runner.sample", sample)
    base, _, _, _ = run(TRAINED, greedy(), PROMPTS[:1])
    with Engine(TRAINED, device="cpu", dtype="float32", verbose=False, speculative="loops:2") as engine:
        good = engine.add_request(PROMPTS[0], greedy())
        bad = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.7, max_tokens=NEW_TOKENS))
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        assert engine.speculative_stats.steps > 0  # once the bad row is gone, the good one speculates
    assert failed
    assert done[bad].finish_reason == "error" and "injected sampling failure" in done[bad].error
    assert len(done[bad].token_ids) == 1  # its prefill token, before any speculative step
    assert done[good].token_ids == base[0].token_ids


def assert_same_distribution(base: dict, spec: dict) -> None:
    """Two histograms of outcomes (outcome -> count, the same number of draws each) pass a chi-square test of
    one distribution at the 0.999 level, over more than two outcomes."""
    outcomes = sorted(set(base) | set(spec))
    assert len(outcomes) > 2
    chi2 = 0.0
    for outcome in outcomes:
        a, b = base.get(outcome, 0), spec.get(outcome, 0)
        expected = (a + b) / 2
        chi2 += (a - expected) ** 2 / expected + (b - expected) ** 2 / expected
    dof = len(outcomes) - 1
    # Wilson-Hilferty: the chi-square 0.999 quantile for dof degrees of freedom.
    quantile = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < quantile
