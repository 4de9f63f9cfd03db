"""kv_cache_dtype: what each format stores and reads, in both backends and through the engine, and the
combinations it refuses at construction. fp8_e4m3 is checked against attention/fp8.py's arithmetic (the
same bytes in every backend) and, through the engine, against the one-sequence reference
(cache/packed_sequence.py)."""

import math

import pytest
import torch

from attention import fp8
from attention.torch_backend import paged_attention_row
from cache.copy_forward import copy_forward
from cache.kv_formats import parse_kv_cache_dtype
from cache.kv_pool import KVPool
from cache.packed_sequence import PackedSequence
from engine import Engine, SamplingParams
from model.looped import SlotMap
from tests.paged_cases import make_case, run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXED_ROWS = {"query_lens": [1, 20, 7, 1, 5], "context_lens": [9, 33, 7, 30, 5]}
SLOT = 1


def fp8_case(dtype=torch.float32, shape=None, **rows):
    """A paged step whose pool is fp8 with distinct scales per (slot, kv head, key or value); shape:
    make_case's head and page sizes (4 heads over 2 kv heads of 32, pages of 4 by default)."""
    shape = shape or {"heads": 4, "kv_heads": 2, "head_dim": 32}
    case = make_case(**(rows or MIXED_ROWS), dtype=dtype, **shape, device=DEVICE)
    if shape["kv_heads"] == 2:
        scales = torch.tensor([[[0.5, 2.0], [0.25, 4.0]], [[0.75, 1.5], [3.0, 0.125]]], device=DEVICE)
    else:  # powers of two from 1/8 to 4, a different one per (slot, key or value, kv head)
        generator = torch.Generator().manual_seed(0)
        exponents = torch.randint(-3, 3, (2, 2, shape["kv_heads"]), generator=generator)
        scales = torch.exp2(exponents.float()).to(DEVICE)
    case.key_cache = fp8.quantize(case.key_cache, scales[:, 0, None, None, :, None])
    case.value_cache = fp8.quantize(case.value_cache, scales[:, 1, None, None, :, None])
    return case, scales


def bind(name, case, scales):
    from attention.registry import select

    backend = select(name, case.key_cache.device)
    backend.bind(case.key_cache.clone(), case.value_cache.clone(), case.scale, scales)
    if name == "triton":  # small tiles and many splits, as tests/test_triton_kernels.py runs them
        backend.prefill_block_m = backend.prefill_block_n = 16
        backend.decode_block_n = 16
        backend.split_min_keys, backend.short_context = 8, 0
    return backend


