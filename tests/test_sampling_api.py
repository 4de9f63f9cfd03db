"""vLLM's sampling extras through the whole engine: n samples with derived seeds, penalties against the fp32
oracle, min_tokens, tiny temperatures and the largest seeds."""

import pytest

from engine import Engine, SamplingParams
from tests.test_sampler import _reference_penalties


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", verbose=False) as engine:
        yield engine


def _tokens(engine, prompt, **params):
    return [c.token_ids for c in engine.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs]


def test_n_samples_come_back_in_one_output_each_as_its_derived_seed_alone(engine):
    params = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    out = engine.generate(["hello", "a b"], SamplingParams(n=3, seed=11, **params), use_tqdm=False)
    assert [[c.index for c in o.outputs] for o in out] == [[0, 1, 2], [0, 1, 2]]
    for o, prompt in zip(out, ["hello", "a b"]):
        # vLLM's derivation: sample i of a request seeded s is the request seeded s + i, sampled alone.
        assert [c.token_ids for c in o.outputs] == [_tokens(engine, prompt, seed=11 + i, **params)[0]
                                                    for i in range(3)]
        assert len({tuple(c.token_ids) for c in o.outputs}) == 3
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_n_greedy_samples_are_identical_and_finish_on_their_own(engine):
    base = _tokens(engine, "hello", temperature=0, max_tokens=6, ignore_eos=True)[0]
    out = engine.generate("hello", SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [base, base] and out.finished
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]


def test_n_through_add_request_comes_back_under_the_callers_id_and_aborts_together(engine):
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True)
    kept = engine.add_request("hello", params, request_id="pair")
    dropped = engine.add_request("a b", params, request_id="gone")
    seen = []
    outputs = engine.step()
    engine.abort(dropped)
    while engine.has_unfinished():
        outputs += engine.step()
    for out in outputs:
        seen.append(out.request_id)
        assert len(out.outputs) == 2
    final = {o.request_id: o for o in outputs if o.finished}
    assert set(seen) == {kept, dropped} and set(final) == {kept, dropped}
    assert [c.finish_reason for c in final[dropped].outputs] == ["abort", "abort"]
    assert [len(c.token_ids) for c in final[kept].outputs] == [30, 30]
    alone = [_tokens(engine, "hello", temperature=0.8, seed=1 + i, max_tokens=30, ignore_eos=True)[0]
             for i in range(2)]
    assert [c.token_ids for c in final[kept].outputs] == alone


def test_n_samples_share_the_prompts_prefix_blocks_once_cached(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", block_size=4, verbose=False) as engine:
        prompt = list(range(5, 25))
        engine.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        out = engine.generate([prompt], SamplingParams(n=3, seed=0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)[0]
    assert out.num_cached_tokens == 16  # four full blocks of the twenty-token prompt, from the prefix cache


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
    dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=1.0)])
def test_greedy_tokens_under_penalties_match_the_oracle_with_plain_penalties(engine, reference, penalties):
    prompt = [7, 8, 9, 7, 8, 9, 10]
    got = _tokens(engine, prompt, temperature=0, max_tokens=10, ignore_eos=True, **penalties)[0]
    ids = list(prompt)
    for _ in range(10):
        logits = _reference_penalties(reference.next_logits(ids), prompt, ids[len(prompt):],
                                      penalties.get("presence_penalty", 0.0),
                                      penalties.get("frequency_penalty", 0.0),
                                      penalties.get("repetition_penalty", 1.0))
        ids.append(int(logits.argmax()))
    assert got == ids[len(prompt):]
    assert got != _tokens(engine, prompt, temperature=0, max_tokens=10, ignore_eos=True)[0]


def test_min_tokens_keeps_stop_tokens_out_of_the_first_tokens(engine):
    base = _tokens(engine, "hello", temperature=0, max_tokens=8, ignore_eos=True)[0]
    stops = [base[0], *engine.tokenizer.stop_token_ids]
    early = engine.generate("hello", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[base[0]]),
                            use_tqdm=False)[0].outputs[0]
    assert early.token_ids == [base[0]] and early.finish_reason == "stop"
    held = engine.generate("hello", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[base[0]],
                                                   min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) > 4 or held.finish_reason == "length"
    assert not set(held.token_ids[:4]) & set(stops)


@pytest.mark.parametrize("temperature", [1e-39, 1e-6])
def test_a_tiny_temperature_generates_the_greedy_tokens(engine, temperature):
    greedy = _tokens(engine, "hello", temperature=0, max_tokens=8, ignore_eos=True)
    assert _tokens(engine, "hello", temperature=temperature, seed=3, max_tokens=8, ignore_eos=True) == greedy


def test_the_largest_seed_samples_reproducibly_and_the_engine_stays_usable(engine):
    params = dict(temperature=1.0, seed=2**64 - 1, max_tokens=6, ignore_eos=True)
    first = _tokens(engine, "hello", **params)
    assert first == _tokens(engine, "hello", **params) and len(first[0]) == 6
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=2**64)
    assert _tokens(engine, "hello", temperature=0, max_tokens=2)[0]
