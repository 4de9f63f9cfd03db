"""The KVarN tile codec (cache/kvarn.py), the format strings and their byte accounting (cache/kv_formats.py),
and the one-sequence reference store (cache/packed_sequence.py), on CPU."""

import pytest
import torch

from attention import fp8
from cache import kvarn
from cache.kv_format import check_tile_dims, high_precision_rows
from cache.kv_formats import parse_kv_cache_dtype
from cache.kvarn_format import KVARN_PRESETS
from cache.packed_sequence import PackedSequence
from model.looped import SlotMap


def tiles(*shape, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:  # channels of very different spread, and tokens too: what the normalization is for
        x = x * torch.exp(torch.randn(shape[-1], generator=g)) * torch.exp(0.5 * torch.randn(shape[-2], 1,
                                                                                                generator=g))
    return x


def test_hadamard_is_orthonormal_and_symmetric():
    h = kvarn.hadamard(64, torch.float64)
    torch.testing.assert_close(h @ h, torch.eye(64, dtype=torch.float64))
    assert torch.equal(h, h.T)
    with pytest.raises(ValueError, match="power-of-two"):
        kvarn.hadamard(48)


def test_centred_std_keeps_its_precision_where_the_one_pass_formula_cancels():
    x = (1e4 + torch.randn(4, 256, dtype=torch.float64) * 1e-2).float()
    exact = x.double().std(-1, unbiased=False)
    two_pass = kvarn.centred_std(x, -1).double()
    one_pass = (x.square().mean(-1) - x.mean(-1).square()).clamp_min(0).sqrt().double()
    assert ((two_pass - exact).abs() / exact).max() < 1e-2
    assert ((one_pass - exact).abs() / exact).max() > 0.5


def test_sinkhorn_returns_its_best_balanced_iterate():
    x = tiles(16, 64, 32)
    log_r, log_c = kvarn.sinkhorn_normalize(x, iterations=8)
    n = x / torch.exp(log_r)[..., None] / torch.exp(log_c)[..., None, :]

    def imbalance(m):
        stds = torch.cat([kvarn.centred_std(m, -1), kvarn.centred_std(m, -2)], -1)
        return stds.amax(-1) / stds.amin(-1)

    assert (imbalance(n) <= imbalance(x) + 1e-6).all()
    assert imbalance(n).mean() < 0.5 * imbalance(x).mean()
    none_r, none_c = kvarn.sinkhorn_normalize(x, iterations=0)
    assert not none_r.any() and not none_c.any()


@pytest.mark.parametrize("bits", [2, 4, 5])
@pytest.mark.parametrize("keys", [True, False])
def test_each_code_is_within_half_a_step_of_its_value(bits, keys):
    """Round-to-nearest against the stored fp16 scales: every element is within half a quantization step
    (in the tile's own units), allowing for fp16 rounding of the range ends."""
    x = tiles(8, 64, 32, seed=bits)
    if keys:
        q = kvarn.quantize_keys(x, bits)
        y = kvarn.dequantize_keys(q)
        step = q.token_scale.float()[..., :, None] * q.channel_scale.float()[..., None, :]
    else:
        q = kvarn.quantize_values(x, bits)
        y = kvarn.dequantize_values(q)
        step = q.channel_scale.float()[..., None, :] * q.token_scale.float()[..., :, None]
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < (1 << bits)
    assert ((y - x).abs() <= 0.5 * step * 1.01 + 2e-3 * x.abs()).all()
    for scale in (q.channel_scale, q.token_scale):
        assert scale.dtype == torch.float16


def test_more_bits_and_the_normalization_give_less_error():
    x = tiles(16, 64, 64)
    x[..., 3] += 6.0  # a channel with a large mean and a small spread

    def error(bits, keys, rotate=True, iterations=8):
        rotation = kvarn.hadamard(x.shape[-1]) if rotate else None
        return float((kvarn.roundtrip(x, bits, keys, rotation, iterations) - x).norm() / x.norm())

    for keys in (True, False):
        assert error(2, keys) > error(4, keys) > error(5, keys)
        assert error(4, keys) < 0.12
        assert error(4, keys) < error(4, keys, rotate=False, iterations=0)
    assert error(4, True) < 0.8 * error(4, True, iterations=0)  # per-token spread is what keys' scales miss


@pytest.mark.parametrize("bits", [2, 4, 5, 8])
def test_codes_pack_into_bit_planes_and_back_exactly(bits):
    codes = torch.randint(0, 1 << bits, (3, 64, 32), dtype=torch.uint8)
    planes = kvarn.pack_codes(codes, bits)
    assert sum(p.shape[-1] for p in planes) * 8 == 32 * bits
    assert all(p.dtype == torch.uint8 for p in planes)
    assert torch.equal(kvarn.unpack_codes(planes, bits), codes)
    with pytest.raises(ValueError, match="do not pack"):
        kvarn.pack_codes(codes, 3)


def test_five_bit_codes_are_40_bit_columns_with_the_high_bytes_grouped_by_8_rows_in_a_record():
    group, head_dim = 16, 32
    codes = torch.randint(0, 32, (2, group, head_dim), dtype=torch.uint8)
    low, high = kvarn.pack_codes(codes, 5)
    column = codes[1, 9, 8:16].long()  # row 9, column 1: code k at bit 5k of one 40-bit integer
    value = int(sum(int(code) << (5 * k) for k, code in enumerate(column)))
    assert int.from_bytes(bytes(low[1, 9, 4:8].tolist()), "little") == value & 0xFFFFFFFF
    assert int(high[1, 9, 1]) == value >> 32
    rows = torch.cat([low, high], -1)
    record = kvarn.record_codes(rows, 5, group)
    flat = record[1].flatten()
    assert torch.equal(flat[:group * head_dim // 2], low[1].flatten())  # every row's words first
    # row 9 = group 1, row 1 of it; column 1: G D / 2 + (r // 8) D + 8 c + r % 8
    assert int(flat[group * head_dim // 2 + 1 * head_dim + 1 * 8 + 1]) == int(high[1, 9, 1])
    assert torch.equal(kvarn.row_codes(record, 5), rows)
    short = kvarn.record_codes(rows[:, :5], 5, group)  # a short tile: its rows, then zeros
    assert torch.equal(kvarn.row_codes(short, 5)[:, :5], rows[:, :5])
    assert not kvarn.row_codes(short, 5)[:, 5:].any()
    assert torch.equal(kvarn.record_codes(rows, 4, group), rows)  # other widths: rows as they are
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        kvarn.record_codes(rows[:, :4], 5, 4)


def test_attention_over_codes_with_folded_scales_equals_attention_over_decoded_tiles():
    x = tiles(4, 64, 32)
    keys, values = kvarn.quantize_keys(x, 4), kvarn.quantize_values(x.flip(-2), 2)
    q = torch.randn(4, 32)
    scores = kvarn.packed_scores(q, keys)
    torch.testing.assert_close(scores, (kvarn.dequantize_keys(keys) @ q[..., None])[..., 0], rtol=1e-5,
                               atol=1e-4)
    p = torch.softmax(scores, -1)
    torch.testing.assert_close(kvarn.packed_output(p, values),
                               (p[:, None, :] @ kvarn.dequantize_values(values))[:, 0], rtol=1e-5, atol=1e-5)


def test_fp8_scale_per_head_maps_the_largest_magnitude_to_448():
    x = tiles(32, 4, 16, outliers=False) * torch.tensor([1.0, 10.0, 100.0, 0.0])[None, :, None]
    scale = kvarn.fp8_scale(x, (0, 2))
    assert scale.shape == (1, 4, 1) and float(scale[0, 3, 0]) == 1.0
    y = fp8.dequantize(fp8.quantize(x, scale), scale)
    assert ((y - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -9).all()  # e4m3: 3 mantissa bits


def test_format_strings_are_parsed_fail_closed():
    assert parse_kv_cache_dtype("auto").kind == "dense"
    assert parse_kv_cache_dtype("fp8_e4m3").kind == "fp8"
    for name, (key_bits, value_bits, group) in KVARN_PRESETS.items():
        fmt = parse_kv_cache_dtype(name)
        assert (fmt.key_bits, fmt.value_bits, fmt.group, fmt.kind) == (key_bits, value_bits, group, "kvarn")
    for bad in ("kvarn_k4v2", "KVARN_K4V2_G64", "int4", "", None, 4):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bf16, fp8_e4m3, kvarn_"):
            parse_kv_cache_dtype(bad)
    for group, head_dim in ((48, 128), (64, 96), (4, 128)):
        with pytest.raises(ValueError, match="power-of-two"):
            check_tile_dims(group, head_dim)


def test_byte_accounting_of_a_tile_and_a_sequence():
    fmt = parse_kv_cache_dtype("kvarn_k4v2_g64")
    # keys: 64 x 128 x 4 bits + fp16 channel scale and zero + fp16 token scale; values: 2 bits + channel
    # scale + token scale and zero
    assert fmt.tile_bytes(128) == (4096 + 2 * 256 + 128) + (2048 + 256 + 2 * 128)
    bf16 = parse_kv_cache_dtype("bf16")
    assert bf16.sequence_bytes(4096, 96, 16, 128) == 4096 * 96 * 8192
    packed = fmt.sequence_bytes(4096, 96, 16, 128)
    assert packed == 96 * 64 * 16 * fmt.tile_bytes(128)
    assert bf16.sequence_bytes(4096, 96, 16, 128) / packed > 4.4
    side = fmt.sequence_bytes(4100, 96, 16, 128, sink=64, tail=256) - packed
    assert side == 96 * (64 + 256) * 8192  # the 4 unfilled-tile tokens are among the newest 256
    assert high_precision_rows(100, 64, sink=64, tail=16) == 64 + 36  # the unfilled tile exceeds the tail


def attend_exactly(q, k, v, scale):
    keys = k.repeat_interleave(q.shape[0] // k.shape[1], 1)
    values = v.repeat_interleave(q.shape[0] // k.shape[1], 1)
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q, keys) * scale, -1)
    return torch.einsum("hl,lhd->hd", weights, values)


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "kvarn_k4v2_g64", "kvarn_k5v5_g64"])
def test_packed_sequence_reads_packed_tiles_outside_the_sink_and_tail(name):
    """Decode-style calls, one token each after a prompt: the output equals exact attention over the history
    where each position outside the high-precision rows is replaced by its tile's codec round trip."""
    fmt = parse_kv_cache_dtype(name)
    heads, kv_heads, head_dim, sink, tail = 4, 2, 32, 8, 16
    store = PackedSequence(fmt, 1, heads, kv_heads, head_dim, sink=sink, tail=tail, fp8_scale=None)
    g = torch.Generator().manual_seed(1)
    k_all = torch.randn(150, kv_heads, head_dim, generator=g)
    v_all = torch.randn(150, kv_heads, head_dim, generator=g)
    q_all = torch.randn(150, heads, head_dim, generator=g)
    store(q_all[:100], k_all[:100], v_all[:100], 0)
    for position in range(100, 150):
        out = store(q_all[position:position + 1], k_all[position:position + 1], v_all[position:position + 1],
                    0)
    length = 150
    k_read, v_read = k_all.clone(), v_all.clone()
    if fmt.kind == "kvarn":
        high = set(range(sink)) | set(range(length - max(tail, length % 64), length))
        for tile in range(length // 64):
            rows = slice(tile * 64, (tile + 1) * 64)
            rotation = kvarn.hadamard(head_dim)
            k_tile = kvarn.roundtrip(k_all[rows].transpose(0, 1), fmt.key_bits, True, rotation)
            v_tile = kvarn.roundtrip(v_all[rows].transpose(0, 1), fmt.value_bits, False, rotation)
            k_tile, v_tile = k_tile.transpose(0, 1), v_tile.transpose(0, 1)
            for i in range(64):
                if tile * 64 + i not in high:
                    k_read[tile * 64 + i], v_read[tile * 64 + i] = k_tile[i], v_tile[i]
        assert not torch.equal(k_read, k_all)
    elif fmt.kind == "fp8":
        k_scale, v_scale = kvarn.fp8_scale(k_all[:100], (0, 2)), kvarn.fp8_scale(v_all[:100], (0, 2))
        k_read = fp8.dequantize(fp8.quantize(k_all, k_scale), k_scale)
        v_read = fp8.dequantize(fp8.quantize(v_all, v_scale), v_scale)
    want = attend_exactly(q_all[149], k_read, v_read, head_dim ** -0.5)
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-5)
    exact = attend_exactly(q_all[149], k_all, v_all, head_dim ** -0.5)
    if fmt.kind == "dense":
        torch.testing.assert_close(out[0], exact, rtol=1e-5, atol=1e-6)
    else:
        assert not torch.allclose(out[0], exact, rtol=1e-6, atol=1e-7)


def test_packed_sequence_refuses_tile_dims_that_do_not_pack():
    with pytest.raises(ValueError, match="head_dim"):
        PackedSequence(parse_kv_cache_dtype("kvarn_k4v2_g64"), 1, 4, 2, 24)


def test_high_precision_under_kv_sharing_starts_generated_tiles_at_the_prompt_end():
    """Tiles of 4, a prompt of 6 (tiles 0..3 and a short 4..5), sink 1, tail 1. The short tile is full once
    the prompt is, and generated tiles run 6..9, 10..13, ..."""
    from attention.packed_attention import high_precision

    def read_exactly(query, prompt_len):
        keys = torch.arange(query + 1)
        hp = high_precision(keys[-1:], keys, 4, 1, 1, prompt_len)[0]
        return [int(p) for p in keys[hp]]

    assert read_exactly(4, 6) == [0, 4]  # the prompt's last tile is filling
    assert read_exactly(5, 6) == [0, 5]  # ... and is full at the prompt's end
    assert read_exactly(5, None) == [0, 4, 5]  # without sharing, tile 4..7 is filling
    assert read_exactly(8, 6) == [0, 6, 7, 8]  # generated tile 6..9 is filling
    assert read_exactly(9, 6) == [0, 9]  # ... and full
    assert read_exactly(10, 6) == [0, 10]
    assert read_exactly(9, None) == [0, 8, 9]  # absolute tiles: 8..11 is filling


def test_a_short_tile_takes_a_full_records_place_and_is_read_as_its_rows_alone():
    """Under kv_sharing="last" the call that completes a 40-token prompt packs its last tile of 40 rows
    (cache/kvarn_pool.py): quantized over those rows alone, stored where a full tile's first 40 rows go, and
    read back as the codec's round trip of those rows."""
    from cache.kvarn_pool import KVarNPool

    fmt = parse_kv_cache_dtype("kvarn_k4v2_g64")
    pool = KVarNPool(fmt, SlotMap(1, 1), 2, 2, 32, torch.float32, torch.device("cpu"))
    k, v = tiles(40, 2, 32, seed=3), tiles(40, 2, 32, seed=4)
    table = torch.tensor([1, 0], dtype=torch.int32)
    pool.pack_filled(0, [], table, 0, k, v)  # without prompt_len the tile is filling: nothing packed
    (_, _), (packed_k, _) = pool.read(0, [], table, 0, k, v)
    assert not packed_k.any()
    pool.pack_filled(0, [], table, 0, k, v, prompt_len=40)
    (exact_k, _), (packed_k, packed_v) = pool.read(0, [], table, 0, k, v, prompt_len=40)
    rotation = kvarn.hadamard(32)
    assert torch.equal(exact_k, k)
    assert torch.equal(packed_k, kvarn.roundtrip(k.transpose(0, 1), 4, True, rotation).transpose(0, 1))
    assert torch.equal(packed_v, kvarn.roundtrip(v.transpose(0, 1), 2, False, rotation).transpose(0, 1))


def test_packed_sequence_under_kv_sharing_reads_the_last_loops_generated_tiles():
    """kv_sharing="last", 2 loops x 1 layer: a prompt of 100 tokens (tiles 0..63 and a short 64..99), then 70
    generated tokens, each run at both loops. The last token reads the prompt as its loop keeps it, earlier
    generated tokens as the last loop left them and itself at its loop; positions outside the sink and tail
    through their tiles' codec round trip, the generated tiles counted from position 100 (100..163 full,
    164..169 filling)."""
    fmt = parse_kv_cache_dtype("kvarn_k4v2_g64")
    heads, kv_heads, head_dim, sink, tail = 4, 2, 32, 8, 16
    store = PackedSequence(fmt, 2, heads, kv_heads, head_dim, sink=sink, tail=tail, prompt_len=100)
    g = torch.Generator().manual_seed(2)
    k_all, v_all = (torch.randn(2, 170, kv_heads, head_dim, generator=g) for _ in range(2))
    q_all = torch.randn(2, 170, heads, head_dim, generator=g)
    for loop in (0, 1):
        store(q_all[loop, :100], k_all[loop, :100], v_all[loop, :100], loop)
    for position in range(100, 170):
        outs = [store(q_all[loop, position:position + 1], k_all[loop, position:position + 1],
                      v_all[loop, position:position + 1], loop) for loop in (0, 1)]
    rotation = kvarn.hadamard(head_dim)
    high = set(range(sink)) | set(range(170 - tail, 170)) | set(range(164, 170))
    for loop in (0, 1):
        keys = torch.cat([k_all[loop, :100], k_all[1, 100:169], k_all[loop, 169:]])
        values = torch.cat([v_all[loop, :100], v_all[1, 100:169], v_all[loop, 169:]])
        k_read, v_read = keys.clone(), values.clone()
        for rows in (slice(0, 64), slice(64, 100), slice(100, 164)):
            k_tile = kvarn.roundtrip(keys[rows].transpose(0, 1), 4, True, rotation).transpose(0, 1)
            v_tile = kvarn.roundtrip(values[rows].transpose(0, 1), 2, False, rotation).transpose(0, 1)
            for i, position in enumerate(range(rows.start, rows.stop)):
                if position not in high:
                    k_read[position], v_read[position] = k_tile[i], v_tile[i]
        want = attend_exactly(q_all[loop, 169], k_read, v_read, head_dim ** -0.5)
        torch.testing.assert_close(outs[loop][0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_heads,rows,head_dim", [(2, 64, 32), (1, 1, 64)])
def test_batch_invariant_codec_decodes_a_tile_to_the_same_bits_alone_among_others_and_at_two_threads(
        kv_heads, rows, head_dim):
    """batch_invariant=True (Engine(deterministic=True)): the tiles' rotation goes row by row (kvarn.rotate),
    so a tile decodes to the same bits by itself, among 5 others and at two threads, and its round trip is
    those bits: a pool read decodes all of a row's tiles in one call, the one-sequence reference each tile
    as it packs. (A one-row tile of one kv head is where MKL's plain product of one row, the default mode's,
    takes another kernel than of six.)"""
    rotation = kvarn.hadamard(head_dim)
    x = tiles(6, kv_heads, rows, head_dim, seed=5)
    many = [kvarn.encode_tiles(tile, 4, True, rotation, batch_invariant=True) for tile in x]
    stacked = tuple(torch.stack(part) for part in zip(*many))
    alone = kvarn.decode_tiles(*many[3], 4, True, rotation, batch_invariant=True)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            among = kvarn.decode_tiles(*stacked, 4, True, rotation, batch_invariant=True)
            assert torch.equal(among[3], alone)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kvarn.roundtrip(x[3], 4, True, rotation, batch_invariant=True), alone)


@pytest.mark.parametrize("sink,tail", [(0, 0), (8, 16)])
def test_batch_invariant_two_way_attention_gives_a_query_the_same_bits_in_a_chunk_and_alone(sink, tail):
    """attend_two_ways(batch_invariant=True): fixed key tiles, so the query at position 100 of a chunk of 120
    (positions 30..149, three key tiles) has the bits it has decoded alone over its 101 positions (two)."""
    from attention.packed_attention import attend_two_ways, high_precision

    g = torch.Generator().manual_seed(6)
    q = torch.randn(120, 4, 32, generator=g)
    exact = (torch.randn(150, 2, 32, generator=g), torch.randn(150, 2, 32, generator=g))
    packed = tuple(x + 0.1 * torch.randn(x.shape, generator=g) for x in exact)
    positions = torch.arange(150)
    hp = high_precision(positions[30:], positions, 64, sink, tail)
    chunk = attend_two_ways(q, exact, packed, 30, hp, 0.2, batch_invariant=True)
    alone = attend_two_ways(q[70:71], tuple(x[:101] for x in exact), tuple(x[:101] for x in packed), 100,
                            hp[70:71, :101], 0.2, batch_invariant=True)
    assert torch.equal(chunk[70:71], alone)
    torch.testing.assert_close(chunk, attend_two_ways(q, exact, packed, 30, hp, 0.2))  # the same attention


def test_a_batch_invariant_torch_backend_refuses_a_pool_that_is_not():
    from attention.registry import select
    from cache.kvarn_pool import KVarNPool

    pool = KVarNPool(parse_kv_cache_dtype("kvarn_k4v2_g64"), SlotMap(1, 1), 2, 2, 32, torch.float32,
                     torch.device("cpu"))
    backend = select("torch", torch.device("cpu"), {"batch_invariant": True})
    with pytest.raises(ValueError, match="a KVarN pool made with batch_invariant=False cannot serve a torch "
                                         "backend with batch_invariant=True"):
        backend.bind_packed(pool, 0.1)