def fp8_expected(case, scales):
    """Each row's attention over its context read back through fp8 (the new tokens quantized as stored)."""
    meta = case.meta
    k_scale, v_scale = scales[SLOT, 0][:, None], scales[SLOT, 1][:, None]
    keys = fp8.dequantize(case.key_cache[SLOT], k_scale).flatten(0, 1).clone()
    values = fp8.dequantize(case.value_cache[SLOT], v_scale).flatten(0, 1).clone()
    keys[meta.slot_mapping] = fp8.dequantize(fp8.quantize(case.k, k_scale), k_scale)
    values[meta.slot_mapping] = fp8.dequantize(fp8.quantize(case.v, v_scale), v_scale)
    out = torch.empty_like(case.q, dtype=torch.float32)
    bs = meta.block_size
    for row, (n, c) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        start = meta.query_starts_cpu[row]
        index = torch.tensor([int(meta.block_tables[row, p // bs]) * bs + p % bs for p in range(c)],
                             device=case.q.device)
        out[start:start + n] = paged_attention_row(case.q[start:start + n].float(), keys[index],
                                                   values[index], case.scale)
    return out


def test_fp8_codec_saturates_and_rounds_to_nearest():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.0, 1.0625, 1.1875, 2 ** -10])
    y = fp8.dequantize(fp8.quantize(x, 1.0), 1.0)
    assert y.tolist() == [448.0, -448.0, 448.0, 0.0, 1.0, 1.25, 0.0]  # ties to even; 2^-10 underflows
    assert fp8.dequantize(fp8.quantize(x, 4.0), 4.0)[4] == 1.0


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_fp8_pool_is_stored_and_read_through_its_scales(name):
    case, scales = fp8_case()
    backend = bind(name, case, scales)
    out = run(backend, case, SLOT)
    expected = fp8_expected(case, scales)
    torch.testing.assert_close(out.float(), expected, rtol=1e-4, atol=1e-5)
    if name == "triton":  # the same values as the reference backend stores (a zero's sign may differ)
        reference = bind("torch", case, scales)
        run(reference, case, SLOT)
        assert torch.equal(backend.key_cache.float(), reference.key_cache.float())
        assert torch.equal(backend.value_cache.float(), reference.value_cache.float())


def test_fp8_triton_pool_at_head_dim_96_matches_the_reference_backends_values():
    """A head_dim that is no power of two (Huginn-0125's): the kernels' padded head lanes neither read nor
    store past it, in prefill, decode and both K/V stores."""
    case, scales = fp8_case(shape={"heads": 4, "kv_heads": 2, "head_dim": 96})
    backend = bind("triton", case, scales)
    out = run(backend, case, SLOT)
    torch.testing.assert_close(out.float(), fp8_expected(case, scales), rtol=1e-4, atol=1e-5)
    reference = bind("torch", case, scales)
    run(reference, case, SLOT)
    assert torch.equal(backend.key_cache.float(), reference.key_cache.float())
    assert torch.equal(backend.value_cache.float(), reference.value_cache.float())


def test_fp8_triton_decode_rows_in_bf16_match_the_reference_backend():
    case, scales = fp8_case(torch.bfloat16, query_lens=[1, 1, 1], context_lens=[3, 17, 40])
    out = run(bind("triton", case, scales), case, SLOT).float()
    expected = run(bind("torch", case, scales), case, SLOT).float()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_fp8_triton_decode_at_huginns_head_dim_96_in_bf16_matches_the_fp8_reference():
    """Huginn-0125's head (55 x 96): the half-precision fp8 path's 32-bit value words, masked to 24 of the
    padded head's 32 words, with the backend's own split rule."""
    from attention.registry import select

    contexts = [1, 17, 100, 513, 2048, 4100]
    case, scales = fp8_case(torch.bfloat16, {"heads": 55, "kv_heads": 55, "head_dim": 96, "block_size": 16},
                            query_lens=[1] * len(contexts), context_lens=contexts)
    backend = select("triton", case.key_cache.device)
    backend.bind(case.key_cache.clone(), case.value_cache.clone(), case.scale, scales)
    out = run(backend, case, SLOT).float()
    torch.testing.assert_close(out, fp8_expected(case, scales), rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_block_n", [64, 128])
def test_fp8_triton_decode_at_ouro_shape_in_bf16_matches_the_fp8_reference(decode_block_n):
    """bf16 queries over an fp8 pool at Ouro's shape (16 heads x 128, pages of 16) with the backend's own
    split rule and key tiles of 64 or 128: the half-precision path, where keys widen to fp16 for the dot and
    values are loaded as 32-bit words and widened by inline PTX (attention/kernels/decode.py). Its errors are
    P's and the output's rounding (2^-11, 2^-9 relative); a value read in the wrong byte order or lane is an
    O(1) error, the one-key row's output being that key's value itself."""
    from attention.registry import select

    contexts = [1, 2, 17, 100, 513, 2048, 4100]
    case, scales = fp8_case(torch.bfloat16, {"heads": 16, "kv_heads": 16, "head_dim": 128, "block_size": 16},
                            query_lens=[1] * len(contexts), context_lens=contexts)
    backend = select("triton", case.key_cache.device)
    backend.bind(case.key_cache.clone(), case.value_cache.clone(), case.scale, scales)
    backend.decode_block_n = decode_block_n
    out = run(backend, case, SLOT).float()
    expected = fp8_expected(case, scales)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-3)


def test_fp8_triton_graph_mode_decode_is_bitwise_equal_to_eager():
    """Graph mode (capture_begin: the grid sized to the block table, the instance's partials and tickets)
    gives the eager bits for an fp8 pool too."""
    case, scales = fp8_case(torch.bfloat16, query_lens=[1, 1, 1], context_lens=[3, 17, 40])
    backend = bind("triton", case, scales)
    eager = run(backend, case, SLOT)
    backend.capture_begin(max_rows=3)
    graph = run(backend, case, SLOT)
    assert backend._plan.decode.grid[0] > 5
    backend.capture_end()
    assert torch.equal(graph, eager)


@pytest.mark.interpreter
def test_backends_refuse_an_fp8_pool_without_scales_and_scales_without_fp8():
    from attention.registry import select

    case, scales = fp8_case()
    backend = select("torch", torch.device(DEVICE))
    with pytest.raises(ValueError, match="kv_scales of shape"):
        backend.bind(case.key_cache, case.value_cache, case.scale)
    dense = make_case(**MIXED_ROWS, device=DEVICE)
    with pytest.raises(ValueError, match="belong to an fp8 KV pool"):
        backend.bind(dense.key_cache, dense.value_cache, dense.scale, scales)
    triton = select("triton", torch.device(DEVICE), {"packed_prefill": True})
    with pytest.raises(ValueError, match="packed_prefill"):
        triton.bind(case.key_cache, case.value_cache, case.scale, scales)


def test_kv_pool_scales_are_checked_and_loop_uniform_where_k_v_moves_between_loops():
    pool = KVPool(SlotMap(2, 3), 4, 4, 2, 8, fp8.FP8_DTYPE, torch.device("cpu"), loop_uniform_scales=True)
    assert pool.kv_scales.shape == (6, 2, 2) and bool((pool.kv_scales == 1).all())
    assert pool.slot_token_bytes == 2 * 2 * 8
    layer_scales = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).repeat(2, 1)
    pool.set_kv_scales(layer_scales, layer_scales * 2)
    assert torch.equal(pool.kv_scales[:, 1], layer_scales * 2)
    with pytest.raises(ValueError, match="differ between the loops"):
        pool.set_kv_scales(torch.arange(1.0, 13.0).view(6, 2), layer_scales)
    with pytest.raises(ValueError, match="key_scales must be a tensor of shape"):
        pool.set_kv_scales(torch.ones(6), layer_scales)
    with pytest.raises(ValueError, match="value_scales must be finite and positive"):
        pool.set_kv_scales(layer_scales, -layer_scales)
    dense = KVPool(SlotMap(2, 3), 4, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert dense.kv_scales is None
    with pytest.raises(ValueError, match="fp8_e4m3 pool"):
        dense.set_kv_scales(layer_scales, layer_scales)


def test_copy_forward_moves_fp8_bytes_on_cpu():
    pool = KVPool(SlotMap(3, 2), 2, 4, 2, 8, fp8.FP8_DTYPE, torch.device("cpu"))
    pool.key_cache.copy_(fp8.quantize(torch.randn(pool.key_cache.shape), 1.0))
    pool.value_cache.copy_(fp8.quantize(torch.randn(pool.value_cache.shape), 1.0))
    before = pool.key_cache.view(torch.uint8).clone()
    copy_forward(pool.key_cache, pool.value_cache, pool.slot_map, torch.tensor([5]), 0)
    planes = pool.key_cache.view(torch.uint8).view(3, 2, 8, 2, 8)
    assert torch.equal(planes[1:, :, 5], before.view(3, 2, 8, 2, 8)[:1, :, 5].expand(2, -1, -1, -1))
    assert torch.equal(planes[:, :, 4], before.view(3, 2, 8, 2, 8)[:, :, 4])


def test_storage_dtype_of_each_dense_format():
    assert parse_kv_cache_dtype("auto").storage_dtype(torch.float32) == torch.float32
    assert parse_kv_cache_dtype("bf16").storage_dtype(torch.float32) == torch.bfloat16
    assert parse_kv_cache_dtype("fp8_e4m3").storage_dtype(torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="packed tiles"):
        parse_kv_cache_dtype("kvarn_k4v2_g64").storage_dtype(torch.bfloat16)


@pytest.mark.parametrize("options,match", [
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of auto, bf16, fp8_e4m3, kvarn_k4v2_g64"),
    ({"kv_cache_dtype": None}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "fp8_e4m3", "packed_prefill": True}, "cannot be combined with packed_prefill"),
])
def test_engine_refuses_unsupported_kv_cache_dtypes_before_loading(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        Engine(tmp_path / "never-read", verbose=False, **options)


def greedy_through(model, prompt, new_tokens, attention, gaps: list | None = None,
                   logprobs: list | None = None):
    """The engine's model, all loops, last-loop readout, one sequence through an attention callable. gaps, if
    given, gets each step's gap between its top two logprobs; logprobs, each step's logprobs over the
    vocabulary (a list of floats)."""
    tokens = []
    ids, start = prompt, 0
    device = model.embed_tokens.weight.device
    with torch.inference_mode():
        while len(tokens) < new_tokens:
            h = model.embed_tokens(torch.tensor(ids, device=device))
            cos, sin = model.rotary(torch.arange(start, start + len(ids), device=device), h.dtype)
            for t in range(model.config.total_ut_steps):
                h = model.run_loop(h, cos, sin, attention, t)
            logits = model.compute_logits(h)[-1]
            tokens.append(int(logits.argmax()))
            if gaps is not None:
                top = torch.log_softmax(logits.float(), -1).topk(2).values
                gaps.append(float(top[0] - top[1]))
            if logprobs is not None:
                logprobs.append(torch.log_softmax(logits[None].float(), -1)[0].tolist())
            start += len(ids)
            ids = tokens[-1:]
    return tokens


def assert_reference_or_near_tie(tokens: list[int], model, prompt: list[int], attention,
                                 near_tie: float = 1e-3) -> None:
    """The engine's greedy tokens are greedy_through's, or leave them only where the reference's top two
    logprobs are within near_tie. A row's fp32 products depend on the batch's shape (cuBLAS, and on the CPU
    the BLAS and its thread count, pick kernels by it), and the reference reads the prompt in one call, the
    engine in chunks beside other rows; a lossy format rounds those ulps apart at a code boundary."""
    gaps = []
    want = greedy_through(model, prompt, len(tokens), attention, gaps)
    parted = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), len(want))
    assert parted == len(want) or gaps[parted] < near_tie, (parted, gaps[parted])


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
def test_engine_greedy_tokens_equal_the_one_sequence_reference(tiny_checkpoint, kv_cache_dtype):
    """The paged pool, its scales and the batch (chunked prefill, four rows) read what a sequence's own
    history read through the format reads: PackedSequence with fp8's default unit scale, or bf16 storage."""
    prompts = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog again",
               "0123456789 + - * / = 42"]
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                max_num_batched_tokens=16, verbose=False) as engine:
        assert engine.kv_pool.key_cache.dtype == parse_kv_cache_dtype(kv_cache_dtype).storage_dtype(
            torch.float32)
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                  use_tqdm=False)
        config = engine.config
        fmt = parse_kv_cache_dtype("fp8_e4m3" if kv_cache_dtype == "fp8_e4m3" else "auto")
        for prompt, output in zip(prompts, outputs):
            store = PackedSequence(fmt, config.total_ut_steps * config.num_hidden_layers,
                                   config.num_attention_heads, config.num_key_value_heads, config.head_dim)
            attention = store
            if kv_cache_dtype == "bf16":  # bf16 storage: the history rounded to bf16, read in fp32
                def attention(q, k, v, slot, store=store):
                    return store(q, k.bfloat16().float(), v.bfloat16().float(), slot)
            ids = engine.tokenizer.encode(prompt)
            assert output.outputs[0].token_ids == greedy_through(engine.model, ids, 12, attention)
        if kv_cache_dtype == "fp8_e4m3":  # the format matters here: dense K/V would give other tokens
            slots = config.total_ut_steps * config.num_hidden_layers
            dense = PackedSequence(parse_kv_cache_dtype("auto"), slots, config.num_attention_heads,
                                   config.num_key_value_heads, config.head_dim)
            assert outputs[0].outputs[0].token_ids != greedy_through(
                engine.model, engine.tokenizer.encode(prompts[0]), 12, dense)


