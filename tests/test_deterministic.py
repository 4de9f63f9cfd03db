"""Engine(deterministic=True) on the CPU (torch backend, fp32, the tiny random checkpoint): a request's
logprobs over the whole vocabulary, and so its logits' softmax and its greedy tokens, are the same bits
whatever else happens (docs/deterministic.md): (a) its batch, (c) chunked prefill, (d) a prefix-cache hit,
(e) preemption and recompute, (f) async scheduling, (g) a self-speculative verify row, (h) what the engine
ran before and the thread count, (i) a prompt token's logprobs from prefill against decoding it. (b), eager
against CUDA graphs, needs CUDA: tests/test_deterministic_gpu.py."""

import random

import pytest
import torch

from engine import Engine, SamplingParams

VOCAB = 512  # the tiny preset's: logprobs of every token
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=VOCAB)


def _prompts(n: int, seed: int, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(n)]


PROMPTS = _prompts(8, seed=3)


def _bits(output) -> tuple:
    """A completion's tokens and, per token, every vocabulary entry's logprob (a Python float per fp32)."""
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.logprobs) == len(completion.token_ids)
    logprobs = tuple(tuple(sorted((token, entry.logprob) for token, entry in step.items()))
                     for step in completion.logprobs)
    return tuple(completion.token_ids), logprobs


def _run(path, prompts=PROMPTS, params=PARAMS, **options) -> list[tuple]:
    with Engine(path, device="cpu", dtype="float32", deterministic=True, verbose=False, **options) as engine:
        return [_bits(out) for out in engine.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def batch(tiny_checkpoint):
    return _run(tiny_checkpoint)


def test_a_request_alone_has_the_bits_it_has_in_a_batch_of_8(tiny_checkpoint, batch):
    for i in (0, 3, 7):
        assert _run(tiny_checkpoint, [PROMPTS[i]]) == [batch[i]]


@pytest.mark.parametrize("budget", [5, 16])
def test_c_chunked_prefill_has_the_unchunked_bits(tiny_checkpoint, batch, budget):
    assert _run(tiny_checkpoint, max_num_batched_tokens=budget) == batch


def test_d_prefix_cache_hit_has_the_bits_of_a_miss(tiny_checkpoint):
    shared = _prompts(1, seed=5, low=48, high=48)[0]
    prompts = [shared + [11, 12, 13], shared + [21, 22]]
    miss = _run(tiny_checkpoint, prompts[1:], enable_prefix_caching=False)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", deterministic=True, verbose=False) as engine:
        engine.generate(prompts[:1], PARAMS, use_tqdm=False)
        hit = engine.generate(prompts[1:], PARAMS, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48
    assert [_bits(hit)] == miss


def test_d_a_prompt_that_hits_generated_blocks_has_the_bits_of_a_miss(tiny_checkpoint):
    """A second prompt that repeats the first's prompt and completion reuses the completion's K/V, computed
    by decoding: the bits of computing it as a prompt (prefill equals decode here)."""
    first = _prompts(1, seed=6, low=40, high=40)[0]
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", deterministic=True, verbose=False) as engine:
        completion = engine.generate([first], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                     use_tqdm=False)[0]
        longer = first + list(completion.outputs[0].token_ids) + [7]
        hit = engine.generate([longer], PARAMS, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 64  # 40 prompt tokens and 24 generated ones, in four full blocks
    assert [_bits(hit)] == _run(tiny_checkpoint, [longer], enable_prefix_caching=False)


def test_e_preempted_and_recomputed_requests_keep_their_bits(tiny_checkpoint, batch):
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", deterministic=True, verbose=False,
                num_kv_blocks=12, admission="greedy", max_model_len=128) as engine:
        outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert engine.scheduler.num_preemptions > 0
    assert [_bits(out) for out in outputs] == batch


def test_f_async_scheduling_has_the_synchronous_bits(tiny_checkpoint, batch):
    assert _run(tiny_checkpoint, async_scheduling=True) == batch


def test_g_self_speculative_verify_rows_have_the_plain_decode_bits(tiny_checkpoint, batch):
    assert _run(tiny_checkpoint, speculative="loops:2", num_speculative_tokens=3) == batch


def test_h_earlier_batches_and_thread_count_change_no_bit(tiny_checkpoint, batch):
    threads = torch.get_num_threads()
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", deterministic=True, verbose=False) as engine:
        engine.generate(_prompts(5, seed=11), PARAMS, use_tqdm=False)
        torch.set_num_threads(2)
        try:
            later = engine.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)
        finally:
            torch.set_num_threads(threads)
    assert [_bits(out) for out in later][::-1] == batch


def test_h_early_exits_do_not_depend_on_earlier_batches(tiny_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, loop_trace=True)
    options = dict(device="cpu", dtype="float32", deterministic=True, verbose=False, exit_policy="early:0.5")
    with Engine(tiny_checkpoint, **options) as engine:
        alone = engine.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    with Engine(tiny_checkpoint, **options) as engine:
        engine.generate(PROMPTS[1:], params, use_tqdm=False)
        later = engine.generate(PROMPTS, params, use_tqdm=False)[0].outputs[0]
    assert later.token_ids == alone.token_ids
    assert [t.exit_loop for t in later.traces] == [t.exit_loop for t in alone.traces]
    assert [t.exit_pdf for t in later.traces] == [t.exit_pdf for t in alone.traces]


def test_i_prompt_logprobs_from_prefill_equal_decoding_the_same_tokens(tiny_checkpoint, batch):
    prompt = PROMPTS[4]
    tokens, decoded = batch[4]
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", deterministic=True, verbose=False) as engine:
        out = engine.generate([prompt + list(tokens)], SamplingParams(max_tokens=1, prompt_logprobs=VOCAB),
                              use_tqdm=False)[0]
    prefilled = out.prompt_logprobs[len(prompt):]
    assert tuple(tuple(sorted((t, e.logprob) for t, e in step.items())) for step in prefilled) == decoded


# A KVarN pool (the torch backend's reference path, batch-invariant: attention in fixed key tiles, the tiles'
# rotation row by row): prompts of 58 to 90 tokens, so that tiles of 64 pack in prefill (cut by chunks of 16)
# and, for the 58-token one, in decode.
KVARN = dict(kv_cache_dtype="kvarn_k4v2_g64", block_size=64, kv_sink_tokens=16, kv_tail_tokens=32)
KVARN_PROMPTS = _prompts(1, seed=21, low=58, high=58) + _prompts(3, seed=22, low=60, high=90)


@pytest.fixture(scope="module", params=["none", "last"])
def kvarn_batch(tiny_checkpoint, request):
    options = dict(KVARN, kv_sharing=request.param)
    return options, _run(tiny_checkpoint, KVARN_PROMPTS, **options)


def test_kvarn_request_alone_at_two_threads_and_chunked_has_its_batch_bits(tiny_checkpoint, kvarn_batch):
    options, batch = kvarn_batch
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = _run(tiny_checkpoint, KVARN_PROMPTS[:1], **options)
    finally:
        torch.set_num_threads(threads)
    assert alone == batch[:1]
    assert _run(tiny_checkpoint, KVARN_PROMPTS, max_num_batched_tokens=16, **options) == batch


def test_kvarn_preempted_and_recomputed_requests_keep_their_bits(tiny_checkpoint, kvarn_batch):
    options, batch = kvarn_batch
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", deterministic=True, verbose=False,
                num_kv_blocks=3, admission="greedy", max_model_len=128, **options) as engine:
        outputs = engine.generate(KVARN_PROMPTS, PARAMS, use_tqdm=False)
        assert engine.scheduler.num_preemptions > 0
    assert [_bits(out) for out in outputs] == batch


