"""Continuous batching gives each request exactly the tokens it gets alone (fp32, greedy)."""

import random

import pytest

from engine import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(path, **options):
    return Engine(path, device="cpu", dtype="float32", verbose=False, **options)


def _random_prompts(n, seed, low=1, high=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _alone(path, prompts, params=GREEDY):
    with _engine(path) as engine:
        return [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def prompts():
    return _random_prompts(32, seed=1)


@pytest.fixture(scope="module")
def alone(tiny_checkpoint, prompts):
    return _alone(tiny_checkpoint, prompts)


def test_request_alone_equals_request_in_batch_of_32(tiny_checkpoint, prompts, alone):
    with _engine(tiny_checkpoint) as engine:
        batched = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in batched] == alone


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(tiny_checkpoint, prompts, alone, budget):
    chosen = [0, 3, 5] if budget == 1 else range(12)
    with _engine(tiny_checkpoint, max_num_batched_tokens=budget) as engine:
        outputs = engine.generate([prompts[i] for i in chosen], GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [alone[i] for i in chosen]


def test_prefix_cache_hit_equals_miss(tiny_checkpoint):
    shared = _random_prompts(1, seed=7, low=40, high=40)[0]
    prompts = [shared + [11, 12, 13], shared + [21, 22]]
    with _engine(tiny_checkpoint, enable_prefix_caching=False) as engine:
        misses = engine.generate(prompts, GREEDY, use_tqdm=False)
    with _engine(tiny_checkpoint) as engine:
        first = engine.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
        second = engine.generate(prompts[1:], GREEDY, use_tqdm=False)[0]
    assert misses[0].num_cached_tokens == misses[1].num_cached_tokens == first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # two full blocks of 16 shared
    assert [first.outputs[0].token_ids,
            second.outputs[0].token_ids] == [m.outputs[0].token_ids for m in misses]


def test_preempted_request_resumes_token_identical(tiny_checkpoint, prompts, alone):
    with _engine(tiny_checkpoint, num_kv_blocks=20, block_size=4, admission="greedy") as engine:
        outputs = engine.generate(prompts[:8], GREEDY, use_tqdm=False)
        assert engine.scheduler.num_preemptions > 0
    assert [out.outputs[0].token_ids for out in outputs] == alone[:8]


def test_too_long_prompt_fails_alone_and_the_rest_finish(tiny_checkpoint):
    with _engine(tiny_checkpoint, max_model_len=64, num_kv_blocks=64, block_size=4) as engine:
        outputs = engine.generate([[5] * 10, [6] * 65, [7] * 12], GREEDY, use_tqdm=False)
    ok, bad, ok2 = (o.outputs[0] for o in outputs)
    assert bad.finish_reason == "error" and "max_model_len 64" in bad.error and bad.token_ids == []
    assert ok.finish_reason == ok2.finish_reason == "length" and len(ok.token_ids) == len(ok2.token_ids) == 12


def test_prompt_larger_than_the_whole_pool_fails_alone(tiny_checkpoint):
    with _engine(tiny_checkpoint, num_kv_blocks=4, block_size=4) as engine:
        outputs = engine.generate([[5] * 3, [6] * 40], SamplingParams(temperature=0, max_tokens=4),
                                  use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason in ("length", "stop")
    assert outputs[1].outputs[0].finish_reason == "error" and "whole pool" in outputs[1].outputs[0].error


def test_out_of_vocabulary_token_fails_that_request_alone(tiny_checkpoint):
    with _engine(tiny_checkpoint) as engine:
        outputs = engine.generate([[5, 6], [5, 10**6]], GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "length"
    assert outputs[1].outputs[0].finish_reason == "error" and "vocab" in outputs[1].outputs[0].error
