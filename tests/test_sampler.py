import pytest
import torch

from runner.sampler import apply_filters, sample
from request import SamplingParams


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
    freq = torch.bincount(draws[0], minlength=3).float() / 4000
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.03)


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
