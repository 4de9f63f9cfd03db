"""Self-speculative decoding for Huginn-0125 (runner/speculative.py, docs/speculative.md), on the embedded
tiny-huginn in fp32: a draft runs loops 0..d-1 and the coda on loop d-1's state; the verify continues loops
d..T-1 from there and runs the coda on the final state. Greedy tokens equal the non-speculative engine's
(itself the plain reference's: tests/test_huginn_engine.py) for every draft depth, with chunked prefill,
preemption and prefix caching; with seeded random initial states each drafted token starts from the state a
plain step draws for its (seed, position); every computed position's K/V, the coda slots the drafts wrote
included, is the full model's afterwards."""

import dataclasses

import pytest
import torch

from engine import Engine, SamplingParams
from tests.conftest import ROOT

CHECKPOINT = ROOT / "model" / "checkpoints" / "tiny-huginn"
PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9], [100, 3, 77, 250, 251, 252, 19, 5, 6, 60, 61]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LOOPS = 8


def run(params=GREEDY, prompts=PROMPTS, **options):
    """(token lists, speculative stats, preemptions, cached prompt tokens per output)."""
    options = {"device": "cpu", "dtype": "float32", "verbose": False, "loops": LOOPS, "init_scale": 0,
               **options}
    with Engine(CHECKPOINT, **options) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        return ([list(o.outputs[0].token_ids) for o in outputs], engine.speculative_stats,
                engine.scheduler.num_preemptions, [o.num_cached_tokens for o in outputs])


@pytest.fixture(scope="module")
def plain():
    return run()[0]


@pytest.mark.parametrize("d, k", [(2, 3), (6, 1), (6, 4), (7, 3)])
def test_greedy_speculative_tokens_are_the_non_speculative_ones(plain, d, k):
    tokens, stats, _, _ = run(speculative=f"loops:{d}", num_speculative_tokens=k, max_num_batched_tokens=6)
    assert tokens == plain
    assert stats.num_drafted > 0


def test_drafts_are_both_accepted_and_rejected():
    _, stats, _, _ = run(speculative="loops:6", num_speculative_tokens=3)
    assert 0 < stats.num_accepted < stats.num_drafted


def test_seeded_initial_states_give_the_non_speculative_tokens():
    seeded = [dataclasses.replace(GREEDY, seed=s) for s in (3, 4, 5)]
    plain = run(seeded, init_scale=1.0)[0]
    assert run(seeded, init_scale=1.0, speculative="loops:6")[0] == plain
    assert plain != run(GREEDY)[0]  # the drawn states change the tokens: the test sees them


def test_preemption_and_prefix_caching_keep_the_tokens(plain):
    tight = {"num_kv_blocks": 7, "block_size": 4, "admission": "greedy", "max_model_len": 28}
    tokens, _, preemptions, _ = run(speculative="loops:6", **tight)
    assert preemptions > 0 and tokens == run(**tight)[0]
    shared = [PROMPTS[2] + [1, 2, 3, 4, 5], PROMPTS[2] + [9, 8, 7, 6, 5]]
    with Engine(CHECKPOINT, device="cpu", dtype="float32", verbose=False, loops=LOOPS, init_scale=0,
                block_size=4, speculative="loops:6") as engine:
        first, hit = (engine.generate([p], GREEDY, use_tqdm=False)[0] for p in shared)
    assert hit.num_cached_tokens == 8
    assert [first.outputs[0].token_ids, hit.outputs[0].token_ids] == run(prompts=shared)[0]


def test_every_computed_positions_kv_is_the_full_models_the_coda_slots_included():
    """One request from a fresh engine holds blocks 0, 1, ... in order; its first prompt + max_tokens - 1
    positions were computed, by a plain step or a verify. Their K/V in every slot (prelude, loops, coda)
    must be what the plain engine stored: a draft's coda K/V (read out at loop d-1) left at an accepted
    position would differ by far more than the tolerance of two batch shapes' sums."""
    pools = []
    for options in ({}, {"speculative": "loops:4", "num_speculative_tokens": 3}):
        with Engine(CHECKPOINT, device="cpu", dtype="float32", verbose=False, loops=LOOPS, init_scale=0,
                    block_size=4, **options) as engine:
            engine.generate(PROMPTS[2:], GREEDY, use_tqdm=False)
            computed = len(PROMPTS[2]) + GREEDY.max_tokens - 1
            pools.append([cache.flatten(1, 2)[:, :computed].clone()
                          for cache in (engine.kv_pool.key_cache, engine.kv_pool.value_cache)])
    for plain_cache, speculative_cache in zip(*pools):
        torch.testing.assert_close(speculative_cache, plain_cache, rtol=1e-5, atol=1e-5)


def test_a_warm_start_is_refused_with_speculation_naming_both():
    with pytest.raises(ValueError, match="speculative='loops:6' cannot be combined with continuous_compute="):
        Engine(CHECKPOINT, device="cpu", verbose=False, speculative="loops:6", continuous_compute="raw")
