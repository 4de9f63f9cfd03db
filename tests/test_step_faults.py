"""Failures inside a step. One request's failure (its sampling, its detokenizing) ends that request alone
with finish_reason "error"; a KeyboardInterrupt anywhere in a step, at a hook point or at a random moment,
loses nothing: stepping on, every request finishes exactly once, with the outputs of the run that had no
fault, and every block is free. A request that can never be scheduled ends with an error instead of waiting.
"""

import os
import random
import signal
import sys
import threading
import time

import pytest

import outputs as outputs_module
from engine import Engine, SamplingParams
from request import Request
from runner import model_runner
from runner.interrupts import deferred_interrupts
from tests.conftest import ROOT

PROMPTS = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog",
           "0123456789 + - * / = 42", "Each pass refines the hidden state"]


def small_engine(checkpoint, **overrides) -> Engine:
    """A pool of 14 blocks of 4 tokens for five sequences that need 23 at their longest: under greedy
    admission they preempt."""
    options = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=16,
                   admission="greedy", verbose=False)
    return Engine(checkpoint, **{**options, **overrides})


def workload(stop: str | None = None) -> list[SamplingParams]:
    """Greedy rows with and without EOS, logprobs, prompt logprobs, a loop trace and a stop string, and one
    seeded sampling row (its generator must not advance in a step that is not applied)."""
    return [SamplingParams(temperature=0, max_tokens=10, logprobs=2),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, loop_trace=True),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, prompt_logprobs=1, stop=stop),
            SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)]


