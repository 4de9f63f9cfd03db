"""Async scheduling (stepping.py: OverlappedStepper): the next step is scheduled and launched before this
one's tokens are read, and every request gets the tokens, text and finish that the synchronous path gives it;
a workload that ends by length runs the same batches either way; a pending token never shows in an output;
where the default (None) turns it on."""

import copy

import pytest
import torch

from engine import Engine, SamplingParams
from request import PENDING_TOKEN
from tests.test_step_faults import (HOOKS, Faults, assert_clean, drive, fault_free,  # noqa: F401 (a fixture)
                                    small_engine, summary, workload)

PROMPTS = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog again",
           "0123456789 + - * / = 42", "Once upon a time", "Looped models read their history four times"]


def completions(engine, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
            for out in engine.generate(prompts, params, use_tqdm=False)]


def both(options, prompts, params, checkpoint=None):
    """The completions of a synchronous and an async engine, and the batches each scheduled; both count the
    same prompt and decode tokens (a row run ahead for a request that had just stopped is not counted)."""
    results, batches, counts = [], [], []
    for mode in (False, True):
        with Engine(checkpoint, device="cpu", async_scheduling=mode, verbose=False, **options) as engine:
            assert engine.engine_config.overlaps_steps is mode
            scheduled = []
            schedule = engine.scheduler.schedule

            def recording():
                batch = schedule()
                scheduled.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
                return batch

            engine.scheduler.schedule = recording
            results.append(completions(engine, prompts, params))
            batches.append([b for b in scheduled if b])
            counts.append((engine.num_prefill_tokens, engine.num_decode_tokens))
            assert not engine.has_unfinished()
    assert counts[1] == counts[0]
    return results, batches


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40),  # the trained model stops at its end token
    SamplingParams(temperature=0, max_tokens=50, stop=[" the"]),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30, n=2),
], ids=["eos", "stop-string", "seeded-n2"])
def test_async_gives_the_synchronous_tokens(params):
    """The embedded model, chunked prefill (24-token budget) and five seats for six prompts, so rows join
    and leave mid-run: each completion equals the synchronous one."""
    (sync, overlapped), _ = both({"max_num_seqs": 5, "max_num_batched_tokens": 24}, PROMPTS, params)
    assert overlapped == sync


def test_a_length_ending_workload_runs_the_same_batches():
    """Requests that end by max_tokens give back their seat and blocks when the step that samples their
    last token is launched (retired): the async engine schedules exactly the synchronous batches."""
    params = [SamplingParams(temperature=0, max_tokens=5 + 7 * i, ignore_eos=True) for i in range(6)]
    (sync, overlapped), (sync_batches, async_batches) = both(
        {"max_num_seqs": 3, "max_num_batched_tokens": 16}, PROMPTS, params)
    assert overlapped == sync and async_batches == sync_batches


def test_preemption_and_prefix_hits_under_async(tiny_checkpoint):
    """A pool too small for every row (greedy admission preempts, and a preempted request may still have a
    token pending) and a shared prefix (hits): the synchronous tokens."""
    shared = "A looped model reads its own history four times over. " * 3
    prompts = [shared + tail for tail in ("one", "two", "three", "four")] + PROMPTS[:2]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    options = {"num_kv_blocks": 24, "admission": "greedy", "max_model_len": 160, "max_num_batched_tokens": 32}
    (sync, overlapped), _ = both(options, prompts, params, tiny_checkpoint)
    assert overlapped == sync
    with Engine(tiny_checkpoint, device="cpu", async_scheduling=True, verbose=False, **options) as engine:
        engine.generate(prompts, params, use_tqdm=False)
        assert engine.scheduler.num_preemptions > 0


def test_rows_that_read_the_host_run_synchronously_and_agree():
    """Penalties, logprobs and loop traces read tokens or logits on the host: a step with such a row waits
    for the one ahead of it, and every row still gets the synchronous result."""
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0, max_tokens=12)]
    runs = []
    for mode in (False, True):
        with Engine(device="cpu", async_scheduling=mode, verbose=False) as engine:
            outs = engine.generate(PROMPTS[:4], params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].text,
                          [sorted(d) for d in (o.outputs[0].logprobs or [])]) for o in outs])
    assert runs[1] == runs[0]


