"""Continuous depth batching (Engine(depth_batching=True), runner/depth_passes.py): a decode step is one loop
pass with every decode row at its own loop. A request's tokens (and logprobs, to fp32 rounding; bitwise in
deterministic mode) equal those of the lockstep engine, under every exit policy the option takes, per-request
loops, both families, every dense KV layout (full, latest, the rings, kv_sharing="last"), an fp8 cache,
chunked prefill, staggered arrivals, preemption and seeded sampling; rows at different loops share passes;
an abort mid-token leaks nothing; what the option does not take yet is refused by name. All on CPU, fp32,
the torch backend (the Triton path under TRITON_INTERPRET=1)."""

import math

import pytest

from cli import main
from engine import Engine, SamplingParams
from exit_policy import ExitPolicy, parse_exit_policy
from runner.loop_driver import LoopStats
from tests.conftest import ROOT
from tests.test_step_faults import (HOOKS, assert_clean, hook_calls, interrupted_run,
                                    outputs_without_faults, small_engine)

PROMPTS = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog again and again",
           "0123456789 + - * / = 42"]
HUGINN = ROOT / "model" / "checkpoints" / "tiny-huginn"
HUGINN_PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9], [100, 3, 77, 250, 251, 252, 19, 5, 6, 60, 61]]
NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4  # fp32 rows computed in other batch shapes


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True, "logprobs": 1,
                             **overrides})


def run(checkpoint, prompts, params, depth_batching: bool, **engine_args):
    """Completions of the prompts (chunked prefill: 6 tokens a step, so prompt chunks and decode rows share
    steps), and the engine's LoopStats."""
    engine_args = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 6, "verbose": False,
                   **engine_args}
    with Engine(checkpoint, depth_batching=depth_batching, **engine_args) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.loop_stats
        assert not engine.runner.mid_tokens
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return [out.outputs[0] for out in outputs], stats


def assert_same_completions(lockstep, depth, bitwise: bool = False) -> None:
    for want, got in zip(lockstep, depth, strict=True):
        assert got.token_ids == want.token_ids
        if want.logprobs is not None:
            for w, g in zip(want.logprobs, got.logprobs, strict=True):
                assert list(g) == list(w)
                for token in w:
                    if bitwise:
                        assert g[token].logprob == w[token].logprob
                    else:
                        assert abs(g[token].logprob - w[token].logprob) <= LOGPROB_TOLERANCE
        if want.traces is not None:
            assert [t.exit_loop for t in got.traces] == [t.exit_loop for t in want.traces]
            assert [len(t.exit_pdf) for t in got.traces] == [len(t.exit_pdf) for t in want.traces]


def both(checkpoint, prompts, params, **engine_args):
    lockstep, lockstep_stats = run(checkpoint, prompts, params, False, **engine_args)
    depth, stats = run(checkpoint, prompts, params, True, **engine_args)
    assert_same_completions(lockstep, depth)
    assert stats.decode_tokens == lockstep_stats.decode_tokens
    assert stats.decode_loops == lockstep_stats.decode_loops  # the same loops, fewer weight reads
    return depth, stats


@pytest.mark.parametrize("loops", [1, 4])
def test_full_depth_gives_the_lockstep_tokens_and_logprobs(tiny_checkpoint, loops):
    completions, stats = both(tiny_checkpoint, PROMPTS, greedy(), loops=loops)
    for completion in completions:
        depth = completion.depth
        assert depth.tokens == NEW_TOKENS - 1  # the first token comes from the prompt's last chunk
        assert depth.loops_per_token == loops and depth.passes_per_token == loops
    assert stats.loops_per_pass > 1  # rows at different loops shared passes


