"""SamplingParams(logprobs=N, prompt_logprobs=N) in vLLM's shape, against the plain oracle in
tests/reference.py: the raw model distribution (log_softmax of the readout logits) in fp32, as close to the
exact (fp64) one as the fp32 oracle is (tests/numerics.py), the sampled or prompt token first with its rank,
then the top N; unchanged by chunked prefill, preemption and the prefix cache."""

import math

import pytest
import torch

from engine import Engine, SamplingParams
from runner.sampler import logprob_dicts, logprobs_topn
from request import Logprob
from tests.numerics import noise_bound
from tests.reference import ReferenceOuro

PROMPT = "A looped language model reads its own state again"


def test_logprobs_topn_gives_log_softmax_ranks_and_the_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    top = logprobs_topn(logits, torch.tensor([0, 2]), 2)
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(top.token_logprobs, expected[[0, 1], [0, 2]])
    assert top.token_ranks.tolist() == [3, 1]
    assert top.top_ids.tolist() == [[1, 2], [2, 3]]
    assert torch.allclose(top.top_logprobs, expected.gather(1, top.top_ids))


def test_logprob_dict_puts_the_given_token_first_then_the_top_n_once_each():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    dicts = logprob_dicts(logprobs_topn(logits, torch.tensor([0, 1]), 2), [2, 2], lambda t: f"<{t}>")
    assert list(dicts[0]) == [0, 1, 2]  # the given token is outside the top 2: N + 1 entries
    assert list(dicts[1]) == [1, 2]     # inside: N entries
    assert dicts[0][0].rank == 3 and dicts[0][1].rank == 1 and dicts[0][0].decoded_token == "<0>"
    assert dicts[1][1] == Logprob(pytest.approx(math.log(torch.softmax(logits[1], -1)[1].item())), 1, "<1>")


def test_logprobs_zero_gives_only_the_sampled_token():
    dicts = logprob_dicts(logprobs_topn(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), 0), [0])
    assert list(dicts[0]) == [0] and dicts[0][0].rank == 2


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", verbose=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def exact_reference(tiny_checkpoint):
    return ReferenceOuro(tiny_checkpoint, dtype=torch.float64)


def oracle_logprobs(oracle: ReferenceOuro, ids: list[int], policy: str = "full") -> torch.Tensor:
    """[S, V] log_softmax of the readout logits at every position (position p predicts token p + 1)."""
    states, gates = oracle.loop_states(ids)
    logits = torch.stack([oracle.readout(states[:, p], gates[:, p], policy) for p in range(len(ids))])
    return torch.log_softmax(logits, -1)


def check_against_oracle(entries, tokens, oracle, exact, first: int, n: int):
    """entries[i] is the dict for tokens[i], predicted at position first + i of the fp32 oracle's and the
    exact [S, V] log_softmax: ranks and the top n from the oracle, logprobs within noise_bound of exact."""
    assert len(entries) == len(tokens)
    bound = noise_bound(oracle, exact)
    for i, (entry, token) in enumerate(zip(entries, tokens)):
        expected = oracle[first + i]
        assert next(iter(entry)) == token
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top = expected.topk(n).indices.tolist()
        assert set(entry) == {token, *top}
        for t, lp in entry.items():
            assert abs(lp.logprob - exact[first + i, t].item()) <= bound


def test_generated_and_prompt_logprobs_match_the_oracle(engine, reference, exact_reference):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = engine.generate(PROMPT, params, use_tqdm=False)[0]
    prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
    oracle, exact = (oracle_logprobs(r, prompt + generated) for r in (reference, exact_reference))
    check_against_oracle(out.outputs[0].logprobs, generated, oracle, exact, len(prompt) - 1, 3)
    assert out.prompt_logprobs[0] is None
    check_against_oracle(out.prompt_logprobs[1:], prompt[1:], oracle, exact, 0, 2)
    assert all(e[t].rank == 1 for e, t in zip(out.outputs[0].logprobs, generated))  # greedy
    assert out.outputs[0].logprobs[0][generated[0]].decoded_token == engine.tokenizer.decode([generated[0]])


def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling_knobs(engine):
    greedy = SamplingParams(temperature=0, max_tokens=1, logprobs=4)
    sampled = SamplingParams(temperature=0.3, top_k=2, seed=1, max_tokens=1, logprobs=4)
    a, b = (engine.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].logprobs[0] for p in (greedy, sampled))
    shared = set(a) & set(b)
    assert len(shared) >= 4 and all(a[t].logprob == b[t].logprob for t in shared)


def test_prompt_logprobs_survive_chunked_prefill_preemption_and_a_cached_prefix(tiny_checkpoint, engine,
                                                                                reference, exact_reference):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    whole = engine.generate(PROMPT, params, use_tqdm=False)[0]
    # Chunks of 5 tokens; a pool of 6 blocks of 4 tokens cannot hold three such sequences: preemption.
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=5, block_size=4,
                num_kv_blocks=12, admission="greedy", verbose=False) as small:
        outs = small.generate([PROMPT] * 3, params, use_tqdm=False)
        assert small.scheduler.num_preemptions > 0
    ids = whole.prompt_token_ids + whole.outputs[0].token_ids
    # Each run is within noise_bound of the exact answer, so the two are within twice that of each other.
    bound = 2 * noise_bound(*(oracle_logprobs(r, ids) for r in (reference, exact_reference)))
    for out in outs:
        assert out.outputs[0].token_ids == whole.outputs[0].token_ids
        assert out.num_cached_tokens == 0  # prompt logprobs are never served from the prefix cache
        for got, want in zip(out.prompt_logprobs[1:] + out.outputs[0].logprobs,
                             whole.prompt_logprobs[1:] + whole.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) <= bound for t in got)


@pytest.mark.parametrize("policy", ["step:1", "early:0.5"])
def test_prompt_logprobs_read_out_at_the_policy_loop(tiny_checkpoint, reference, exact_reference, policy):
    """Chunks of 6 tokens: the long prompt's chunks share steps with the short prompt's decode rows."""
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", exit_policy=policy, max_num_batched_tokens=6,
                verbose=False) as engine:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
        out = engine.generate(["Hi", PROMPT], params, use_tqdm=False)[1]
    prompt = out.prompt_token_ids
    readout = "threshold:0.5" if policy == "early:0.5" else policy  # prompt tokens run every loop
    oracle, exact = (oracle_logprobs(r, prompt, readout) for r in (reference, exact_reference))
    check_against_oracle(out.prompt_logprobs[1:], prompt[1:], oracle, exact, 0, 1)


def test_no_logprobs_asked_gives_none(engine):
    out = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocabulary_is_refused_by_name(engine, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=100000"):
        engine.generate(PROMPT, SamplingParams(**{field: 100000}), use_tqdm=False)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_negative_logprobs_is_named(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: -1})