def test_a_pending_token_never_shows_and_abort_drops_it():
    """Outputs handed out while a step runs ahead hold known tokens only; aborting a request whose token is
    still pending finishes it with the tokens it had."""
    with Engine(device="cpu", async_scheduling=True, verbose=False) as engine:
        for out in engine.stream(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)):
            assert PENDING_TOKEN not in out.outputs[0].token_ids
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           request_id="r")
        seen = []
        while len(seen) < 3:
            seen += [o for o in engine.step() if o.outputs[0].token_ids]
        assert engine.stepper.pending is not None  # a step runs ahead
        assert engine.outputs.requests["r"].pending
        engine.abort("r")
        outs = engine.step()
        final = [o for o in outs if o.request_id == "r"]
        assert final and final[0].finished and final[0].outputs[0].finish_reason == "abort"
        assert PENDING_TOKEN not in final[0].outputs[0].token_ids
        assert len(final[0].outputs[0].token_ids) == len(seen[-1].outputs[0].token_ids)
        while engine.has_unfinished():
            engine.step()


@pytest.mark.parametrize("options,match", [
    ({"speculative": "loops:2"}, "speculative='loops:2'"),
    ({"exit_policy": "early:0.5"}, "exit_policy='early:0.5'"),
])
def test_async_refuses_steps_that_need_their_tokens_on_the_host(options, match):
    with pytest.raises(ValueError, match=match):
        Engine(device="cpu", async_scheduling=True, verbose=False, **options)
    with Engine(device="cpu", verbose=False, **options) as engine:  # auto: synchronous here
        assert not engine.engine_config.overlaps_steps


@pytest.mark.parametrize("options, overlaps", [
    ({}, True),
    ({"speculative": "loops:2"}, False),
    ({"exit_policy": "early:0.5"}, False),
    ({"depth_batching": True}, False),
    ({"depth_batching": True, "speculative": "loops:2"}, True),  # its steps whose drafts pause
])
def test_auto_is_async_on_cuda_where_steps_can_run_ahead(options, overlaps):
    """async_scheduling=None resolved for a CUDA device (the config's device set after construction)."""
    with Engine(device="cpu", verbose=False, **options) as engine:
        config = copy.copy(engine.engine_config)
    object.__setattr__(config, "device", torch.device("cuda"))
    assert config.overlaps_steps is overlaps


def test_async_scheduling_option_is_checked():
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        Engine(device="cpu", async_scheduling="yes", verbose=False)


def test_a_pending_token_without_its_step_is_refused():
    """The runner fails loudly rather than feed the placeholder id to the model."""
    with Engine(device="cpu", async_scheduling=True, verbose=False) as engine:
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()
        pending = engine.stepper.pending
        batch = engine.scheduler.schedule()
        assert any(r.pending for r in batch.requests)
        with pytest.raises(RuntimeError, match="pending"):
            engine.runner.prepare(batch)
        assert engine.runner.prepare(batch, pending).input_ids.min() >= 0


@pytest.mark.gpu
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40),
    [SamplingParams(temperature=0, max_tokens=5 + 7 * i, ignore_eos=True) for i in range(12)],
    SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
], ids=["eos", "length", "seeded"])
def test_async_on_cuda_gives_the_synchronous_tokens(params):
    """On CUDA (bf16, CUDA graphs for the decode steps, pinned uploads, tokens read back behind the step):
    the synchronous path's tokens, with chunked prefill and rows joining and leaving."""
    runs = []
    for mode in (False, True):
        with Engine(device="cuda", dtype="bfloat16", async_scheduling=mode, max_num_seqs=5,
                    max_num_batched_tokens=24, verbose=False) as engine:
            assert engine.uses_cuda_graphs
            runs.append(completions(engine, PROMPTS * 2, params))
    assert runs[1] == runs[0]


@pytest.mark.parametrize("options", [
    {"kv_sharing": "last"},
    {"kv_cache_dtype": "kvarn_k4v2_g64", "block_size": 64, "kv_tail_tokens": 16,
     "enable_prefix_caching": False},
], ids=["kv_sharing_last", "kvarn"])
def test_async_under_other_kv_layouts(tiny_checkpoint, options):
    params = [SamplingParams(temperature=0, max_tokens=30 + 9 * i, ignore_eos=True) for i in range(4)]
    (sync, overlapped), (sync_batches, async_batches) = both(
        {"max_num_seqs": 3, "max_num_batched_tokens": 32, **options}, PROMPTS[:4], params, tiny_checkpoint)
    assert overlapped == sync and async_batches == sync_batches