KVARN_PROMPTS = ["The quick brown fox jumps over the lazy dog again and again " * 3, "Hello " * 20,
                 "0123456789 + - * / = 42 " * 5]


# A pool sized for the CUDA tests' three rows, not for the tiny model's max_model_len x 256 sequences (tens of
# GiB at KVarN's page of 64: more than a worker's share of the card where the gpu tests share it).
CUDA_POOL = {"max_num_seqs": 4, "max_model_len": 1024}


def kvarn_engine(checkpoint, name="kvarn_k4v2_g64", sink=0, tail=0, device="cpu", **options):
    options = {"enable_prefix_caching": False, **options}
    return Engine(checkpoint, device=device, dtype="float32", kv_cache_dtype=name, block_size=64,
                  kv_sink_tokens=sink, kv_tail_tokens=tail, verbose=False, **options)


@pytest.mark.parametrize("name,sink,tail,rotate", [
    ("kvarn_k4v2_g64", 0, 0, True), ("kvarn_k4v4_g64", 16, 32, True), ("kvarn_k5v5_g64", 64, 80, True),
    ("kvarn_k4v2_g64", 0, 0, False)])
def test_kvarn_engine_greedy_tokens_equal_the_one_sequence_reference(tiny_checkpoint, name, sink, tail,
                                                                     rotate):
    """Three rows in chunks of 40 tokens (which cut tiles), 40 generated tokens each (so blocks fill and pack
    during decode too): the paged KVarN pool, its side slots and the chunked reads give the tokens that one
    sequence's history in the same format gives, read in one call per prompt; and the format matters here
    (the tokens part from dense K/V's). Without rotation (kv_rotation=False, an ablation of KVarN's step 1)
    the reference is packed without it too, and the tokens part from the rotated format's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with kvarn_engine(tiny_checkpoint, name, sink, tail, max_num_batched_tokens=40,
                      kv_rotation=rotate) as engine:
        assert engine.kv_pool.bytes_per_block < engine.kv_pool.num_slots * 64 * 2 * 2 * 32 * 4  # packed
        assert (engine.kv_pool.rotation is None) != rotate
        outputs = engine.generate(KVARN_PROMPTS, params, use_tqdm=False)
        config = engine.config
        slots = config.total_ut_steps * config.num_hidden_layers
        differs = False
        for prompt, output in zip(KVARN_PROMPTS, outputs):
            ids = engine.tokenizer.encode(prompt)

            def reference(fmt: str, **options) -> list[int]:
                store = PackedSequence(parse_kv_cache_dtype(fmt), slots, config.num_attention_heads,
                                       config.num_key_value_heads, config.head_dim, **options)
                return greedy_through(engine.model, ids, 40, store)

            tokens = output.outputs[0].token_ids
            assert tokens == reference(name, sink=sink, tail=tail, rotate=rotate)
            if not differs:  # until a row shows it
                differs = tokens != (reference("auto") if rotate else reference(name, sink=sink, tail=tail))
        side = engine.block_manager.side_rows
        assert not side.users and len(side.free) + len(side.side_of) == side.capacity  # all given back
    assert differs or name == "kvarn_k5v5_g64"  # k5v5 with a wide side pool may match dense here


@pytest.mark.gpu
def test_kvarn_engine_on_cuda_gives_the_one_sequence_reference_tokens(tiny_checkpoint):
    """The reference path on CUDA (eager: the torch backend captures no graphs): the same tokens as one
    sequence's packed history, with chunked prefill and prefix caching on."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with kvarn_engine(tiny_checkpoint, "kvarn_k4v2_g64", 16, 32, device="cuda", attention="torch",
                      max_num_batched_tokens=40, enable_prefix_caching=True, **CUDA_POOL) as engine:
        assert not engine.uses_cuda_graphs
        outputs = engine.generate(KVARN_PROMPTS, params, use_tqdm=False)
        config = engine.config
        slots = config.total_ut_steps * config.num_hidden_layers
        for prompt, output in zip(KVARN_PROMPTS, outputs):
            store = PackedSequence(parse_kv_cache_dtype("kvarn_k4v2_g64"), slots, config.num_attention_heads,
                                   config.num_key_value_heads, config.head_dim, sink=16, tail=32,
                                   device="cuda")
            ids = engine.tokenizer.encode(prompt)
            assert output.outputs[0].token_ids == greedy_through(engine.model, ids, 40, store)


