"""generate() and stream() when things go wrong: an early exit of any kind aborts the call's own requests
(no KV blocks held, nothing computed later), interleaved calls each get their own outputs, and request ids
are checked for the whole call before anything is added."""

import pytest

from engine import Engine, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def engine(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", verbose=False) as engine:
        yield engine


def alone(engine, prompt, params=SHORT):
    return engine.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def assert_nothing_left(engine):
    """No request holds a block or waits to run, and the next call computes its own tokens only."""
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    prompt = engine.tokenizer.encode("a fresh prompt")
    prefill, decode = engine.num_prefill_tokens, engine.num_decode_tokens
    out = engine.generate([prompt], SHORT, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert (engine.num_prefill_tokens - prefill, engine.num_decode_tokens - decode) == (len(prompt), 4)
    assert not engine.has_unfinished() and not engine.outputs.groups and not engine.outputs.requests


def fail_on_step(engine, monkeypatch, number, error):
    """Make the engine's `number`-th step from now raise `error` before it runs."""
    real_step, count = engine._step, [0]

    def step():
        count[0] += 1
        if count[0] == number:
            raise error
        return real_step()

    monkeypatch.setattr(engine, "_step", step)


# -- early exits abort the call's own requests -------------------------------------------------------

def test_break_out_of_a_stream_aborts_its_unfinished_requests(engine):
    for out in engine.stream(["hello", "a b c", "x"], LONG):
        if len(out.outputs[0].token_ids) == 3:
            break
    assert_nothing_left(engine)


def test_an_exception_in_the_loop_over_a_stream_aborts_its_requests(engine):
    with pytest.raises(ZeroDivisionError):
        for out in engine.stream(["hello", "a b c"], LONG):
            if len(out.outputs[0].token_ids) == 2:
                1 / 0
    assert_nothing_left(engine)


def test_closing_a_stream_generator_aborts_its_requests(engine):
    outputs = engine.stream(["hello", "a b c"], LONG)
    next(outputs)
    outputs.close()
    assert_nothing_left(engine)


def test_a_stream_never_iterated_adds_nothing(engine):
    engine.stream(["hello"], LONG)
    assert not engine.has_unfinished() and not engine.outputs.groups
    assert_nothing_left(engine)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("step failed")], ids=repr)
def test_an_interrupted_generate_aborts_its_requests(engine, monkeypatch, error):
    fail_on_step(engine, monkeypatch, 4, error)
    with pytest.raises(type(error)):
        engine.generate(["hello", "a b c", "x y"], LONG, use_tqdm=False)
    monkeypatch.undo()
    assert_nothing_left(engine)


def test_an_interrupted_stream_aborts_its_requests(engine, monkeypatch):
    fail_on_step(engine, monkeypatch, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        list(engine.stream(["hello", "a b c"], LONG))
    monkeypatch.undo()
    assert_nothing_left(engine)


def test_an_early_exit_leaves_add_request_requests_running(engine, monkeypatch):
    mine = engine.add_request("one two", SHORT)
    fail_on_step(engine, monkeypatch, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.generate(["hello"], LONG, use_tqdm=False)
    monkeypatch.undo()
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == [mine] and finished[mine].outputs[0].token_ids == alone(engine, "one two")
    assert_nothing_left(engine)


# -- interleaved calls -------------------------------------------------------------------------------------

def test_two_interleaved_streams_both_complete_with_their_own_outputs(engine):
    expected = {p: alone(engine, p) for p in ("hello", "a b c", "x")}
    first, second = engine.stream(["hello", "a b c"], SHORT), engine.stream(["x"], SHORT)
    seen = {"first": [], "second": []}
    pending = {"first": first, "second": second}
    while pending:
        for name, outputs in list(pending.items()):
            out = next(outputs, None)
            if out is None:
                del pending[name]
            else:
                seen[name].append(out)
    for name, prompts in (("first", ["hello", "a b c"]), ("second", ["x"])):
        finals = [o for o in seen[name] if o.finished]
        assert sorted(o.prompt for o in finals) == sorted(prompts)  # each finishes once, in its own stream
        assert all(o.prompt in prompts for o in seen[name])
        assert all(o.outputs[0].token_ids == expected[o.prompt] for o in finals)
    assert_nothing_left(engine)


def test_generate_while_a_stream_is_open_leaves_the_stream_its_outputs(engine):
    expected = {p: alone(engine, p) for p in ("hello", "x y")}
    outputs = engine.stream(["hello"], SHORT)
    first = next(outputs)
    during = engine.generate(["x y"], SHORT, use_tqdm=False)
    rest = list(outputs)
    assert [o.prompt for o in during] == ["x y"] and during[0].outputs[0].token_ids == expected["x y"]
    assert {o.prompt for o in [first, *rest]} == {"hello"}
    assert [o.finished for o in [first, *rest]] == [False] * len(rest) + [True]
    assert rest[-1].outputs[0].token_ids == expected["hello"]
    assert_nothing_left(engine)


def test_step_while_a_stream_is_open_returns_only_add_request_outputs(engine):
    mine = engine.add_request("one two", SHORT)
    outputs = engine.stream(["hello"], SHORT)
    next(outputs)
    stepped = engine.step() + engine.step()
    assert stepped and {o.request_id for o in stepped} == {mine}
    streamed = list(outputs)
    assert streamed[-1].finished and streamed[-1].outputs[0].token_ids == alone(engine, "hello")
    while engine.has_unfinished():
        stepped += engine.step()
    assert [o.finished for o in stepped].count(True) == 1
    assert_nothing_left(engine)


# -- request ids -------------------------------------------------------------------------------------------

def test_caller_ids_never_clash_with_automatic_ids(engine):
    taken = [engine.add_request("one", SHORT, request_id=i) for i in ("1", "2", "0_4", "1_4")]
    outs = engine.generate(["a", "b", "c", "d"], [SHORT, SHORT, SamplingParams(n=2, max_tokens=3), SHORT],
                           use_tqdm=False)
    # The counter skips ids in use: 1 and 2, and 4 for the request of two samples (they would be 0_4, 1_4).
    assert [o.request_id for o in outs] == ["0", "3", "5", "6"]
    assert all(o.finished for o in outs) and [len(o.outputs) for o in outs] == [1, 1, 2, 1]
    finished = set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == set(taken)


@pytest.mark.parametrize("first, second", [("a", "a"), ("b", "0_b"), ("0_c", "c")])
def test_a_request_id_in_use_is_refused_before_anything_is_added(engine, first, second):
    engine.add_request("one", SamplingParams(n=2, max_tokens=2), request_id=first)
    before = len(engine.scheduler.waiting)
    with pytest.raises(ValueError, match=f"request_id {second!r} is already in use"):
        engine.add_request("two", SamplingParams(n=2, max_tokens=2), request_id=second)
    assert len(engine.scheduler.waiting) == before


def test_a_request_id_must_be_a_string(engine):
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.add_request("one", request_id=7)


def test_a_bad_parameter_anywhere_in_the_call_adds_nothing(engine):
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate(["a", "b", "c"], [SHORT, SHORT, "greedy"], use_tqdm=False)
    with pytest.raises(ValueError, match="exit_policy"):
        engine.generate(["a", "b"], [SHORT, SamplingParams(exit_policy="step:9")], use_tqdm=False)
    assert not engine.has_unfinished() and not engine.outputs.groups