def test_early_exit_at_mixed_loops_in_one_pass_gives_the_lockstep_tokens(tiny_checkpoint):
    """early:0.5 on the random tiny gate: tokens exit after loops 0..3 in a mix, rows at different loops
    share passes, and the traces (exit loops, pdfs run) are lockstep's."""
    completions, stats = both(tiny_checkpoint, PROMPTS, greedy(loop_trace=True), loops=4,
                              exit_policy="early:0.5")
    exit_loops = {t.exit_loop for c in completions for t in c.traces[1:]}
    assert len(exit_loops) >= 2 and max(exit_loops) < 4
    loops_run = [c.depth.loops for c in completions]
    assert len(set(loops_run)) > 1  # the requests' tokens ran different loops
    assert sum(loops_run) == stats.decode_loops
    assert stats.decode_passes < stats.decode_loops  # one pass served rows at different loops
    assert all(c.depth.passes == c.depth.loops for c in completions)  # no row waited a pass


def test_rows_at_different_loops_run_in_one_pass(tiny_checkpoint):
    """Requests whose prompts finish prefilling steps apart decode at different loops: the third starts its
    token while the first two are between their loops, and their rows share the passes, each at its own loop
    (the attention metadata moves them to different slots), so the passes are fewer than the loops run."""
    prompts = ["Hello", "Hello world, again", "Hello world, again and again, once more and then some more"]
    lockstep, _ = run(tiny_checkpoint, prompts, greedy(max_tokens=5), False, loops=4)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", loops=4, max_num_batched_tokens=6,
                depth_batching=True, verbose=False) as engine:
        pass_offsets = record_pass_offsets(engine)
        depth = [o.outputs[0] for o in engine.generate(prompts, greedy(max_tokens=5), use_tqdm=False)]
        stats = engine.loop_stats
    assert_same_completions(lockstep, depth)
    layers = 2  # the tiny checkpoint's: a row at loop t is t * 2 slots past loop 0's
    assert any(len(set(offsets)) > 1 for offsets in pass_offsets)  # rows at different loops in one call
    assert all(o % layers == 0 for offsets in pass_offsets for o in offsets)
    assert stats.decode_loops == 3 * 4 * 4 and stats.decode_passes < stats.decode_loops


def record_pass_offsets(engine: Engine) -> list[list[int]]:
    """Each loop pass's per-row slot offsets, as its attention metadata gives them, appended as it runs."""
    backend, prepare, pass_offsets = engine.backend, engine.backend.prepare, []

    def prepare_and_record(meta):
        if meta.slot_offsets_cpu is not None:
            pass_offsets.append(list(meta.slot_offsets_cpu))
        prepare(meta)

    backend.prepare = prepare_and_record
    return pass_offsets


def test_a_lone_decode_row_runs_its_token_in_one_step(tiny_checkpoint):
    """With no other row to share a pass, a token runs its loops back to back in one step (lockstep's path),
    one pass per loop it runs, and exits as lockstep does."""
    params = greedy(max_tokens=6)
    lockstep, _ = run(tiny_checkpoint, PROMPTS[:1], params, False, loops=4, exit_policy="early:0.5")
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", loops=4, exit_policy="early:0.5",
                depth_batching=True, verbose=False) as engine:
        pass_offsets = record_pass_offsets(engine)
        out = engine.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        stats = engine.loop_stats
    assert_same_completions(lockstep, [out])
    assert pass_offsets == []  # no loop pass ran
    assert stats.decode_passes == stats.decode_loops == out.depth.loops == out.depth.passes
    assert out.depth.tokens == 5 and stats.decode_loops < 5 * 4  # tokens exited early


@pytest.mark.parametrize("policy", ["step:1", "threshold:0.5", "weighted"])
def test_readout_policies_read_out_as_lockstep(tiny_checkpoint, policy):
    both(tiny_checkpoint, PROMPTS, greedy(exit_policy=policy, loop_trace=True), loops=4)