def drive(engine: Engine, params: list[SamplingParams], started=None, before_step=None,
          max_steps: int = 400) -> tuple[dict, int]:
    """Add the workload, call started(), step until nothing is unfinished, stepping on after every
    KeyboardInterrupt (calling before_step() before each step). Each request must finish exactly once.
    Returns {workload index: final output} and the interrupts seen."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    if started is not None:
        started()
    finished, interrupts = {}, 0
    for _ in range(max_steps):
        if before_step is not None:
            before_step()
        try:
            if not engine.has_unfinished():
                break
            outputs = engine.step()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished, f"request {out.request_id} finished twice"
                finished[out.request_id] = out
    else:
        raise AssertionError(f"still unfinished after {max_steps} steps")
    assert sorted(finished) == sorted(ids)
    return {n: finished[i] for n, i in enumerate(ids)}, interrupts


def summary(out) -> tuple:
    """What must equal the fault-free run: tokens, text, reasons, and the per-token extras' lengths and
    identities (their floats may round differently after a preemption the fault-free run did not have)."""
    c = out.outputs[0]
    return (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.error,
            [sorted(entry) for entry in c.logprobs or []], [t.exit_loop for t in c.traces or []],
            [sorted(entry) if entry else None for entry in out.prompt_logprobs or []])


def assert_clean(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.scheduler._streams
    assert not engine.outputs.requests
    assert not engine.runner.generators and not engine.runner.block_tables.synced


@pytest.fixture(scope="module")
def fault_free(tiny_checkpoint):
    """The workload's outputs without faults (the stop string cuts request 2 short), and the run's time."""
    with small_engine(tiny_checkpoint) as engine:
        plain, _ = drive(engine, workload())
        stop = plain[2].outputs[0].text[3:6]
        start = time.perf_counter()
        outputs, _ = drive(engine, workload(stop))
        elapsed = time.perf_counter() - start
        assert engine.scheduler.num_preemptions > 0
    assert outputs[2].outputs[0].finish_reason == "stop"
    return stop, {i: summary(o) for i, o in outputs.items()}, elapsed


class Faults:
    """Hook points: each raises KeyboardInterrupt at its n-th call once armed. "output" counts the outputs
    of finished requests only, the ones a lost hand-back would lose."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.armed: tuple[str, int] | None = None
        self.calls: dict[str, int] = {}
        self.fired = 0
        scheduler, runner, tokenizer = engine.scheduler, engine.runner, engine.tokenizer
        for name, owner, attribute in [("schedule", scheduler, "schedule"), ("decide", scheduler, "decide"),
                                       ("apply", scheduler, "apply"), ("commit", runner, "commit"),
                                       ("release", runner, "release"),
                                       ("cache_full_blocks", engine.block_manager, "cache_full_blocks"),
                                       ("prepare", runner, "prepare"), ("forward", runner, "forward"),
                                       ("readout", model_runner, "readout_logits"),
                                       ("sample", model_runner, "sample"),
                                       ("output", outputs_module, "request_output"),
                                       ("decode", tokenizer, "decode"), ("token_text", runner, "token_text")]:
            monkeypatch.setattr(owner, attribute, self.hook(name, getattr(owner, attribute)))
        stream = tokenizer.stream
        monkeypatch.setattr(tokenizer, "stream", lambda **options: self.hook("stream", stream(**options)))

    def hook(self, name: str, function):
        def hooked(*args, **kwargs):
            if name == "output" and not args[-1].finished:  # outputs.request_output(group)
                return function(*args, **kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.armed is not None and self.armed[0] == name:
                self.armed = (name, self.armed[1] - 1)
                if self.armed[1] == 0:
                    self.armed, self.fired = None, self.fired + 1
                    raise KeyboardInterrupt
            return function(*args, **kwargs)

        return hooked


HOOKS = ["schedule", "prepare", "forward", "readout", "sample", "token_text", "decide", "apply", "commit",
         "cache_full_blocks", "release", "stream", "decode", "output"]


def outputs_without_faults(checkpoint, stop: str, **options) -> dict:
    """summary() of each output of workload(stop) on small_engine(checkpoint, **options), in a run that finds
    the prefix cache an earlier run filled (as every run after the first does)."""
    with small_engine(checkpoint, **options) as engine:
        return outputs_of(engine, stop)


def outputs_of(engine: Engine, stop: str) -> dict:
    """summary() of each output of workload(stop) on the engine, run twice (the second finds the prefix cache
    the first filled)."""
    drive(engine, workload(stop))
    outputs, _ = drive(engine, workload(stop))
    return {i: summary(o) for i, o in outputs.items()}


def hook_calls(checkpoint, stop: str, **options) -> dict[str, int]:
    """Each hook point's calls in such a run."""
    with pytest.MonkeyPatch.context() as monkeypatch, small_engine(checkpoint, **options) as engine:
        faults = Faults(engine, monkeypatch)
        drive(engine, workload(stop))
        faults.calls.clear()
        drive(engine, workload(stop))
    return dict(faults.calls)


def interrupted_run(engine: Engine, monkeypatch, stop: str, hook: str, calls: dict[str, int]) -> dict:
    """summary() of each output of workload(stop) in a run with one KeyboardInterrupt at the middle of the
    hook point's `calls` (hook_calls), after a run that fills the prefix cache as that run finds it."""
    faults = Faults(engine, monkeypatch)
    drive(engine, workload(stop))
    faults.armed = (hook, -(-calls[hook] // 2))
    outputs, interrupts = drive(engine, workload(stop))
    assert interrupts == 1 and faults.armed is None
    return {i: summary(o) for i, o in outputs.items()}


def test_a_keyboard_interrupt_at_any_hook_point_loses_nothing(tiny_checkpoint, fault_free, monkeypatch):
    stop, expected, _ = fault_free
    with small_engine(tiny_checkpoint) as engine:
        faults = Faults(engine, monkeypatch)
        drive(engine, workload(stop))  # fills the prefix cache as every later run finds it
        faults.calls.clear()
        drive(engine, workload(stop))
        counts = dict(faults.calls)
        for name in HOOKS:
            for nth in sorted({1, -(-counts[name] // 2)}):
                faults.armed = (name, nth)
                outputs, interrupts = drive(engine, workload(stop))
                assert interrupts == 1 and faults.armed is None, (name, nth)
                assert {i: summary(o) for i, o in outputs.items()} == expected, (name, nth)
                assert_clean(engine)


@pytest.fixture
def sigint_in_engine_code():
    """SIGINT raises KeyboardInterrupt only when it lands in the engine's own code (a frame of the
    repository outside tests/), as a Ctrl-C does; one that lands in this test's loop is counted and dropped,
    since no engine can keep an output the caller itself drops."""
    state = {"raised": 0, "dropped": 0}

    def handler(signum, frame):
        while frame is not None and not frame.f_code.co_filename.startswith(str(ROOT)):
            frame = frame.f_back  # torch's, jinja2's: up to the engine code that called them
        if frame is None or frame.f_code.co_filename.startswith(str(ROOT / "tests")):
            state["dropped"] += 1
            return
        state["raised"] += 1
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    yield state
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_at_random_moments_loses_nothing(tiny_checkpoint, fault_free, sigint_in_engine_code):
    """Real SIGINTs from a timer thread, at random times of the run. Where one lands depends on the machine's
    timing (a run faster than the fault-free one outlives its timers, one in the test's loop is dropped), so
    the trials go on until 24 have landed in engine code rather than counting the landings of a fixed number
    of trials; the cap only stops a run in which SIGINTs never reach the engine."""
    stop, expected, elapsed = fault_free
    rng = random.Random(0)
    main = threading.main_thread().ident
    with small_engine(tiny_checkpoint) as engine:
        for trial in range(400):
            if sigint_in_engine_code["raised"] >= 24:
                break
            timers = [threading.Timer(rng.uniform(0, elapsed), signal.pthread_kill, (main, signal.SIGINT))
                      for _ in range(2)]

            def start_timers():
                for timer in timers:
                    timer.start()

            outputs, _ = drive(engine, workload(stop), start_timers)
            for timer in timers:
                timer.cancel()
                timer.join()
            assert {i: summary(o) for i, o in outputs.items()} == expected, trial
            assert_clean(engine)
    assert sigint_in_engine_code["raised"] >= 24, sigint_in_engine_code  # landed inside a step


class CallInterrupts:
    """A SIGINT delivered as a Python function of the engine is entered, which is one of the points where
    Python runs signal handlers: the SIGINT handler of that moment runs there (deferred_interrupts' inside a
    deferred section). Wall-clock SIGINTs mostly land after a torch op; these spread over the host code
    (scheduling, the commit, the outputs) as evenly as over its calls."""

    def __init__(self) -> None:
        self.calls, self.at = 0, set()
        self.engine_code, self.tests = str(ROOT), str(ROOT / "tests")

    def trace(self, frame, event: str, arg) -> None:
        filename = frame.f_code.co_filename
        if event == "call" and filename.startswith(self.engine_code) and not filename.startswith(self.tests):
            self.calls += 1
            if self.calls in self.at:
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)

    def enable(self) -> None:
        """Also after each interrupt: a trace function that raises is unset."""
        sys.settrace(self.trace)

    def run(self, engine: Engine, params: list[SamplingParams]) -> tuple[dict, int]:
        try:
            return drive(engine, params, started=self.enable, before_step=self.enable)
        finally:
            sys.settrace(None)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ctrl_c_at_random_function_calls_loses_nothing(tiny_checkpoint, fault_free, sigint_in_engine_code,
                                                       async_scheduling):
    """Also with async scheduling (stepping.py: OverlappedStepper), whose plain steps run ahead."""
    stop, expected, _ = fault_free
    rng = random.Random(1)
    injector = CallInterrupts()
    with small_engine(tiny_checkpoint, async_scheduling=async_scheduling) as engine:
        drive(engine, workload(stop))
        injector.run(engine, workload(stop))
        total = injector.calls
        trials = 35 if async_scheduling else 25
        for trial in range(trials):
            injector.calls, injector.at = 0, set(rng.sample(range(1, total), 4))
            outputs, _ = injector.run(engine, workload(stop))
            assert {i: summary(o) for i, o in outputs.items()} == expected, trial
            assert_clean(engine)
    assert sigint_in_engine_code["raised"] >= 3 * trials  # of 4 per trial, most land in engine code


def test_a_ctrl_c_as_step_hands_out_keeps_the_outputs_for_the_next_step(tiny_checkpoint):
    """A SIGINT while step() takes its finished outputs out of the inbox is deferred to the end of that
    section: the outputs it had taken are put back, and the next step() hands them out."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with small_engine(tiny_checkpoint) as engine:
            request_id = engine.add_request(PROMPTS[0], params)
            forget = engine.outputs.forget

            def interrupted_forget(group):
                os.kill(os.getpid(), signal.SIGINT)  # lands inside the deferred section
                forget(group)

            engine.outputs.forget = interrupted_forget
            outputs, interrupted = [], 0
            for _ in range(20):
                if outputs:
                    break
                try:
                    outputs = [o for o in engine.step() if o.finished]
                except KeyboardInterrupt:
                    interrupted += 1
                    engine.outputs.forget = forget
            assert interrupted == 1 and [o.request_id for o in outputs] == [request_id]
            assert len(outputs[0].outputs[0].token_ids) == 3 and not engine.has_unfinished()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_sigint_inside_a_deferred_section_raises_as_it_ends():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # the handler would have run by now, were it not deferred
                    reached.append(1)
        assert len(reached) == 1000
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


# -- one request's failure ---------------------------------------------------------------------------

def test_a_sampling_error_ends_only_that_request(tiny_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with small_engine(tiny_checkpoint) as engine:
        alone = engine.generate(PROMPTS[:2], params, use_tqdm=False)
        bad = SamplingParams(temperature=1.0, seed=7, max_tokens=6)
        generator_of = engine.runner.generator_of

        def failing_generator(request):  # as torch's generator fails inside the step
            if request.params.seed == 7:
                raise RuntimeError("Overflow when unpacking long")
            return generator_of(request)

        engine.runner.generator_of = failing_generator
        outputs = engine.generate(PROMPTS[:2] + ["Hello"], [params, params, bad], use_tqdm=False)
        engine.runner.generator_of = generator_of
        assert [o.outputs[0].token_ids for o in outputs[:2]] == [o.outputs[0].token_ids for o in alone]
        failed = outputs[2].outputs[0]
        assert failed.finish_reason == "error" and failed.error.startswith("sampling failed: ")
        assert failed.token_ids == []
        assert_clean(engine)
        again = engine.generate(PROMPTS[:2], params, use_tqdm=False)  # the engine is still usable
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in alone]


def test_a_detokenizer_error_ends_only_that_request(tiny_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with small_engine(tiny_checkpoint) as engine:
        clean = [o.outputs[0] for o in engine.generate(PROMPTS[:3], params, use_tqdm=False)]
        others = {t for c in clean[1:] for t in c.token_ids}
        position, token = next((i, t) for i, t in enumerate(clean[0].token_ids) if t not in others)
        stream = engine.tokenizer.stream

        def failing_stream(**options):
            piece = stream(**options)

            def step(t):
                if t == token:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken tokenizer")
                return piece(t)
            return step

        engine.scheduler.detokenizer = type("Broken", (), {"stream": staticmethod(failing_stream),
                                                           "decode": engine.tokenizer.decode})()
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS[:3], params, use_tqdm=False)]
        assert outputs[0].finish_reason == "error" and outputs[0].token_ids == clean[0].token_ids[:position]
        assert f"detokenizing token {token} failed: UnicodeDecodeError" in outputs[0].error
        assert outputs[1:] == clean[1:]
        assert_clean(engine)


def test_a_request_that_can_never_be_scheduled_errors_instead_of_waiting(tiny_checkpoint):
    """A leaked block (here: held by a request the scheduler never saw) shrinks the pool; a request sized
    for the whole pool passes admission, then can never get its blocks while nothing runs."""
    with small_engine(tiny_checkpoint, num_kv_blocks=8, max_num_batched_tokens=64) as engine:
        leak = Request("leak", [1], SamplingParams())
        engine.block_manager.append_slots(leak, 1)
        big = engine.add_request(list(range(3, 34)), SamplingParams(max_tokens=1))  # 32 tokens: 8 blocks
        small = engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=2))
        finished = {}
        for _ in range(10):
            finished.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        assert finished[big].finish_reason == "error"
        assert finished[big].error == ("cannot be scheduled: its first 31 tokens need 8 KV blocks, only 7 of "
                                       "the pool's 8 are free, and no running request holds the other 1")
        assert finished[small].finish_reason == "length"  # the queue behind it moved on
        assert not engine.has_unfinished()


class Positional:
    """A detokenizer whose pieces depend on the decoder's state, as real ones do around multi-byte
    characters: the n-th token fed reads "<n:token>". A decoder fed a token twice shows it."""

    def __init__(self) -> None:
        self.fail_at: int | None = None  # the n-th decoder made raises KeyboardInterrupt
        self.made = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{n}:{t}>" for n, t in enumerate(token_ids, 1))

    def stream(self, skip_special_tokens: bool = True):
        self.made += 1
        if self.made == self.fail_at:
            raise KeyboardInterrupt
        fed = []

        def step(token: int) -> str:
            fed.append(token)
            return f"<{len(fed)}:{token}>"
        return step


def test_scheduler_update_decides_every_row_before_applying_any(tiny_checkpoint):
    """An interrupt while detokenizing the second row leaves the first row unchanged too, and the first
    row's decoder, which had already taken the new token, is rebuilt rather than fed it twice."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with small_engine(tiny_checkpoint) as engine:
        engine.scheduler.detokenizer = detokenizer = Positional()
        expected = [o.outputs[0] for o in engine.generate(PROMPTS[:2], params, use_tqdm=False)]
        ids = [engine.add_request(prompt, params) for prompt in PROMPTS[:2]]
        engine.step()
        batch = engine.scheduler.schedule()
        result = engine.runner.run(batch)
        before = [(r.token_ids[:], r.num_computed_tokens, r.output_text) for r in batch.requests]
        engine.scheduler._streams.clear()  # both decoders are made anew, by replaying the output
        detokenizer.fail_at = detokenizer.made + 2  # the second request's
        with pytest.raises(KeyboardInterrupt):
            engine.scheduler.update(batch, result.tokens, result.errors)
        assert [(r.token_ids, r.num_computed_tokens, r.output_text) for r in batch.requests] == before
        engine.runner.rollback()
        finished = {}
        while engine.has_unfinished():
            for out in engine.step():
                completion = out.outputs[0]
                assert completion.text == detokenizer.decode(completion.token_ids)
                if out.finished:
                    finished[out.request_id] = completion
        assert [finished[i] for i in ids] == expected
