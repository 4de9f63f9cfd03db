"""Loop count, exit policies, early exit, loop traces and decode-time KV sharing (issue 6), against the
plain oracle in tests/reference.py: greedy tokens identical in fp32, exit pdfs within 1e-6.

Random tiny weights exit arbitrarily (with Q = 0.5 tokens exit after loop 1, 2, ... in a mix, which the
tests assert); a known exit pattern comes from zeroing the gate weight and setting its bias in the loaded
model and the oracle alike (exit_policy.force_exit_loop)."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from cache.blocks import BlockManager
from cache.kv_pool import slot_token_bytes
from cache.layout import PagedLayout, SharedLastLayout
from engine import Engine, SamplingParams
from exit_policy import (ExitPolicy, constant_gate_bias, exit_pdf, force_exit_loop, parse_exit_policy,
                         stack_traces)
from model.config import OuroConfig
from model.looped import SlotMap
from model.tiny import PRESETS, hf_config
from request import Request
from tests.conftest import ROOT
from tests.reference import ReferenceOuro

PROMPTS = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog again and again",
           "0123456789 + - * / = 42"]
NEW_TOKENS = 8
# Exit probabilities are compared within a bound derived from fp32 rounding itself, not tuned to one build:
# the engine and the oracle run the same fp32 arithmetic in different orders, so each is off the exact answer
# (the oracle in fp64) by rounding noise of the same size. The bound is NOISE_FACTOR times the largest such
# error of the fp32 oracle over the same prompts (the engine's error plus the oracle's, each allowed twice
# that maximum), plus a few units in the last place of a probability for values that round exactly.
NOISE_FACTOR = 4.0
PDF_FLOOR = 4 * 2.0**-24


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tests run many tiny matmuls: on a shared 2-core machine, OpenMP threads that wait for each
    other make them up to 20x slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generate(checkpoint, loops: int, params: list[SamplingParams] | SamplingParams, **engine_args):
    """Mixed batches: four prompts of different lengths, prefilled in chunks of 6 tokens per step, so
    prefill chunks and decode rows share steps."""
    engine_args.setdefault("max_num_batched_tokens", 6)
    with Engine(checkpoint, device="cpu", dtype="float32", loops=loops, verbose=False,
                **engine_args) as engine:
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
        prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        stats = engine.loop_stats
        replayed = engine.num_decode_tokens - sum(len(out.outputs[0].token_ids) - 1 for out in outputs)
    return [out.outputs[0] for out in outputs], prompt_ids, stats, replayed


def traced(policy: str | None = None, new_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, loop_trace=True,
                          exit_policy=policy)


class Oracle:
    """tests/reference.py in fp32 (what the engine must match) and in fp64 (the exact answer both round)."""

    def __init__(self, checkpoint, loops: int) -> None:
        self.fp32 = ReferenceOuro(checkpoint, loops=loops)
        self.fp64 = ReferenceOuro(checkpoint, loops=loops, dtype=torch.float64)

    def decode(self, prompts: list[list[int]], new_tokens: int, policy: str | list[str] = "full",
               kv_sharing: str = "none") -> tuple[list[list[int]], list[list[dict]], float]:
        """Greedy tokens and traces per prompt (fp32; one policy, or one per prompt), and the exit-pdf
        tolerance derived from them."""
        policies = [policy] * len(prompts) if isinstance(policy, str) else policy
        runs = [self.fp32.decode(ids, new_tokens, p, kv_sharing) for ids, p in zip(prompts, policies)]
        noise = 0.0
        for ids, p, (tokens, traces) in zip(prompts, policies, runs):
            exact_tokens, exact_traces = self.fp64.decode(ids, new_tokens, p, kv_sharing)
            for i, (got, want) in enumerate(zip(traces, exact_traces)):
                if tokens[:i] != exact_tokens[:i] or len(got["exit_pdf"]) != len(want["exit_pdf"]):
                    break  # past a divergence the fp64 run is another sequence
                noise = max([noise] + [abs(a - b) for a, b in zip(got["exit_pdf"], want["exit_pdf"])])
        return [t for t, _ in runs], [tr for _, tr in runs], NOISE_FACTOR * noise + PDF_FLOOR


def assert_traces_match(completion, oracle_traces, tolerance: float) -> None:
    assert len(completion.traces) == len(oracle_traces) == len(completion.token_ids)
    for got, want in zip(completion.traces, oracle_traces):
        assert len(got.exit_pdf) == len(want["exit_pdf"])
        assert max(abs(a - b) for a, b in zip(got.exit_pdf, want["exit_pdf"])) <= tolerance
        assert got.exit_loop == want["exit_loop"]
        assert got.top_token_ids == want["top_token_ids"]


# -- policies ----------------------------------------------------------------------------------------

def test_exit_policy_strings_parse_and_bad_ones_name_the_field():
    assert parse_exit_policy("full") == ExitPolicy("full")
    assert parse_exit_policy("threshold:0.5") == ExitPolicy("threshold", 0.5)
    assert parse_exit_policy("step:3", loops=4) == ExitPolicy("step", 3)
    assert parse_exit_policy("early:0.9") == ExitPolicy("early", 0.9)
    for bad in ("fast", "step:4", "step:-1", "step:x", "threshold", "threshold:-0.1", "early:nan",
                "weighted:1"):
        with pytest.raises(ValueError, match="exit_policy"):
            parse_exit_policy(bad, loops=4)
    with pytest.raises(ValueError, match="SamplingParams.exit_policy"):
        SamplingParams(exit_policy="sometimes")


def test_engine_validates_exit_policy_once_and_keeps_early_engine_wide(tiny_checkpoint):
    with pytest.raises(ValueError, match="exit_policy 'step:2'"):
        Engine(tiny_checkpoint, device="cpu", loops=2, exit_policy="step:2", verbose=False)
    with pytest.raises(ValueError, match="not both"):
        Engine(tiny_checkpoint, device="cpu", exit_policy="full", exit_threshold=0.5, verbose=False)
    with Engine(tiny_checkpoint, device="cpu", exit_threshold=0.5, verbose=False) as engine:
        assert engine.exit_policy == ExitPolicy("threshold", 0.5)
        with pytest.raises(ValueError, match="engine-wide"):
            engine.generate(["Hi"], SamplingParams(exit_policy="early:0.5"), use_tqdm=False)
        with pytest.raises(ValueError, match="SamplingParams.exit_policy 'step:4'"):
            engine.add_request("Hi", SamplingParams(exit_policy="step:4"))
    with Engine(tiny_checkpoint, device="cpu", exit_policy="early:0.5", verbose=False) as engine:
        with pytest.raises(ValueError, match="readout is fixed"):
            engine.add_request("Hi", SamplingParams(exit_policy="full"))


def test_exit_pdf_sums_to_one_and_last_loop_takes_the_rest():
    gates = torch.tensor([[0.3, -2.0], [1.0, 0.5], [9.0, -1.0]])
    pdf = exit_pdf(gates)
    assert torch.allclose(pdf.sum(0), torch.ones(2, dtype=torch.float64))
    lam = torch.sigmoid(gates.double())
    assert torch.allclose(pdf[2], (1 - lam[0]) * (1 - lam[1]))  # lambda_T is ignored


@pytest.mark.parametrize("loops", [1, 2, 3, 4])
def test_readout_policies_per_request_match_reference_fp32(tiny_checkpoint, loops):
    """One mixed batch, a different readout-only policy per request, each against the dense oracle."""
    policies = ["full", f"step:{loops // 2}", "threshold:0.5", "weighted"]
    completions, prompt_ids, _, _ = generate(tiny_checkpoint, loops, [traced(p) for p in policies])
    oracle = Oracle(tiny_checkpoint, loops)
    tokens, traces, tolerance = oracle.decode(prompt_ids, NEW_TOKENS, policies)
    for ids, policy, completion, want, trace in zip(prompt_ids, policies, completions, tokens, traces):
        assert completion.token_ids == oracle.fp32.greedy(ids, NEW_TOKENS, policy) == want, policy
        assert_traces_match(completion, trace, tolerance)
    if loops == 3:
        assert len({t.exit_loop for t in completions[2].traces}) > 1  # the threshold row exits at mixed loops


# -- early exit --------------------------------------------------------------------------------------

@pytest.mark.parametrize("loops", [1, 2, 3, 4])
def test_early_exit_matches_reference_with_copy_forward_fp32(tiny_checkpoint, loops):
    completions, prompt_ids, stats, _ = generate(tiny_checkpoint, loops, traced(), exit_policy="early:0.5")
    tokens, traces, tolerance = Oracle(tiny_checkpoint, loops).decode(prompt_ids, NEW_TOKENS, "early:0.5")
    for completion, want, trace in zip(completions, tokens, traces):
        assert completion.token_ids == want
        assert_traces_match(completion, trace, tolerance)
    loops_run = [len(t.exit_pdf) for c in completions for t in c.traces[1:]]  # traces[0]: the prompt's pass
    assert stats.decode_tokens == len(loops_run) and stats.decode_loops == sum(loops_run)
    if loops > 1:
        assert len(set(loops_run)) > 1 and stats.loops_per_token < loops  # mixed exits, fewer loops run


def test_early_exit_differs_from_threshold_readout_because_of_copy_forward(tiny_checkpoint):
    """threshold:Q reads out at the same loop but computes (and stores) every loop; early:Q does not."""
    early, _, _, _ = generate(tiny_checkpoint, 4, traced(), exit_policy="early:0.5")
    readout, _, _, _ = generate(tiny_checkpoint, 4, traced(), exit_policy="threshold:0.5")
    assert [c.token_ids for c in early] != [c.token_ids for c in readout]
    assert all(e.token_ids[0] == r.token_ids[0] for e, r in zip(early, readout))  # same first token


@pytest.mark.parametrize("exit_loop", [0, 2])
def test_early_exit_forced_by_gate_bias_runs_exactly_that_many_loops(tiny_checkpoint, exit_loop):
    reference = ReferenceOuro(tiny_checkpoint, loops=4)
    reference.w["model.early_exit_gate.weight"].zero_()
    reference.w["model.early_exit_gate.bias"].fill_(constant_gate_bias(exit_loop, 0.5))
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", exit_policy="early:0.5",
                verbose=False) as engine:
        force_exit_loop(engine.model, exit_loop, 0.5)
        outputs = engine.generate(PROMPTS, traced(), use_tqdm=False)
        stats = engine.loop_stats
        for prompt, out in zip(PROMPTS, outputs):
            tokens, _ = reference.decode(engine.tokenizer.encode(prompt), NEW_TOKENS, "early:0.5")
            assert out.outputs[0].token_ids == tokens
            assert {t.exit_loop for t in out.outputs[0].traces} == {exit_loop}
    assert stats.loops_per_token == exit_loop + 1


# -- KV sharing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("loops, policy",
                         [(1, "full"), (2, "full"), (3, "full"), (4, "full"), (3, "early:0.7")])
def test_kv_sharing_last_matches_reference_fp32(tiny_checkpoint, loops, policy):
    completions, prompt_ids, _, _ = generate(tiny_checkpoint, loops, traced(), exit_policy=policy,
                                             kv_sharing="last")
    tokens, traces, tolerance = Oracle(tiny_checkpoint, loops).decode(prompt_ids, NEW_TOKENS, policy, "last")
    for completion, want, trace in zip(completions, tokens, traces):
        assert completion.token_ids == want
        assert_traces_match(completion, trace, tolerance)


# kv_sharing="last" under `full` is left to the cheaper shared-last test below (Triton against torch).
@pytest.mark.parametrize("loops, policies, kv_sharing", [
    (3, ["full", "step:1", "threshold:0.5", "weighted"], "none"),
    (4, "early:0.5", "none"),
    (3, "early:0.7", "last"),
])
@pytest.mark.interpreter
def test_triton_backend_matches_reference_under_loop_controls_fp32(tiny_checkpoint, loops, policies,
                                                                   kv_sharing):
    """The Triton kernels, in the interpreter on CPU: mixed prefill + decode steps, exits that shrink the
    batch loop by loop, and generated tokens read from their shared pages, each against the oracle."""
    engine_policy = policies if isinstance(policies, str) else None
    new_tokens = 4  # the interpreter is slow; 4 tokens still give every prompt mixed and decode steps
    params = traced(new_tokens=new_tokens) if engine_policy else [traced(p, new_tokens) for p in policies]
    completions, prompt_ids, _, _ = generate(tiny_checkpoint, loops, params, attention="triton",
                                             exit_policy=engine_policy, kv_sharing=kv_sharing)
    tokens, traces, tolerance = Oracle(tiny_checkpoint, loops).decode(prompt_ids, new_tokens, policies,
                                                                      kv_sharing)
    for completion, want, trace in zip(completions, tokens, traces):
        assert completion.token_ids == want
        assert_traces_match(completion, trace, tolerance)


@pytest.mark.interpreter
def test_triton_shared_last_decode_over_a_long_prompt_matches_the_torch_backend(tiny_checkpoint):
    """kv_sharing="last" decode tiles that lie wholly in the prompt take the kernel's paged addressing; a
    prompt of several tiles (decode tiles are 32 keys in fp32) puts tiles on both sides of the boundary."""
    prompt = [3 + (7 * i) % 200 for i in range(100)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, loop_trace=True)
    tokens = {}
    for attention in ("triton", "torch"):
        with Engine(tiny_checkpoint, device="cpu", dtype="float32", attention=attention, kv_sharing="last",
                    verbose=False) as engine:
            out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            tokens[attention] = out.token_ids, stack_traces(out.traces).exit_pdf
    assert tokens["triton"][0] == tokens["torch"][0]
    torch.testing.assert_close(tokens["triton"][1], tokens["torch"][1], rtol=1e-4, atol=1e-5)


def test_kv_sharing_changes_what_later_tokens_read(tiny_checkpoint):
    shared, _, _, _ = generate(tiny_checkpoint, 4, traced(), kv_sharing="last")
    full, _, _, _ = generate(tiny_checkpoint, 4, traced())
    assert [c.token_ids for c in shared] != [c.token_ids for c in full]
    assert all(s.token_ids[:2] == f.token_ids[:2] for s, f in zip(shared, full))  # prompt K/V is per loop


@pytest.mark.parametrize("engine_args", [dict(kv_sharing="last"), dict(exit_policy="early:0.5")])
def test_preempted_requests_replay_generated_tokens_and_match_reference(tiny_checkpoint, engine_args):
    """A pool too small for all four: preempted requests recompute their generated tokens one per step."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    completions, prompt_ids, _, replayed = generate(tiny_checkpoint, 3, params, num_kv_blocks=16,
                                                    block_size=4, enable_prefix_caching=False,
                                                    admission="greedy", **engine_args)
    assert replayed > 0  # generated tokens recomputed after preemption
    reference = ReferenceOuro(tiny_checkpoint, loops=3)
    policy, kv_sharing = engine_args.get("exit_policy", "full"), engine_args.get("kv_sharing", "none")
    for ids, completion in zip(prompt_ids, completions):
        assert completion.token_ids == reference.decode(ids, 24, policy, kv_sharing)[0]