def test_an_exit_criterion_on_ouro_gives_the_lockstep_tokens_and_exits(tiny_checkpoint):
    completions, _ = both(tiny_checkpoint, PROMPTS, greedy(loop_trace=True), loops=4,
                          exit_policy="latent-diff:0.9")
    ran = {len(t.exit_pdf) for c in completions for t in c.traces[1:]}
    assert len(ran) > 1  # some tokens stopped early, others did not


def test_per_request_loops_give_the_lockstep_tokens(tiny_checkpoint):
    params = [greedy(loops=k) for k in (1, 4, 2, 3)]
    completions, _ = both(tiny_checkpoint, PROMPTS, params, loops=4)
    assert [c.depth.loops_per_token for c in completions] == [1, 4, 2, 3]


def test_seeded_sampling_keeps_each_requests_stream(tiny_checkpoint):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True,
                             logprobs=2) for s in range(len(PROMPTS))]
    both(tiny_checkpoint, PROMPTS, params, loops=3, exit_policy="early:0.5")


@pytest.mark.parametrize("policy", ["full", "early:0.5"])
def test_deterministic_mode_gives_lockstep_logprobs_bit_for_bit(tiny_checkpoint, policy):
    lockstep, _ = run(tiny_checkpoint, PROMPTS, greedy(), False, loops=3, deterministic=True,
                      exit_policy=policy)
    depth, _ = run(tiny_checkpoint, PROMPTS, greedy(), True, loops=3, deterministic=True, exit_policy=policy)
    assert_same_completions(lockstep, depth, bitwise=True)


@pytest.mark.parametrize("engine_args", [
    dict(passes_per_step=1), dict(exit_policy="early:0.5", passes_per_step=1),
    dict(passes_per_step=4), dict(exit_policy="early:0.5", passes_per_step=5)])
def test_preempted_rows_restart_their_token_and_give_the_lockstep_tokens(tiny_checkpoint, engine_args):
    """A pool too small for all four: preempted requests drop their token mid-loops and recompute, with one
    pass a step and with chains of passes (greedy rows without logprobs chain)."""
    params = greedy(max_tokens=24, logprobs=None)
    args = dict(loops=3, num_kv_blocks=16, block_size=4, enable_prefix_caching=False, admission="greedy",
                **engine_args)
    passes = args.pop("passes_per_step")
    lockstep, _ = run(tiny_checkpoint, PROMPTS, params, False, **args)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=6, verbose=False,
                depth_batching=True, passes_per_step=passes, **args) as engine:
        scheduler, preempt, mid_token_victims = engine.scheduler, engine.scheduler._preempt, []

        def preempt_and_record(request):
            mid_token_victims.append(request.request_id in engine.runner.mid_tokens)
            preempt(request)

        scheduler._preempt = preempt_and_record
        depth = [o.outputs[0] for o in engine.generate(PROMPTS, params, use_tqdm=False)]
        assert mid_token_victims and (passes > 1 or any(mid_token_victims))  # a row preempted between loops
        assert not engine.runner.mid_tokens
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    assert [c.token_ids for c in depth] == [c.token_ids for c in lockstep]


def test_staggered_arrivals_join_rows_mid_token(tiny_checkpoint):
    """Requests added while others are between their loops start at loop 0 beside them."""
    params = greedy(max_tokens=6)
    alone, _ = run(tiny_checkpoint, PROMPTS, params, False, loops=4)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", loops=4, depth_batching=True,
                verbose=False) as engine:
        ids, outputs, mid_token_seen = [], {}, False
        for prompt in PROMPTS:
            ids.append(engine.add_request(prompt, params))
            for _ in range(3):
                for out in engine.step():
                    outputs[out.request_id] = out
                mid_token_seen |= bool(engine.runner.mid_tokens)
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] = out
        assert mid_token_seen and not engine.runner.mid_tokens
    assert_same_completions(alone, [outputs[i].outputs[0] for i in ids])