def shared_reference(engine, name, ids, sink=0, tail=0, device="cpu", batch_invariant=False):
    """The one-sequence reference under kv_sharing="last": generated tokens keep their last loop's K/V."""
    config = engine.config
    return PackedSequence(parse_kv_cache_dtype(name), config.total_ut_steps * config.num_hidden_layers,
                          config.num_attention_heads, config.num_key_value_heads, config.head_dim, sink=sink,
                          tail=tail, device=device, prompt_len=len(ids), num_layers=config.num_hidden_layers,
                          batch_invariant=batch_invariant)


def test_shared_last_reference_gives_the_oracles_tokens(tiny_checkpoint, reference):
    """PackedSequence's kv_sharing="last" with dense K/V is tests/reference.py's stateful oracle."""
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", max_model_len=64, verbose=False) as engine:
        ids = engine.tokenizer.encode(KVARN_PROMPTS[1][:40])
        tokens = greedy_through(engine.model, ids, 8, shared_reference(engine, "auto", ids))
    assert tokens == reference.decode(ids, 8, "full", "last")[0]


def test_fp8_shared_last_engine_greedy_tokens_equal_the_one_sequence_reference(tiny_checkpoint):
    """fp8_e4m3 with kv_sharing="last": generated tokens' K/V read back through fp8 at their layer, as the
    reference reads them."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3", kv_sharing="last",
                max_num_batched_tokens=16, verbose=False) as engine:
        outputs = engine.generate(KVARN_PROMPTS[1:], params, use_tqdm=False)
        for prompt, output in zip(KVARN_PROMPTS[1:], outputs):
            ids = engine.tokenizer.encode(prompt)
            store = shared_reference(engine, "fp8_e4m3", ids)
            assert output.outputs[0].token_ids == greedy_through(engine.model, ids, 12, store)
            assert output.outputs[0].token_ids != greedy_through(engine.model, ids, 12,
                                                                 shared_reference(engine, "auto", ids))


# Prompts of 98, 40 and 52 tokens (none a multiple of G = 64) in chunks of 40 tokens: tiles are cut by
# chunks, and each prompt's last tile is short.
SHARED_PROMPTS = [KVARN_PROMPTS[0] + KVARN_PROMPTS[1], *KVARN_PROMPTS[1:]]


@pytest.mark.parametrize("name,sink,tail", [("kvarn_k4v2_g64", 0, 0), ("kvarn_k4v4_g64", 16, 32)])
def test_kvarn_shared_last_engine_gives_the_one_sequence_reference_bits(tiny_checkpoint, name, sink, tail):
    """kv_sharing="last" over a KVarN pool: three rows of different lengths, 150 generated tokens each, so
    that two generated tiles fill and pack (in two pages: 2 loops, 128 generated tokens a page) and a third
    fills. In deterministic mode (rows batched, prompts in chunks of 40 tokens) every row has, bit for bit,
    the tokens and the logprobs over the whole vocabulary that the one-sequence reference gives with the same
    batch-invariant math (PackedSequence(batch_invariant=True): attention in fixed key tiles, the tiles'
    rotation row by row), reading each prompt in one call; without the mode a near tie can part them, and
    where it does depends on the BLAS thread count. The format is in effect (dense K/V gives other tokens).
    The sink and tail of 0 leave the side pool two side blocks, fewer than three rows prefilling need:
    admission waits for them. (Other thread counts: tests/test_deterministic.py.)"""
    vocab = 512  # the tiny preset's
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, logprobs=vocab)
    with kvarn_engine(tiny_checkpoint, name, sink, tail, kv_sharing="last", loops=2,
                      max_num_batched_tokens=40, deterministic=True) as engine:
        outputs = engine.generate(SHARED_PROMPTS, params, use_tqdm=False)
        differs = False
        for prompt, output in zip(SHARED_PROMPTS, outputs):
            ids = engine.tokenizer.encode(prompt)
            completion, logprobs = output.outputs[0], []
            store = shared_reference(engine, name, ids, sink, tail, batch_invariant=True)
            assert completion.token_ids == greedy_through(engine.model, ids, 150, store, logprobs=logprobs)
            got = [[step[token].logprob for token in range(vocab)] for step in completion.logprobs]
            assert got == logprobs
            if not differs:  # until a row shows it
                dense = shared_reference(engine, "auto", ids, batch_invariant=True)
                differs = completion.token_ids != greedy_through(engine.model, ids, 150, dense)
        assert [len(engine.tokenizer.encode(p)) % 64 for p in SHARED_PROMPTS] == [34, 40, 52]
        side = engine.block_manager.side_rows
        assert not side.users and len(side.generated_free) == side.generated_capacity  # all given back
    assert differs


@pytest.mark.gpu
def test_kvarn_shared_last_engine_on_cuda_gives_the_one_sequence_reference_tokens(tiny_checkpoint):
    """The kv_sharing="last" reference path on CUDA (eager), as on CPU (2 loops: generated tiles packed across
    two pages), with prefix caching on. On CUDA a row's fp32 products depend on the batch's shape (cuBLAS
    picks kernels by it), and the reference reads each prompt in one call, the engine in chunks beside other
    rows: where a code sits on a rounding boundary the two pack it one step apart, so a completion may leave
    the reference's, but only at a near tie of the reference's top two tokens (seen on the H200: one row, at
    token 106 of 150)."""
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    with kvarn_engine(tiny_checkpoint, "kvarn_k4v2_g64", 16, 32, device="cuda", attention="torch",
                      kv_sharing="last", loops=2, max_num_batched_tokens=40,
                      enable_prefix_caching=True, **CUDA_POOL) as engine:
        assert not engine.uses_cuda_graphs
        outputs = engine.generate(SHARED_PROMPTS, params, use_tqdm=False)
        for prompt, output in zip(SHARED_PROMPTS, outputs):
            ids = engine.tokenizer.encode(prompt)
            store = shared_reference(engine, "kvarn_k4v2_g64", ids, 16, 32, device="cuda")
            assert len(output.outputs[0].token_ids) == 150
            assert_reference_or_near_tie(output.outputs[0].token_ids, engine.model, ids, store)


def admit_at_full_length(manager, prompt: int, generated: int) -> int:
    """Sequences of prompt + generated tokens that the block manager holds at once, admitted one after the
    other: the prompt, then the generated tokens but one, then the last one (the windows of a decode step)."""
    from request import Request, SamplingParams as Params

    count = 0
    while True:
        request = Request(str(count), [1] * prompt, Params())
        request.token_ids += [1] * generated
        for tokens in (prompt, generated - 1, 1):
            if not manager.can_append(request, tokens):
                return count
            manager.append_slots(request, tokens)
            request.num_computed_tokens += tokens
        count += 1


@pytest.mark.parametrize("kv_sharing, ratio", [("last", 10), ("none", 3.5)])
def test_kvarn_k4v2_with_a_small_window_holds_its_multiple_of_bf16_in_the_same_budget(kv_sharing, ratio):
    """Capacity at Ouro-1.4B's shape (4 loops x 24 layers, 16 kv heads of 128) in 64 GiB, sized as the engine
    sizes its pool (side pool first, then blocks, one scratch block), for sequences of 512 prompt + 3584
    generated tokens: bf16 without sharing holds 21. kvarn_k4v2_g64 with 64 sink and 64 tail tokens, sized
    for `ratio` times that (max_num_seqs), holds them all, packed blocks and side rows: 10x with
    kv_sharing="last", 3.5x without; the engine's reported figure, and by admitting them into its block
    manager."""
    from cache.blocks import BlockManager
    from cache.kvarn_pool import KVarNPool
    from cache.layout import make_layout
    from cache.side_rows import SideRows
    from model.config import OuroConfig
    from model.tiny import PRESETS, hf_config

    config = OuroConfig.from_dict(hf_config(PRESETS["ouro-1.4b"]))
    slot_map = SlotMap(config.total_ut_steps, config.num_hidden_layers)
    heads = (config.num_key_value_heads, config.head_dim)
    budget, meta = 64 * 2**30, torch.device("meta")
    bf16_block = KVPool(slot_map, 1, 16, *heads, torch.bfloat16, meta).bytes_per_block
    bf16 = make_layout("full", slot_map, 16).max_concurrent_sequences(
        KVPool.blocks_for_budget(bf16_block, budget) - 1, 512, 3584)
    assert bf16 == 21
    sequences = math.ceil(ratio * bf16)
    side = SideRows(sequences, 64, 64, 64, generated_apart=kv_sharing == "last")
    probe = KVarNPool(parse_kv_cache_dtype("kvarn_k4v2_g64"), slot_map, 1, *heads, torch.bfloat16, meta)
    reserved = probe.side_bytes_for(side.capacity + 1, side.generated_capacity)  # + the scratch side block
    blocks = KVPool.blocks_for_budget(probe.bytes_per_block, budget - reserved) - 1
    layout = make_layout("shared-last" if kv_sharing == "last" else "full", slot_map, 64)
    reported = layout.max_concurrent_sequences(blocks, 512, 3584, side)
    assert reported >= sequences, (reported, blocks, reserved / 2**30)
    assert admit_at_full_length(BlockManager(blocks, 64, False, layout, side), 512, 3584) == reported


def test_kvarn_side_pool_lets_every_sequence_decode_in_lockstep():
    """Without kv_sharing the side pool holds decode_hold side blocks per sequence (and one request's two
    windows): sequences that prefilled together and decode in lockstep, every one starting a new block at the
    same step, never wait for a side block."""
    from cache.side_rows import SideRows
    from request import Request, SamplingParams as Params

    for sink, tail in ((0, 0), (1, 3), (4, 4), (5, 13), (9, 8)):
        for prompt in (1, 4, 7):
            side = SideRows(3, 4, sink, tail)
            requests = [Request(str(r), [1] * prompt, Params()) for r in range(3)]
            next_block = iter(range(1000))
            for length in range(prompt, prompt + 24):
                for request in requests:
                    start = request.num_computed_tokens
                    while len(request.block_table) * 4 < length:
                        request.block_table.append(next(next_block))
                    assert side.fits(request, start, length), (sink, tail, prompt, length)
                    side.hold(request, start, length)
                    assert len(request.side_held) <= side.decode_hold or start == 0
                    request.num_computed_tokens = length


def first_divergence(ids, reference, near_tie: float = 1e-3) -> int:
    """The first position where a completion's tokens leave the reference completion's (its length if
    never); there the reference's top two logprobs must be within near_tie."""
    for i, (token, want) in enumerate(zip(ids, reference.token_ids)):
        if token != want:
            top = sorted(entry.logprob for entry in reference.logprobs[i].values())[-2:]
            assert top[1] - top[0] < near_tie, (i, token, want, top)
            return i
    return len(ids)