@pytest.mark.parametrize("engine_args", [dict(), dict(kv_sharing="last"), dict(exit_policy="early:0.5"),
                                         dict(kv_sharing="last", exit_policy="early:0.5")])
def test_prefix_caching_and_preemption_give_the_tokens_of_an_uncached_unpreempted_run(tiny_checkpoint,
                                                                                      engine_args):
    """Prompts sharing a 12-token prefix, through a pool small enough to preempt, with prefix caching on,
    against a big pool with it off: the same greedy tokens under both KV layouts and with early exits."""
    prefix = list(range(40, 52))
    prompts = [prefix + [60 + i] * (1 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", loops=3, block_size=4, verbose=False, **engine_args)
    with Engine(tiny_checkpoint, num_kv_blocks=12, max_num_batched_tokens=8, admission="greedy",
                **common) as engine:
        first = engine.generate(prompts[:1], params, use_tqdm=False)  # fills the prefix cache
        cached = engine.generate(prompts, params, use_tqdm=False)
        preemptions = engine.scheduler.num_preemptions
    with Engine(tiny_checkpoint, num_kv_blocks=256, enable_prefix_caching=False, **common) as engine:
        plain = engine.generate(prompts, params, use_tqdm=False)
    assert preemptions > 0 and sum(out.num_cached_tokens for out in cached) >= 3 * len(prefix)
    assert first[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]


def test_kv_sharing_accounting_stores_generated_tokens_in_a_quarter():
    config = OuroConfig.from_dict(hf_config(PRESETS["ouro-1.4b"]))
    loops, layers = config.total_ut_steps, config.num_hidden_layers
    slot_bytes = slot_token_bytes(config.num_key_value_heads, config.head_dim, torch.bfloat16)
    slot_map = SlotMap(loops, layers)
    shared, paged = SharedLastLayout(slot_map, 16), PagedLayout(slot_map, 16)
    assert shared.token_bytes(slot_bytes, generated=False) == 768 * 1024  # docs/ouro.md §5
    assert shared.token_bytes(slot_bytes, generated=True) == 192 * 1024
    assert paged.token_bytes(slot_bytes, generated=True) == 768 * 1024
    assert paged.blocks_per_sequence(1024, 3072) == 256
    assert shared.blocks_per_sequence(1024, 3072) == 64 + 48
    manager = BlockManager(num_blocks=10, block_size=4, layout=SharedLastLayout(SlotMap(4, 2), 4))
    request = Request("r", list(range(10)), SamplingParams())
    manager.append_slots(request, 10)
    assert len(request.block_table) == 3 and not request.generated_block_table
    request.num_computed_tokens = 10
    assert manager.can_append(request, 17) and not manager.can_append(request, 7 * 16 + 1)
    manager.append_slots(request, 17)  # 17 generated tokens: two pages of 16
    assert len(request.block_table) == 3 and len(request.generated_block_table) == 2
    assert manager.num_free_blocks == 5
    manager.free(request)
    assert manager.num_free_blocks == 10 and not request.generated_block_table


def test_kv_sharing_needs_a_backend_with_the_shared_format_and_says_which_options_clash(tiny_checkpoint,
                                                                                       monkeypatch):
    from attention.torch_backend import TorchBackend

    monkeypatch.setattr(TorchBackend, "default_capabilities",
                        dataclasses.replace(TorchBackend.default_capabilities, kv_formats=("paged",)))
    with pytest.raises(ValueError, match="kv_sharing='last'.*attention='torch'"):
        Engine(tiny_checkpoint, device="cpu", attention="torch", kv_sharing="last", verbose=False)
    with pytest.raises(ValueError, match="kv_sharing"):
        Engine(tiny_checkpoint, device="cpu", kv_sharing="first", verbose=False)


def test_kv_sharing_engine_reports_bytes_and_holds_more_sequences(tiny_checkpoint, capsys):
    with Engine(tiny_checkpoint, device="cpu", num_kv_blocks=64, kv_sharing="last") as engine:
        assert engine.max_concurrent_sequences(64, 192) == 64 // (4 + 3)
    with Engine(tiny_checkpoint, device="cpu", num_kv_blocks=64) as engine:
        assert engine.max_concurrent_sequences(64, 192) == 64 // 16
    err = capsys.readouterr().err
    assert "8.0 KiB/prompt token, 2.0 KiB/generated token (kv_sharing=last:" in err
    assert "8.0 KiB/generated token (kv_layout=full:" in err and "max concurrent 4096-token sequences" in err


# -- traces ------------------------------------------------------------------------------------------

def test_traces_stack_into_tensors(tiny_checkpoint):
    completions, _, _, _ = generate(tiny_checkpoint, 4, traced(), exit_policy="early:0.5")
    completion = completions[0]
    tensors = completion.trace_tensors()
    n = len(completion.token_ids)
    assert tensors.exit_pdf.shape == (n, 4) and tensors.top_token_ids.shape == (n, 4)
    assert tensors.loops_run.tolist() == [len(t.exit_pdf) for t in completion.traces]
    assert tensors.exit_loop.tolist() == [t.exit_loop for t in completion.traces]
    assert tensors.exit_pdf.isnan().sum() == sum(4 - len(t.exit_pdf) for t in completion.traces)
    assert stack_traces([]).exit_pdf.shape == (0, 0)
    untraced, _, _, _ = generate(tiny_checkpoint, 2, SamplingParams(temperature=0, max_tokens=2))
    assert untraced[0].traces is None


def test_plot_helper_imports_without_matplotlib_and_says_what_is_missing(tiny_checkpoint):
    from examples.plot_loop_trace import plot_loop_trace

    completions, _, _, _ = generate(tiny_checkpoint, 2, traced())
    try:
        import matplotlib
    except ImportError:
        with pytest.raises(ImportError, match="pip install matplotlib"):
            plot_loop_trace(completions[0])
        return
    matplotlib.use("Agg")
    ax = plot_loop_trace(completions[0])
    assert ax.images[0].get_array().shape == (2, NEW_TOKENS)


# -- CLI ---------------------------------------------------------------------------------------------

def test_cli_takes_loops_exit_policy_kv_sharing_and_prints_traces(tmp_path, capsys):
    from cli import main

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    flags = ["--max-tokens", "4", "--device", "cpu", "--loops", "3", "--exit-policy", "early:0.5",
             "--kv-sharing", "last", "--loop-trace"]
    result = subprocess.run([sys.executable, "engine.py", "generate", *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "3 loops x" in result.stderr and "exit_policy=early:0.5" in result.stderr
    assert "kv_sharing=last" in result.stderr and "| exit loop | exit pdf per loop |" in result.stderr
    assert main(["generate", "--exit-policy", "step:9", "--device", "cpu", "--threads", "1"]) == 1
    assert "exit_policy 'step:9'" in capsys.readouterr().err


# -- CUDA ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("engine_args, graphs", [
    (dict(attention="triton", exit_policy="early:0.5"), True),  # per-loop graphs, shrinking batches
    (dict(attention="triton", exit_policy="early:0.5", kv_sharing="last"), True),
    (dict(attention="triton", kv_sharing="last"), True),
    (dict(attention="torch", exit_policy="early:0.5", kv_sharing="last"), False),
    (dict(attention="triton"), True),  # per-request readout policies on CUDA-graph decode steps
])
def test_cuda_fp32_loop_controls_match_reference(tiny_checkpoint, engine_args, graphs):
    policies = [None] * 4 if "exit_policy" in engine_args else ["full", "step:1", "threshold:0.5", "weighted"]
    reference = ReferenceOuro(tiny_checkpoint, loops=4)
    with Engine(tiny_checkpoint, device="cuda", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=6,
                verbose=False, **engine_args) as engine:
        assert engine.uses_cuda_graphs == graphs
        outputs = engine.generate(PROMPTS, [traced(p) for p in policies], use_tqdm=False)
        prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    for ids, policy, out in zip(prompt_ids, policies, outputs):
        tokens, traces = reference.decode(ids, NEW_TOKENS, engine_args.get("exit_policy", policy),
                                          engine_args.get("kv_sharing", "none"))
        assert out.outputs[0].token_ids == tokens
        assert [t.exit_loop for t in out.outputs[0].traces] == [t["exit_loop"] for t in traces]
