"""Per-request loop counts (SamplingParams.loops, docs/looped_controls.md): a request with loops=k in a batch
of requests at the engine's loops gives exactly the tokens of an Engine(loops=k) alone, and the others their
own, for Ouro (tiny-ouro) and Huginn-0125 (tiny-huginn, zero and seeded initial states), chunked, after
preemption and with readout policies; prefix-cache blocks are never shared between loop counts; the server
takes `loops` per request and echoes it; the combinations the engine cannot serve are refused by name."""

import dataclasses

import pytest

from engine import Engine, SamplingParams
from tests.conftest import ROOT

CHECKPOINTS = {"ouro": ROOT / "model" / "checkpoints" / "tiny-ouro",
               "huginn": ROOT / "model" / "checkpoints" / "tiny-huginn"}
FAMILY_OPTIONS = {"ouro": {}, "huginn": {"init_scale": 0}}
PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9], [100, 3, 77, 250, 251, 252, 19, 5, 6, 60, 61]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def generate(family: str, prompts, params, **options):
    """(token lists, the engine's preemptions, each output's cached prompt tokens, loops run by decode
    tokens)."""
    options = {"device": "cpu", "dtype": "float32", "verbose": False, **FAMILY_OPTIONS[family], **options}
    with Engine(CHECKPOINTS[family], **options) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = (engine.scheduler.num_preemptions, [o.num_cached_tokens for o in outputs],
                 engine.loop_stats.decode_loops)
    return [list(o.outputs[0].token_ids) for o in outputs], *stats


def solo(family: str, params, loops: int, **options) -> list[list[int]]:
    """Each prompt's tokens from an engine of `loops` loops."""
    return generate(family, PROMPTS, params, loops=loops, **options)[0]


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_a_request_with_fewer_loops_gets_the_tokens_of_an_engine_of_that_many(family):
    engine_loops = 4
    mixed = [GREEDY, dataclasses.replace(GREEDY, loops=1), dataclasses.replace(GREEDY, loops=2)]
    tokens, _, _, decode_loops = generate(family, PROMPTS, mixed, loops=engine_loops)
    full, one, two = (solo(family, GREEDY, k) for k in (engine_loops, 1, 2))
    assert tokens == [full[0], one[1], two[2]]
    assert one[1] != full[1]  # the loop count changes these tokens
    # each generated token fed back runs its request's loops (the last token of each is never fed back)
    assert decode_loops == (GREEDY.max_tokens - 1) * (engine_loops + 1 + 2)
    # chunked prefill: a request's prompt chunks stop at its loops too
    assert generate(family, PROMPTS, mixed, loops=engine_loops, max_num_batched_tokens=4)[0] == tokens


def test_huginn_seeded_initial_states_with_fewer_loops_are_an_engine_of_that_many():
    seeded = dataclasses.replace(GREEDY, seed=1234)
    mixed = [dataclasses.replace(GREEDY, seed=5), dataclasses.replace(seeded, loops=3), seeded]
    tokens = generate("huginn", PROMPTS, mixed, loops=6, init_scale=1.0)[0]
    assert tokens[1] == generate("huginn", PROMPTS[1:2], seeded, loops=3, init_scale=1.0)[0][0]
    assert tokens[2] == generate("huginn", PROMPTS[2:], seeded, loops=6, init_scale=1.0)[0][0]


def test_readout_policies_and_traces_read_the_requests_own_loops():
    """Ouro's exit gate over k loops: the last of the k takes the remaining mass, as in an engine of k
    (deterministic mode: the gate's bits do not depend on the rows beside it)."""
    params = dataclasses.replace(GREEDY, exit_policy="weighted", loop_trace=True)
    options = {"device": "cpu", "dtype": "float32", "verbose": False, "deterministic": True}
    with Engine(CHECKPOINTS["ouro"], **options) as engine:
        mixed = engine.generate(PROMPTS[:2], [params, dataclasses.replace(params, loops=2)], use_tqdm=False)
    with Engine(CHECKPOINTS["ouro"], loops=2, **options) as engine:
        alone = engine.generate(PROMPTS[1:2], params, use_tqdm=False)[0].outputs[0]
    got = mixed[1].outputs[0]
    assert got.token_ids == alone.token_ids
    assert [t.exit_pdf for t in got.traces] == [t.exit_pdf for t in alone.traces]
    assert all(len(t.exit_pdf) == 2 for t in got.traces)
    assert all(len(t.exit_pdf) == 4 for t in mixed[0].outputs[0].traces)