def test_requests_added_between_steps_and_host_reading_rows_join_a_running_pipeline():
    """Requests arrive while steps run ahead, some of them penalized (their steps run synchronously once the
    one ahead is resolved, without the rows whose requests it finished): each gets the tokens a synchronous
    engine gives it."""
    plans = [(PROMPTS[i], SamplingParams(temperature=0, max_tokens=24, stop=[" the"],
                                         repetition_penalty=1.2 if i % 2 else 1.0)) for i in range(6)]
    results = []
    for mode in (False, True):
        with Engine(device="cpu", async_scheduling=mode, max_num_batched_tokens=16, verbose=False) as engine:
            finished = {}
            for step in range(200):
                if step < len(plans):
                    engine.add_request(plans[step][0], plans[step][1], request_id=str(step))
                finished.update({o.request_id: (o.outputs[0].token_ids, o.outputs[0].text)
                                 for o in engine.step() if o.finished})
                if len(finished) == len(plans) and not engine.has_unfinished():
                    break
            results.append(finished)
    assert results[1] == results[0] and len(results[0]) == len(plans)


ASYNC_HOOKS = ["launch", "finish", "decide_pending", "decide_advance"]


def test_a_keyboard_interrupt_at_any_hook_point_loses_nothing_under_async(
        tiny_checkpoint, fault_free, monkeypatch):  # noqa: F811 (fault_free: the imported fixture)
    """tests/test_step_faults.py's workload and hook points with async scheduling, plus the async steps'
    own (launch, wait for the tokens, decide a launched step's provisional and final outcomes): stepping
    on after the interrupt, every request finishes once with the fault-free synchronous run's outputs, and
    every block is free. The workload's host-reading rows (logprobs, a trace, prompt logprobs) run
    synchronously; the steps after them run ahead."""
    stop, expected, _ = fault_free
    with small_engine(tiny_checkpoint, async_scheduling=True) as engine:
        faults = Faults(engine, monkeypatch)
        for name, owner in [("launch", engine.runner), ("finish", engine.runner),
                            ("decide_pending", engine.scheduler), ("decide_advance", engine.scheduler)]:
            monkeypatch.setattr(owner, name, faults.hook(name, getattr(owner, name)))
        drive(engine, workload(stop))  # fills the prefix cache as every later run finds it
        faults.calls.clear()
        drive(engine, workload(stop))
        counts = dict(faults.calls)
        assert all(counts.get(name) for name in ASYNC_HOOKS), counts  # steps did run ahead
        for name in HOOKS + ASYNC_HOOKS:
            for nth in sorted({1, -(-counts.get(name, 1) // 2)}):
                faults.armed = (name, nth)
                outputs, interrupts = drive(engine, workload(stop))
                assert interrupts == 1 and faults.armed is None, (name, nth)
                assert {i: summary(o) for i, o in outputs.items()} == expected, (name, nth)
                assert_clean(engine)


def test_a_sampling_error_ends_only_that_request_under_async(tiny_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with small_engine(tiny_checkpoint, async_scheduling=True) as engine:
        alone = engine.generate(PROMPTS[:2], params, use_tqdm=False)
        bad = SamplingParams(temperature=1.0, seed=7, max_tokens=6)
        generator_of = engine.runner.generator_of

        def failing_generator(request):  # as torch's generator fails inside the launched step
            if request.params.seed == 7:
                raise RuntimeError("Overflow when unpacking long")
            return generator_of(request)

        engine.runner.generator_of = failing_generator
        outputs = engine.generate(PROMPTS[:2] + ["Hello"], [params, params, bad], use_tqdm=False)
        engine.runner.generator_of = generator_of
        assert [o.outputs[0].token_ids for o in outputs[:2]] == [o.outputs[0].token_ids for o in alone]
        failed = outputs[2].outputs[0]
        assert failed.finish_reason == "error" and failed.error.startswith("sampling failed: ")
        assert_clean(engine)