def test_abort_mid_token_frees_the_rows_blocks_and_state(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", loops=4, depth_batching=True,
                verbose=False) as engine:
        first = engine.add_request("Hello there", greedy(max_tokens=20))
        second = engine.add_request("A looped language model", greedy(max_tokens=4))
        for _ in range(4):  # a step of prefill, then passes: its first generated token is mid-loops
            engine.step()
        assert first in engine.runner.mid_tokens
        engine.abort(first)
        finished = {}
        while engine.has_unfinished():
            for out in engine.step():
                finished[out.request_id] = out
        assert finished[first].outputs[0].finish_reason == "abort"
        assert len(finished[second].outputs[0].token_ids) == 4
        assert not engine.runner.mid_tokens
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_huginn_with_drawn_states_and_per_request_loops_gives_the_lockstep_tokens():
    params = [greedy(max_tokens=6, seed=s, loops=k) for s, k in zip(range(3), (4, 2, 3))]
    completions, stats = both(HUGINN, HUGINN_PROMPTS, params, loops=4, init_scale=1.0)
    assert [c.depth.loops_per_token for c in completions] == [4, 2, 3]
    assert stats.decode_passes < stats.decode_loops


def test_huginn_warm_start_under_a_criterion_gives_the_lockstep_tokens_and_exits():
    """kl through the coda at each check, from the previous token's raw last state (continuous_compute)."""
    completions = huginn_under_kl(0, 1, continuous_compute="raw")
    ran = {len(t.exit_pdf) for c in completions for t in c.traces[1:]}
    assert min(ran) < 8 and max(ran) == 8


def test_huginn_criterion_checking_every_other_loop_reads_out_its_last_check():
    """kl,min=2,every=2 over 8 loops: a token that never stops runs all 8 loops and reads out loop 6 through
    the coda, as lockstep does."""
    completions = huginn_under_kl(2, 2)
    runs = {(t.exit_loop, len(t.exit_pdf)) for c in completions for t in c.traces[1:]}
    assert (6, 8) in runs and any(n < 8 for _, n in runs)


def huginn_under_kl(min_loops: int, every: int, **engine_args):
    """Huginn's completions under kl (a threshold that stops some tokens early), depth-batched and lockstep
    alike (both() checks)."""
    from tests.reference_huginn import ReferenceHuginn
    from tests.test_huginn_adaptive import threshold_for

    threshold = threshold_for(ReferenceHuginn(HUGINN), ExitPolicy("kl", 1.0, min_loops, every), loops=8,
                              new_tokens=6)
    policy = str(parse_exit_policy(f"kl:{threshold!r},min={min_loops},every={every}", 8))
    engine_args = {"init_scale": 0, "max_num_batched_tokens": 4, **engine_args}
    completions, _ = both(HUGINN, HUGINN_PROMPTS, greedy(max_tokens=6, loop_trace=True), loops=8,
                          exit_policy=policy, **engine_args)
    return completions


@pytest.mark.parametrize("policy", ["full", "early:0.5"])
def test_kv_sharing_last_gives_the_lockstep_tokens(tiny_checkpoint, policy):
    """A generated token's one K/V per layer, rewritten at each of its loops: a row reads its request's
    prompt at its own loop's planes and the generated tokens' last-loop K/V, as lockstep."""
    _, stats = both(tiny_checkpoint, PROMPTS, greedy(loop_trace=True), loops=4, exit_policy=policy,
                    kv_sharing="last")
    assert stats.decode_passes < stats.decode_loops


def test_an_fp8_kv_cache_reads_each_rows_own_slot_scales(tiny_checkpoint):
    both(tiny_checkpoint, PROMPTS, greedy(), loops=3, exit_policy="early:0.5", kv_cache_dtype="fp8_e4m3")


