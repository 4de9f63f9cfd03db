"""KV layouts across loops (cache/layout.py, docs/looped_controls.md "KV layouts"): compress:k keeping every
loop is the full layout; a ring of fewer loops gives the greedy tokens of a plain dense ring reference
(tests/reference.py: decode_in_calls), prompt in one step or in chunks, on a prefix hit and after preemption;
latest (the default under early:Q) and latest-compress:k give the reference's copy-forward; the pool holds
T/K times the tokens; and the names and combinations the engine cannot serve are refused by option."""

import pytest
import torch

from cache.layout import make_layout
from cache.kv_pool import slot_token_bytes
from cli import build_parser, engine_from_args
from engine import Engine
from model.config import OuroConfig
from model.huginn import HuginnConfig
from model.looped import SlotMap
from model.tiny import HUGINN_PRESETS, PRESETS, hf_config, huginn_hf_config
from request import SamplingParams
from tests.reference import ReferenceOuro

LOOPS, LAYERS = 4, 2  # the tiny checkpoint's
PROMPTS = [[5, 17, 42, 7, 99, 3, 61, 28, 14], [200, 11, 305, 8], [77, 76, 75, 74, 73, 72, 71, 70, 69, 68, 67]]
NEW_TOKENS = 8


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(checkpoint, prompts=PROMPTS, max_tokens: int = NEW_TOKENS, **engine_args) -> list[list[int]]:
    engine_args = dict(dict(device="cpu", dtype="float32", attention="torch", verbose=False,
                            enable_prefix_caching=False), **engine_args)
    with Engine(checkpoint, **engine_args) as engine:
        outputs = engine.generate([list(p) for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint):
    return ReferenceOuro(tiny_checkpoint)


# -- the slot map of a ring ------------------------------------------------------------------------------


def test_a_ring_of_loops_maps_loop_t_to_ring_loop_t_mod_k_on_the_same_physical_layer():
    """Huginn-0125's shape at 32 recurrences with compress:16 (the official compress-s16): 20 slots, loop t
    on ring loop t mod 4, coda after the ring; every slot one physical layer; deeper slots only within the
    ring (docs/huginn.md)."""
    ring = make_layout("compress:16", SlotMap(32, 4, 2, 2), 16).slot_map
    assert ring.ring_loops == 4 and ring.num_slots == 2 + 16 + 2
    assert [list(ring.loop_slots(t)) for t in (0, 3, 4, 29)] == \
        [[2, 3, 4, 5], [14, 15, 16, 17], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert [ring.physical_layer(s) for s in range(20)] == [0, 1] + [2, 3, 4, 5] * 4 + [6, 7]
    assert list(ring.deeper_slots(1, 3)) == [13, 17] and list(ring.deeper_slots(3, 0)) == []
    assert list(ring.deeper_slots(30, 0)) == []  # past the ring's last loop each ring loop holds its own
    with pytest.raises(ValueError, match=r"SlotMap ring_loops must be None or an integer in 1..32"):
        SlotMap(32, 4, ring_loops=33)


def test_layout_capacity_in_bytes_per_token_matches_the_docs_for_ouro_and_huginn():
    """docs/looped_controls.md "KV layouts": bf16 bytes per token of Ouro-1.4B (4 loops x 24 layers) and
    Huginn-0125 (2 + 32 x 4 + 2 slots), full against its rings."""
    ouro = OuroConfig.from_dict(hf_config(PRESETS["ouro-1.4b"]))
    ouro_map = SlotMap(ouro.total_ut_steps, ouro.num_hidden_layers)
    ouro_slot = slot_token_bytes(ouro.num_key_value_heads, ouro.head_dim, torch.bfloat16)
    huginn = HuginnConfig.from_dict(huginn_hf_config(HUGINN_PRESETS["huginn-0125"]))
    huginn_map = SlotMap(32, huginn.n_layers_in_recurrent_block, huginn.n_layers_in_prelude,
                         huginn.n_layers_in_coda)
    huginn_slot = slot_token_bytes(huginn.n_heads, huginn.head_dim, torch.bfloat16)  # no GQA
    expected = {(ouro_map, ouro_slot, "full"): 786_432, (ouro_map, ouro_slot, "compress:48"): 393_216,
                (ouro_map, ouro_slot, "compress:24"): 196_608,
                (huginn_map, huginn_slot, "full"): 2_787_840,
                (huginn_map, huginn_slot, "compress:16"): 422_400,
                (huginn_map, huginn_slot, "compress:4"): 168_960}
    got = {(m, b, name): make_layout(name, m, 16).token_bytes(b, generated=False) for m, b, name in expected}
    assert got == expected


# -- exactness --------------------------------------------------------------------------------------------


def test_compress_keeping_every_loop_is_the_full_layout(tiny_checkpoint):
    full = run(tiny_checkpoint, kv_layout="full")
    assert run(tiny_checkpoint, kv_layout=f"compress:{LOOPS * LAYERS}") == full
    assert run(tiny_checkpoint, kv_layout="latest") == full  # no token stops early: nothing to copy


@pytest.mark.parametrize("k", [LAYERS, 2 * LAYERS, 3 * LAYERS])
def test_a_ring_of_fewer_loops_gives_the_dense_ring_references_tokens(tiny_checkpoint, oracle, k):
    """Rings of 1, 2 and 3 of the 4 loops (3 does not divide 4: the last write of a ring loop is still one
    loop), a batch of three prompts each prefilled in one step."""
    tokens = run(tiny_checkpoint, kv_layout=f"compress:{k}")
    expected = [oracle.decode_in_calls(p, NEW_TOKENS, ring_loops=k // LAYERS) for p in PROMPTS]
    assert tokens == expected
    if k == 2 * LAYERS:
        assert expected != [oracle.decode_in_calls(p, NEW_TOKENS) for p in PROMPTS]  # the ring matters


def test_a_ring_with_chunked_prefill_and_a_prefix_hit_reads_earlier_steps_at_their_last_write(
        tiny_checkpoint, oracle):
    """A prompt of 11 tokens in chunks of 4 reads the earlier chunks as the reference's calls of 4, 4, 3; a
    prompt whose first 8 tokens hit the prefix cache reads them as a call of 8 before its own."""
    prompt = PROMPTS[2]
    chunked = run(tiny_checkpoint, [prompt], kv_layout="compress:4", max_num_batched_tokens=4)
    assert chunked == [oracle.decode_in_calls(prompt, NEW_TOKENS, ring_loops=2, prompt_calls=[4, 4, 3])]
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", attention="torch", verbose=False,
                kv_layout="compress:4", block_size=4) as engine:
        engine.generate([prompt[:9]], greedy(1), use_tqdm=False)  # caches blocks of positions 0..7
        hit = engine.generate([prompt], greedy(), use_tqdm=False)[0]
    assert hit.num_cached_tokens == 8
    assert hit.outputs[0].token_ids == oracle.decode_in_calls(prompt, NEW_TOKENS, ring_loops=2,
                                                              prompt_calls=[8, 3])


def test_a_ring_under_preemption_replays_generated_tokens_and_matches_the_reference(tiny_checkpoint, oracle):
    """A pool too small for all three: preempted requests recompute their prompt in one step and their
    generated tokens one per step, so they read what they read before."""
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", attention="torch", verbose=False,
                kv_layout="compress:4", num_kv_blocks=9, block_size=4, admission="greedy",
                enable_prefix_caching=False) as engine:
        outputs = engine.generate([list(p) for p in PROMPTS], greedy(16), use_tqdm=False)
        preemptions = engine.scheduler.num_preemptions
    assert preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == \
        [oracle.decode_in_calls(p, 16, ring_loops=2) for p in PROMPTS]


@pytest.mark.parametrize("kv_layout, ring", [(None, None), ("latest", None), ("latest-compress:4", 2),
                                             ("latest-compress:6", 3)])
def test_latest_under_early_exit_reads_a_stopped_tokens_deepest_kv(tiny_checkpoint, oracle, kv_layout, ring):
    """early:0.6 stops the generated tokens after one, two or three of the four loops. latest (the default
    under early:Q) copies a stopped token's last loop forward, as the reference's decode does; over a ring,
    into the ring loops it never wrote."""
    tokens = run(tiny_checkpoint, exit_policy="early:0.6", kv_layout=kv_layout)
    expected = [oracle.decode_in_calls(p, NEW_TOKENS, ring_loops=ring, early_q=0.6) for p in PROMPTS]
    assert tokens == expected
    if ring is None:
        assert expected == [oracle.decode(p, NEW_TOKENS, "early:0.6")[0] for p in PROMPTS]


def test_a_ring_in_bf16_and_fp8_keeps_its_storage_and_scales_per_ring_slot(tiny_checkpoint, oracle):
    """bf16 storage of this model's K/V rounds to the fp32 ring reference's greedy tokens; fp8 keeps one scale
    per (ring slot, kv head) and matches it on the first token of each prompt (its later tokens drift by the
    8-bit rounding)."""
    expected = [oracle.decode_in_calls(p, NEW_TOKENS, ring_loops=2) for p in PROMPTS]
    assert run(tiny_checkpoint, kv_layout="compress:4", kv_cache_dtype="bf16") == expected
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", attention="torch", verbose=False,
                kv_layout="compress:4", kv_cache_dtype="fp8_e4m3", enable_prefix_caching=False) as engine:
        assert engine.kv_pool.kv_scales.shape == (2 * LAYERS, 2, 4)
        outputs = engine.generate([list(p) for p in PROMPTS], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids[0] for o in outputs] == [tokens[0] for tokens in expected]


def test_the_cli_flag_chooses_the_layout(tiny_checkpoint):
    args = build_parser().parse_args(["generate", "--model", str(tiny_checkpoint), "--device", "cpu",
                                      "--kv-layout", "latest-compress:4", "--exit-policy", "early:0.6",
                                      "--threads", "1"])
    with engine_from_args(args) as engine:
        assert engine.layout.kv_layout == "latest-compress:4" and engine.model.slot_map.ring_loops == 2


# -- capacity ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k, gain", [(LAYERS, 4.0), (2 * LAYERS, 2.0)])
def test_a_ring_of_k_loops_holds_t_over_k_times_the_tokens_and_reports_it(tiny_checkpoint, capsys, k, gain):
    common = dict(device="cpu", dtype="float32", kv_cache_gib=0.001, max_model_len=64)
    with Engine(tiny_checkpoint, **common) as engine:
        full = engine.kv_capacity
    with Engine(tiny_checkpoint, kv_layout=f"compress:{k}", **common) as engine:
        ring = engine.kv_capacity
    assert ring.gain == gain and ring.prompt_token_bytes * gain == full.prompt_token_bytes
    assert ring.tokens_per_gib == gain * full.tokens_per_gib
    # the same budget in blocks of 1/gain the bytes (each pool also holds one scratch block)
    assert gain * (full.pool_tokens + 16) <= ring.pool_tokens + 16 < gain * (full.pool_tokens + 32)
    err = capsys.readouterr().err
    assert f"(kv_layout=compress:{k}: {ring.tokens_per_gib:,.0f} tokens/GiB, {gain:.2f}x full's)" in err


# -- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (dict(kv_layout="compress:3"), r"kv_layout='compress:3': k=3 must be a multiple of the 2 layers one "),
    (dict(kv_layout="compress:10"), r"kv_layout='compress:10': k=10 exceeds the 8 loop-layer slots"),
    (dict(kv_layout="compress:0"), r"kv_layout must be 'full', 'latest', 'compress:k'"),
    (dict(kv_layout="ring"), r"kv_layout must be 'full'"),
    (dict(kv_layout="full", exit_policy="early:0.5"), r"kv_layout='full' cannot be combined with exit_policy="
                                                      r"'early:0.5'.*kv_layout='latest'"),
    (dict(kv_layout="compress:4", exit_policy="early:0.5"), r"kv_layout='latest-compress:4'"),
    (dict(kv_layout="compress:4", speculative="loops:2"), r"speculative='loops:2' cannot be combined with "
                                                          r"kv_layout='compress:4'"),
    (dict(kv_layout="latest", kv_sharing="last"), r"pass kv_layout or kv_sharing, not both"),
    (dict(kv_layout="compress:4", deterministic=True), r"deterministic=True cannot be combined with "
                                                       r"kv_layout='compress:4'"),
    (dict(kv_layout="compress:4", kv_cache_dtype="kvarn_k4v2_g64", block_size=64),
     r"kv_cache_dtype='kvarn_k4v2_g64' cannot be combined with kv_layout='compress:4'"),
])
def test_layouts_the_engine_cannot_serve_are_refused_by_option(tiny_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_checkpoint, device="cpu", attention="torch", verbose=False, **options)


# -- CUDA graphs ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_layout, exit_policy, ring", [("compress:4", None, 2), ("compress:2", None, 1),
                                                          ("latest-compress:4", "early:0.6", 2)])
def test_a_ring_under_cuda_graphs_gives_the_eager_and_reference_tokens(tiny_checkpoint, oracle, kv_layout,
                                                                       exit_policy, ring):
    """Decode steps replay graphs captured with each loop's ring slots fixed (whole-step, or per loop under
    early:Q; prompt steps through the piecewise chain); fp32, so the reference's tokens too."""
    common = dict(device="cuda", dtype="float32", attention="triton", kv_layout=kv_layout,
                  exit_policy=exit_policy, enable_prefix_caching=False, verbose=False)
    tokens = {}
    for eager in (False, True):
        with Engine(tiny_checkpoint, enforce_eager=eager, **common) as engine:
            assert engine.uses_cuda_graphs != eager
            outputs = engine.generate([list(p) for p in PROMPTS], greedy(), use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outputs]
    early_q = None if exit_policy is None else float(exit_policy.partition(":")[2])
    assert tokens[False] == tokens[True] == \
        [oracle.decode_in_calls(p, NEW_TOKENS, ring_loops=ring, early_q=early_q) for p in PROMPTS]
