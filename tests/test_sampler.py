import pytest
import torch

from runner.sampler import apply_filters, process_logits, sample
from request import Request, SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    params = [SamplingParams(temperature=0)] * 2
    assert sample(logits, params, [None, None]).tolist() == [1, 0]


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    kept = apply_filters(logits, [SamplingParams(top_k=2)]).isfinite()
    assert kept.tolist() == [[False, True, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = apply_filters(probs.log(), [SamplingParams(top_p=0.7)]).isfinite()
    assert kept.tolist() == [[True, True, False, False]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = torch.tensor([[0.6, 0.3, 0.06, 0.04]])
    kept = apply_filters(probs.log(), [SamplingParams(min_p=0.1)]).isfinite()
    assert kept.tolist() == [[True, True, False, False]]


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    draws = [sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4000)])
             for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    freq = torch.bincount(draws[0], minlength=3).double() / 4000
    p = logits[0].double().softmax(-1)
    # Each frequency is a mean of 4000 Bernoulli(p) draws: within 5 standard errors (a 6e-7 chance per class
    # of failing for a correct sampler, whatever generator stream a torch build gives these seeds).
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / 4000).sqrt()).all()


def test_mixed_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.3, 1.0]])
    out = sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)],
                 [None, torch.Generator().manual_seed(0)])
    assert out.tolist() == [1, 2]  # top_k=1 leaves the sampled row only its maximum


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_p", 0.0),
                                          ("top_p", 1.5), ("top_k", -2),
                                          ("min_p", 2.0), ("seed", -1), ("max_tokens", 0), ("stop", [""]),
                                          ("stop_token_ids", [-3]), ("temperature", float("nan"))])
def test_bad_sampling_parameter_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _request(prompt, output, eos=(0,), **params):
    request = Request("r", list(prompt), SamplingParams(**params), eos_token_ids=eos)
    request.token_ids += output
    return request


def _reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's penalties, one logit at a time."""
    out = logits.clone()
    for token in range(logits.shape[-1]):
        value = out[token].item()
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count + presence * (count > 0)
        out[token] = value
    return out


@pytest.mark.parametrize("presence, frequency, repetition", [(0.5, 0.0, 1.0), (0.0, 0.3, 1.0),
                                                             (0.0, 0.0, 1.7), (-0.4, 1.2, 0.6),
                                                             (2.0, -2.0, 3.0)])
def test_penalties_match_a_plain_computation(presence, frequency, repetition):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=gen) * 3
    rows = [([1, 2, 2], [3, 3, 3, 4]), ([5], []), ([], [0, 11, 11])]
    requests = [_request(p, o, presence_penalty=presence, frequency_penalty=frequency,
                         repetition_penalty=repetition) for p, o in rows]
    expected = torch.stack([_reference_penalties(logits[i], p, o, presence, frequency, repetition)
                            for i, (p, o) in enumerate(rows)])
    assert torch.allclose(process_logits(logits, requests), expected, rtol=1e-6, atol=1e-6)


def test_penalties_change_only_their_own_rows_and_default_params_leave_logits_untouched():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    plain = _request([0], [2])
    assert process_logits(logits, [plain, plain]) is logits
    out = process_logits(logits, [plain, _request([0], [2], presence_penalty=1.0)])
    assert out.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 2.0]]


def test_penalties_apply_before_greedy_argmax():
    logits = torch.tensor([[0.0, 3.0, 2.9]])
    request = _request([0], [1], temperature=0, frequency_penalty=0.5)
    assert sample(process_logits(logits, [request]), [request.params], [None]).tolist() == [2]


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, 6)
    short = _request([4], [5], eos=(0,), min_tokens=2, stop_token_ids=[3])
    assert process_logits(logits, [short]).isinf().nonzero()[:, 1].tolist() == [0, 3]
    ignoring = _request([4], [5], eos=(0,), min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    assert process_logits(logits, [ignoring]).isinf().nonzero()[:, 1].tolist() == [3]
    reached = _request([4], [5, 5], eos=(0,), min_tokens=2, stop_token_ids=[3])
    assert process_logits(logits, [reached]) is logits


@pytest.mark.parametrize("temperature", [1e-39, 1e-20, 9.9e-6])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    logits = torch.tensor([[10.0, 80.0, 79.0, -5.0]] * 4)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
    assert all(p.greedy for p in params)
    draws = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
    assert draws.tolist() == [1, 1, 1, 1]


def test_the_smallest_sampling_temperature_stays_finite_and_samples_the_top_token():
    logits = torch.tensor([[10.0, 80.0, 79.0, -5.0], [30.0, -30.0, 29.0, 0.0]])
    params = [SamplingParams(temperature=1e-5), SamplingParams(temperature=1e-5, top_p=0.5, min_p=0.5)]
    assert not any(p.greedy for p in params)
    assert apply_filters(logits, params).softmax(-1).isfinite().all()
    assert sample(logits, params, [torch.Generator().manual_seed(0)] * 2).tolist() == [1, 0]


@pytest.mark.parametrize("seed, n", [(2**64, 1), (2**64 - 1, 2), (10**30, 1)])
def test_a_seed_torch_cannot_take_is_refused_by_sampling_params(seed, n):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed, n=n)


def test_the_largest_seeds_are_accepted_and_seed_a_generator():
    for seed, n in [(2**64 - 1, 1), (2**64 - 3, 3)]:
        params = SamplingParams(seed=seed, n=n)
        torch.Generator().manual_seed(params.seed + n - 1)


@pytest.mark.parametrize("field, value", [("n", 0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                          ("min_tokens", -1), ("skip_special_tokens", "no"),
                                          ("ignore_eos", 1), ("temperature", float("inf"))])
def test_bad_new_sampling_parameter_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