def test_prefix_cache_blocks_are_never_shared_between_loop_counts():
    prompt = PROMPTS[2] + [1, 2, 3, 4, 5]  # 16 tokens: 3 full blocks of 4 can be cached
    two = dataclasses.replace(GREEDY, loops=2)
    with Engine(CHECKPOINTS["ouro"], device="cpu", dtype="float32", verbose=False, block_size=4) as engine:
        first = engine.generate([prompt], two, use_tqdm=False)[0]
        other = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
        again = engine.generate([prompt], two, use_tqdm=False)[0]
        default = engine.generate([prompt], dataclasses.replace(GREEDY, loops=4), use_tqdm=False)[0]
    assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 0)
    assert again.num_cached_tokens == 12 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # loops equal to the engine's is the engine's own count: it shares with requests that leave it unset
    assert default.num_cached_tokens == 12 and default.outputs[0].token_ids == other.outputs[0].token_ids


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_preempted_requests_with_their_own_loops_resume_token_identical(family):
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    mixed = [dataclasses.replace(long, loops=2), long, dataclasses.replace(long, loops=3)]
    tight = {"num_kv_blocks": 7, "block_size": 4, "admission": "greedy", "max_model_len": 28}
    tokens, preemptions, _, _ = generate(family, PROMPTS, mixed, loops=4, **tight)
    assert preemptions > 0
    assert tokens == [solo(family, long, 2)[0], solo(family, long, 4)[1], solo(family, long, 3)[2]]


def test_request_loops_outside_the_engine_or_with_what_it_cannot_serve_are_refused_by_name():
    with pytest.raises(ValueError, match=r"SamplingParams.loops must be an integer >= 1, got 0"):
        SamplingParams(loops=0)
    with Engine(CHECKPOINTS["ouro"], device="cpu", verbose=False) as engine:
        with pytest.raises(ValueError, match=r"SamplingParams.loops=5 exceeds the engine's 4 loops"):
            engine.generate(PROMPTS, SamplingParams(loops=5), use_tqdm=False)
        with pytest.raises(ValueError, match=r"step:2.*< loops \(2\)"):
            engine.add_request(PROMPTS[0], SamplingParams(loops=2, exit_policy="step:2"))
        assert not engine.has_unfinished()
    for options, named in (({"speculative": "loops:2"}, "speculative='loops:2'"),
                           ({"exit_policy": "early:0.5"}, "exit_policy='early:0.5'")):
        with Engine(CHECKPOINTS["ouro"], device="cpu", verbose=False, **options) as engine:
            with pytest.raises(ValueError, match=rf"SamplingParams.loops=2 cannot be combined with {named}"):
                engine.add_request(PROMPTS[0], SamplingParams(loops=2))


def test_the_server_takes_loops_per_request_and_echoes_it():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tests.test_server import MODEL, running_server, tiny_engine

    params = SamplingParams(temperature=0, max_tokens=6)
    with tiny_engine(loops=2) as engine:
        expected = engine.generate(["15+46="], params, use_tqdm=False)[0].outputs[0].text
    with running_server(tiny_engine()) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        out = client.completions.create(model=MODEL, prompt="15+46=", max_tokens=6, temperature=0,
                                        extra_body={"loops": 2})
        streamed = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
            stream=True, extra_body={"loops": 3}))
        default = client.completions.create(model=MODEL, prompt="15+46=", max_tokens=1)
    assert out.choices[0].text == expected and out.model_extra["loops"] == 2
    assert {chunk.model_extra["loops"] for chunk in streamed} == {3}
    assert default.model_extra["loops"] == 4