@pytest.mark.interpreter
def test_kvarn_triton_engine_gives_the_reference_path_tokens(tiny_checkpoint):
    """The Triton path (attention/triton_kvarn.py: the pack, prefill and decode kernels; chunks of 40 tokens,
    so tiles complete inside chunks, across them and while decoding) against the torch backend's reference
    path, under the interpreter, with prefix caching on and a side pool that mixes in sink and tail rows. The
    two pack with different floating-point implementations (a code on a rounding boundary may land one step
    apart), so a completion may leave the reference's only at a near tie of its top two tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    # 58 tokens: its first block fills while it decodes (its 6th token completes it; the tokens after read it
    # packed). 98 tokens in chunks of 80: its first block fills inside the first chunk, which the second row's
    # decode steps then share.
    prompts = [KVARN_PROMPTS[0], KVARN_PROMPTS[0] + KVARN_PROMPTS[1]]
    completions = {}
    for attention in ("torch", "triton"):
        with kvarn_engine(tiny_checkpoint, "kvarn_k4v2_g64", 16, 32, attention=attention, loops=1,
                          max_num_batched_tokens=80, enable_prefix_caching=True) as engine:
            assert engine.backend.name == attention
            assert len(engine.tokenizer.encode(prompts[1])) > 80
            completions[attention] = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    reached = [first_divergence(got.token_ids, want)
               for got, want in zip(completions["triton"], completions["torch"])]
    assert sum(reached) >= len(prompts) * 7, reached  # agreement past the first prompt's packing (token 6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kvarn_triton_engine_on_cuda_gives_the_reference_path_tokens(tiny_checkpoint, dtype):
    """The same comparison on CUDA, all loops, prefix caching on; and the Triton path with CUDA graphs (decode
    steps captured, their plan made on the device; prefill through piecewise graphs) gives exactly its eager
    tokens. Three rows of different lengths (a padding row in the bucket of 4; tiles complete at different
    steps, inside captured steps), then the first prompt (98 tokens) again: a prefix hit of its first
    block."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = [KVARN_PROMPTS[0] + KVARN_PROMPTS[1], *KVARN_PROMPTS[1:], KVARN_PROMPTS[0] + KVARN_PROMPTS[1]]
    completions = {}
    for attention, eager in (("torch", True), ("triton", True), ("triton", False)):
        with Engine(tiny_checkpoint, device="cuda", dtype=dtype, kv_cache_dtype="kvarn_k4v2_g64",
                    block_size=64, kv_sink_tokens=16, kv_tail_tokens=32, attention=attention,
                    enforce_eager=eager, max_num_batched_tokens=40, max_num_seqs=4, verbose=False) as engine:
            assert engine.uses_cuda_graphs == (not eager)
            first = engine.generate(prompts[:3], params, use_tqdm=False)
            again = engine.generate(prompts[3:], params, use_tqdm=False)
            assert again[0].num_cached_tokens >= 64
            completions[attention, eager] = [o.outputs[0] for o in first + again]
    graphs, eager = completions["triton", False], completions["triton", True]
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]
    # bf16 logits are multiples of 2^-4 between 8 and 16 (2^-5 between 4 and 8): two paths that round apart
    # can swap tokens whose logits are a step apart, or equal. fp32 keeps the tight bound.
    near_tie = 2 ** -4 if dtype == "bfloat16" else 1e-3
    reached = [first_divergence(got.token_ids, want, near_tie)
               for got, want in zip(eager, completions["torch", True])]
    assert sum(reached) >= len(prompts) * 20, reached