def test_ring_layouts_give_the_lockstep_tokens_and_exits():
    """Over a ring (Huginn's latest-compress:6 under kl, compress:4 at full depth) a row at loop t reads the
    ring loop t mod K of its own request's tokens, whatever loops the other rows of its pass are at.
    Prompts are prefilled whole: over a ring a prompt's chunking changes its K/V, with or without depth
    batching."""
    completions = huginn_under_kl(0, 1, kv_layout="latest-compress:6", max_num_batched_tokens=64)
    assert len({len(t.exit_pdf) for c in completions for t in c.traces[1:]}) > 1
    both(HUGINN, HUGINN_PROMPTS, greedy(max_tokens=6), loops=8, init_scale=0, kv_layout="compress:4",
         max_num_batched_tokens=64)


@pytest.mark.interpreter
@pytest.mark.parametrize("engine_args", [dict(kv_cache_dtype="fp8_e4m3"), dict(kv_sharing="last")])
def test_triton_backend_gives_the_lockstep_tokens(tiny_checkpoint, engine_args):
    """The decode kernel's per-row planes and scales, and (kv_sharing="last") generated pages addressed from
    each row's own loop (its dense path: tests/test_row_slots.py)."""
    _, stats = both(tiny_checkpoint, PROMPTS[:2], greedy(max_tokens=5), loops=3, exit_policy="early:0.5",
                    attention="triton", **engine_args)
    assert stats.decode_passes < stats.decode_loops


@pytest.mark.parametrize("option, name", [
    (dict(kv_cache_dtype="kvarn_k4v2_g64", block_size=64), "kv_cache_dtype='kvarn_k4v2_g64'"),
    (dict(async_scheduling=True), "async_scheduling=True"),
])
def test_options_depth_batching_does_not_take_yet_are_refused_by_name(tiny_checkpoint, option, name):
    with pytest.raises(ValueError, match=f"depth_batching=True cannot be combined with {name}"):
        Engine(tiny_checkpoint, device="cpu", depth_batching=True, verbose=False, **option)


def test_depth_batching_must_be_a_bool(tiny_checkpoint):
    with pytest.raises(ValueError, match="depth_batching must be True or False"):
        Engine(tiny_checkpoint, device="cpu", depth_batching="yes", verbose=False)


def test_loops_per_pass_is_nan_before_any_pass():
    assert math.isnan(LoopStats().loops_per_pass)


def test_cli_depth_batching_flag_gives_the_lockstep_text(tiny_checkpoint, capsys):
    argv = ["generate", "--device", "cpu", "--threads", "1", "--temperature", "0", "--model",
            str(tiny_checkpoint), "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos", "--exit-policy",
            "early:0.5"]
    assert main(argv) == 0
    lockstep, _ = capsys.readouterr()
    assert main(argv + ["--depth-batching"]) == 0
    depth, err = capsys.readouterr()
    assert depth == lockstep and "depth_batching" in err


STOP = "e"


@pytest.fixture(scope="module")
def lockstep_outputs(tiny_checkpoint):
    return outputs_without_faults(tiny_checkpoint, STOP, exit_policy="early:0.5")


@pytest.fixture(scope="module")
def depth_hook_calls(tiny_checkpoint):
    return hook_calls(tiny_checkpoint, STOP, exit_policy="early:0.5", depth_batching=True)


@pytest.mark.parametrize("hook", HOOKS)
def test_a_keyboard_interrupt_mid_pass_loses_nothing(tiny_checkpoint, monkeypatch, lockstep_outputs,
                                                      depth_hook_calls, hook):
    """tests/test_step_faults.py's workload (preemption, logprobs, a trace, a seeded row) under early:0.5:
    a KeyboardInterrupt at a hook point of a step with rows between their loops (the middle one of its calls
    in a run) applies nothing of it (their tokens stay where they were), and stepping on gives the outputs of
    a lockstep run without faults."""
    with small_engine(tiny_checkpoint, exit_policy="early:0.5", depth_batching=True) as engine:
        assert interrupted_run(engine, monkeypatch, STOP, hook, depth_hook_calls) == lockstep_outputs
        assert_clean(engine)
        assert not engine.runner.mid_tokens