def test_kvarn_on_the_triton_backend_is_refused(tiny_checkpoint):
    """The Triton KVarN kernels are not batch-invariant: deterministic mode refuses them, naming both."""
    with pytest.raises(ValueError, match="deterministic=True cannot be combined with kv_cache_dtype="
                                         "'kvarn_k4v2_g64' on attention='triton'"):
        Engine(tiny_checkpoint, device="cpu", attention="triton", deterministic=True, verbose=False, **KVARN)


@pytest.mark.interpreter
def test_fused_layers_give_row_0_its_bits_at_every_row_count(tmp_path, monkeypatch):
    """The CUDA path's kernels in deterministic mode (here in Triton's interpreter): a row's hidden states and
    gate logits through the epilogue GEMMs and the norm kernel (1 and 2 rows), the unfused composition on the
    skinny kernel (17) and on the tiled one (66), all one GEMM
    config per weight (coarse here, one layer and 2 loops: the interpreter runs every program in Python)."""
    from model import ouro_fused
    from model.config import OuroConfig
    from model.kernels.gemv import GemvConfig
    from model.loader import load_model
    from model.tiny import write_checkpoint
    from tests.test_fused_model import dense_causal_attention

    monkeypatch.setattr(ouro_fused, "invariant_config",
                        lambda n, k, dtype, sm_count=0: GemvConfig(128, 128, 2, block_m=64))
    path = write_checkpoint(tmp_path, preset="tiny", seed=0, loops=2, layers=1)
    config = OuroConfig.from_file(path / "config.json")
    model = load_model(path, config, torch.device("cpu"), torch.float32, fused_kernels=True,
                       batch_invariant=True)
    ids = torch.randint(3, config.vocab_size, (66,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        states = [model(ids[:m], torch.arange(m), dense_causal_attention) for m in (1, 2, 17, 66)]
    for state in states[1:]:
        assert torch.equal(state.hidden[:, :1], states[0].hidden)
        assert torch.equal(state.gate_logits[:, :1], states[0].gate_logits)


@pytest.mark.interpreter
def test_triton_backend_attends_a_one_token_prompt_chunk_as_a_prompt(tmp_path):
    """A prompt of 17 tokens in chunks of 16 leaves a last chunk of one token: a batch-invariant Triton
    backend attends it with the prefill kernel, as the unchunked prompt's, not the decode kernel (one layer,
    2 loops, 3 tokens: the interpreter runs every program in Python)."""
    from model.tiny import write_checkpoint

    path = write_checkpoint(tmp_path, preset="tiny", seed=0, loops=2, layers=1)
    prompt = _prompts(1, seed=9, low=17, high=17)
    options = dict(attention="triton", enable_prefix_caching=False,
                   params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=VOCAB))
    assert _run(path, prompt, max_num_batched_tokens=16, **options) == _run(path, prompt, **options)