@pytest.mark.parametrize("sharing", [{}, {"kv_sharing": "last", "loops": 2}])
def test_kvarn_preempted_requests_recompute_the_same_tokens(tiny_checkpoint, sharing):
    """A pool too small for four rows: greedy admission preempts, and a preempted request gives back its side
    slot (and under kv_sharing="last" its generated side tiles) and recomputes through new ones to the tokens
    of an uncontended run."""
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    prompts = KVARN_PROMPTS + ["Looped models read their history four times " * 2]
    with kvarn_engine(tiny_checkpoint, tail=16, **sharing) as engine:
        alone = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    blocks = 4 if sharing else 6  # under sharing a row needs a prompt block and a page
    with kvarn_engine(tiny_checkpoint, tail=16, num_kv_blocks=blocks, admission="greedy",
                      max_model_len=192, **sharing) as engine:
        squeezed = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert engine.scheduler.num_preemptions > 0
        side = engine.block_manager.side_rows
        assert len(side.generated_free) == side.generated_capacity  # every side tile given back
    assert squeezed == alone


def test_kvarn_window_holds_every_row_a_query_reads_in_high_precision():
    """For every (query, earlier position) that the rule reads in high precision, the position's block is in
    the window at the length the call starts from (cache/side_rows.py), so a request holding that window
    holds every row it reads."""
    from attention.packed_attention import high_precision
    from cache.side_rows import SideRows, keeps_side_rows

    for sink, tail in ((0, 0), (1, 3), (4, 4), (5, 13), (9, 8)):
        side = SideRows(1, 4, sink, tail)
        for start in range(1, 30):
            queries, keys = torch.arange(start, start + 20), torch.arange(start)
            hp = high_precision(queries, keys, 4, sink, tail)
            needed = {int(p) // 4 for p in keys[hp.any(0)]}
            assert needed <= side.window(start), (sink, tail, start)
            assert all(keeps_side_rows(i, start, 4, side.sink_blocks, side.ring_blocks)
                       for i in side.window(start))


def test_kvarn_shared_windows_hold_every_row_a_query_reads_in_high_precision():
    """Under kv_sharing="last", for every query of a generating sequence, the positions it reads in high
    precision lie in the prompt blocks of its window or the generated tiles of its generated window
    (cache/side_rows.py); and a block or tile that left the window never comes back (its rows were not
    kept)."""
    from attention.packed_attention import high_precision
    from cache.side_rows import SideRows

    for sink, tail in ((0, 0), (1, 3), (4, 4), (5, 13), (9, 8)):
        side = SideRows(1, 4, sink, tail, generated_apart=True)
        for prompt_len in (1, 3, 4, 6, 9):
            left, left_tiles = set(), set()
            for length in range(prompt_len + 1, prompt_len + 30):
                keys = torch.arange(length)
                hp = high_precision(keys[-1:], keys, 4, sink, tail, prompt_len)[0]
                read = [int(p) for p in keys[hp]]
                blocks, tiles = side.window(length, prompt_len), side.generated_window(length, prompt_len)
                assert {p // 4 for p in read if p < prompt_len} <= blocks, (sink, tail, prompt_len, length)
                assert {(p - prompt_len) // 4 for p in read if p >= prompt_len} <= tiles
                assert not blocks & left and not tiles & left_tiles
                left |= side.window(length - 1, prompt_len) - blocks
                left_tiles |= side.generated_window(length - 1, prompt_len) - tiles


def test_kvarn_shared_side_tiles_are_the_requests_own_and_admission_counts_them():
    """Under kv_sharing="last" a request owns its generated side tiles: it takes one per tile of its window,
    gives back those that leave, and all at release. fits() says when hold() would find none: admission then
    waits (or preempts) as it does for blocks."""
    from cache.side_rows import SideRows
    from request import Request, SamplingParams as Params

    side = SideRows(1, 4, 0, 4, generated_apart=True)  # one request's prefill (4 side blocks), 2 side tiles
    assert (side.capacity, side.generated_capacity) == (4, 2)
    a, b, c = (Request(name, list(range(6)), Params()) for name in "abc")
    for request, blocks in ((a, [10, 11]), (b, [20, 21])):
        request.block_table = blocks
        assert side.fits(request, 0, 6)
        side.hold(request, 0, 6)
    assert not side.fits(c, 0, 6)  # its prefill's two side blocks: all four are held
    for end in range(7, 15):  # a generates positions 6..13: generated tiles 0 (6..9) and 1 (10..13)
        assert side.fits(a, end - 1, end)
        side.hold(a, end - 1, end)
    assert all(tile >= 0 for tile in a.generated_side_table) and not side.generated_free
    assert not side.fits(b, 6, 7)  # b's first generated tile would find no side tile
    assert side.fits(a, 14, 15)  # a's tile 2 takes the side tile that tile 0 (out of its tail) gives back
    side.hold(a, 14, 15)
    assert a.generated_side_table[0] == -1 and a.generated_side_table[2] >= 0 and not side.generated_free
    side.release(a)
    assert len(side.generated_free) == 2 and not a.generated_side_table and side.fits(b, 6, 7)
    assert side.fits(c, 0, 6)  # a's side blocks are idle now: evictable


def test_side_rows_follow_their_block_and_a_hit_stops_where_they_were_evicted():
    """Ownership by block id (cache/side_rows.py): a block's side block stays with it after its request
    lets go, an eviction (LRU, idle blocks only) removes it, a prefix hit is cut back to the blocks whose
    windows still have theirs, and a reused block gives its side block back."""
    from cache.side_rows import SideRows
    from request import Request, SamplingParams as Params

    side = SideRows(0, 4, 0, 4)  # windows of 2 blocks: one request's two windows, capacity 4
    a = Request("a", list(range(20)), Params())
    a.block_table = [10, 11, 12, 13, 14]
    side.hold(a, 0, 12)  # blocks 1 and 2 (positions 4..11)
    assert a.side_held == [11, 12] and a.side_table == [-1, side.side_of[11], side.side_of[12], -1, -1]
    side.hold(a, 12, 20)  # windows at 12 and 20: blocks 1, 2 and 3, 4
    assert a.side_held == [11, 12, 13, 14]
    side.release(a)
    assert set(side.idle) == {11, 12, 13, 14} and len(side.side_of) == 4
    assert side.usable_hit([10, 11, 12, 13]) == 4  # queries from 16 read 13..15: block 3 has its rows
    b = Request("b", list(range(8)), Params())
    b.block_table = [20, 21]
    side.hold(b, 0, 8)  # needs two side blocks: evicts the least recently idle (11, 12)
    assert 11 not in side.side_of and 12 not in side.side_of
    assert side.usable_hit([10, 11, 12]) == 0  # block 2 lost its rows; at 2 and 1 blocks, 1 and 0 have none
    assert side.usable_hit([10, 11, 12, 13, 14]) == 5  # queries from 20 read block 4's rows, which it has
    side.release(b)  # idle, oldest first: 13, 14, 20, 21
    c = Request("c", list(range(28)), Params())
    c.block_table = [10, 11, 12, 13, 14, 2, 3]  # a hit of 5 blocks, then 2 and 3 are new
    kept = side.side_of[13], side.side_of[14]
    side.hold(c, 20, 28)  # wants 13, 14 (read) and two new: evicts 20 and 21, never its own 13 and 14
    assert c.side_held == [2, 3, 13, 14] and {20, 21}.isdisjoint(side.side_of)
    assert (side.side_of[13], side.side_of[14]) == kept  # the rows it reads are the ones written
    side.release(c)
    side.drop(13)  # block 13 reused for other tokens
    assert 13 not in side.side_of and len(side.free) == 1
    assert SideRows(1, 4, 0, 0).read_before(16) == set()  # no tail: a query reads only itself


@pytest.mark.parametrize("sink,tail,sharing", [(0, 64, {}), (64, 16, {}),
                                               (16, 64, {"kv_sharing": "last", "loops": 2})])
def test_kvarn_prefix_hits_read_what_an_uncached_run_reads(tiny_checkpoint, sink, tail, sharing):
    """The pattern behind a side-pool corruption seen elsewhere: prime a prefix (a first turn), a second
    request that hits it (the next turn: prompt + answer + more), other requests that finish and recycle side
    blocks, then the same hit after the rows it needs were evicted. With max_num_seqs=1 the side pool holds
    one request's largest need and what a decoding sequence keeps (a window and a block; under
    kv_sharing="last" its sink), so the other requests evict them. Every request's tokens equal an uncached
    engine's, the second turn hits (its prompt blocks only, under kv_sharing="last"), and the last hit is cut
    back to what still has its rows."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with kvarn_engine(tiny_checkpoint, sink=sink, tail=tail, max_num_seqs=1, **sharing) as engine:
        first = engine.tokenizer.encode("A looped model reads its own history four times over. " * 8)
        answer = engine.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
        turn = first + answer + engine.tokenizer.encode(" And then?")
        others = [engine.tokenizer.encode(f"Unrelated text, number {n}, goes on and on. " * 6)
                  for n in range(1, 6)]
        prompts = [first, turn, *others, turn]
        uncached = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    with kvarn_engine(tiny_checkpoint, sink=sink, tail=tail, max_num_seqs=1, enable_prefix_caching=True,
                      **sharing) as engine:
        cached, hits = [], []
        for prompt in prompts:  # one at a time, in this order
            output = engine.generate([prompt], params, use_tqdm=False)[0]
            cached.append(output.outputs[0].token_ids)
            hits.append(output.num_cached_tokens)
    assert len(first) > 128 and cached == uncached
    assert hits[1] >= 128 and hits[-1] < hits[1], hits


@pytest.mark.parametrize("options,match", [
    ({"attention": "triton", "packed_prefill": True}, "packed_prefill=True"),
    ({"block_size": 16}, "needs block_size=64"),
    ({"kv_sharing": "last", "attention": "triton"}, "kv_sharing='last' runs on attention='torch' only"),
    ({"exit_policy": "early:0.5"}, "exit_policy='early:0.5'"),
    ({"speculative": "loops:2"}, "speculative='loops:2'"),
    ({"kv_rotation": False, "attention": "triton"}, "with kv_rotation=False runs on attention='torch' only"),
])
def test_kvarn_refuses_what_its_pool_does_not_support(tiny_checkpoint, options, match):
    base = dict(device="cpu", kv_cache_dtype="kvarn_k4v2_g64", block_size=64, enable_prefix_caching=False,
                attention="torch", verbose=False)
    with pytest.raises(ValueError, match=match):
        Engine(tiny_checkpoint, **{**base, **options})


@pytest.mark.parametrize("options,match", [
    ({"kv_sink_tokens": 8}, "kv_sink_tokens=8 applies to the KVarN formats only"),
    ({"kv_cache_dtype": "fp8_e4m3", "kv_tail_tokens": 8}, "kv_tail_tokens=8 applies to the KVarN"),
    ({"kv_cache_dtype": "kvarn_k4v2_g64", "kv_tail_tokens": -1}, "kv_tail_tokens must be an integer >= 0"),
    ({"kv_cache_dtype": "fp8_e4m3", "kv_rotation": False}, "kv_rotation=False applies to the KVarN formats"),
    ({"kv_cache_dtype": "kvarn_k4v2_g64", "kv_rotation": 0}, "kv_rotation must be True or False"),
])
def test_sink_and_tail_tokens_are_checked_before_loading(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        Engine(tmp_path / "never-read", verbose=False, **options)


def test_cli_generates_with_a_kvarn_cache(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    flags = ["--max-tokens", "4", "--device", "cpu", "--kv-cache-dtype", "kvarn_k4v2_g64",
             "--block-size", "64", "--attention", "torch", "--kv-sink-tokens", "64", "--kv-tail-tokens", "64",
             "--kv-no-rotation"]
    result = subprocess.run([sys.executable, "engine.py", "generate", *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "kv_cache_dtype=kvarn_k4v2_g64 (no rotation)" in result.stderr and "tok/s" in result.stderr
