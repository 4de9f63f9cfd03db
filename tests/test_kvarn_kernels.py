"""The KVarN Triton kernels against the plain-torch codec (cache/kvarn.py): packing
(cache/kvarn_pack_kernel.py) against quantize_keys / quantize_values / pack_codes, and decode attention over a
packed history (attention/kernels/kvarn_decode.py) against fp32 attention over the reference's decoded tiles
and side rows.
Without CUDA the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), at small tiles;
the `gpu` tests take Ouro-1.4B's attention shape."""

import dataclasses
import math

import pytest
import torch

from attention.kernels.kvarn_decode import PLANE_WIDTHS, kvarn_decode
from attention.kernels.kvarn_prefill import kvarn_prefill
from attention import packed_attention
from cache import kvarn
from cache.kv_formats import parse_kv_cache_dtype
from cache.kvarn_format import KVARN_PRESETS, KVarNFormat
from cache.kvarn_pool import KVarNPool
from cache.kvarn_pack_kernel import pack_tiles, plane_widths, rotate
from cache.packed_sequence import PackedSequence
from model.looped import SlotMap

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON_SCALE = float("nan")  # what unused pool blocks hold: any read of one shows in the output


def empty_pool(num_blocks, kv_heads, group, head_dim, key_bits, value_bits):
    """One slot's packed pool, its scales poisoned (NaN) and its codes arbitrary."""
    def codes(bits):
        return torch.randint(0, 256, (num_blocks, kv_heads, group, head_dim * bits // 8), dtype=torch.uint8,
                             device=DEVICE)
    return (codes(key_bits), codes(value_bits),
            torch.full((num_blocks, kv_heads, 2 * head_dim + group), POISON_SCALE, dtype=torch.float16,
                       device=DEVICE),
            torch.full((num_blocks, kv_heads, head_dim + 2 * group), POISON_SCALE, dtype=torch.float16,
                       device=DEVICE))


def split_planes(record, bits, head_dim):
    """A pool block's codes [..., G, bytes] as kvarn.unpack_codes takes them: one tensor per bit plane."""
    rows = kvarn.row_codes(record, bits)
    planes, first = [], 0
    for width in kvarn.PLANES[bits]:
        planes.append(rows[..., first:first + head_dim * width // 8])
        first += head_dim * width // 8
    return planes


def unpack_keys(key_codes, key_scales, block, bits, head_dim):
    """Block `block` of a slot's key pool as kvarn.QuantizedKeys over [kv_heads, G, D]."""
    scales = key_scales[block]
    return kvarn.QuantizedKeys(kvarn.unpack_codes(split_planes(key_codes[block], bits, head_dim), bits),
                               scales[:, :head_dim], scales[:, head_dim:2 * head_dim],
                               scales[:, 2 * head_dim:])


def unpack_values(value_codes, value_scales, block, bits, head_dim, group):
    scales = value_scales[block]
    return kvarn.QuantizedValues(kvarn.unpack_codes(split_planes(value_codes[block], bits, head_dim), bits),
                                 scales[:, :head_dim], scales[:, head_dim:head_dim + group],
                                 scales[:, head_dim + group:])


def write_reference_tile(pool, block, k_tile, v_tile, key_bits, value_bits):
    """The torch codec's encoding of k_tile, v_tile [kv_heads, G, D] into block `block` of the pool
    (kvarn.encode_tiles, unrotated), and what attention reads of it."""
    key_codes, value_codes, key_scales, value_scales = pool
    group = k_tile.shape[-2]
    for codes, scales, tile, bits, keys in ((key_codes, key_scales, k_tile, key_bits, True),
                                            (value_codes, value_scales, v_tile, value_bits, False)):
        tile_codes, scales[block] = kvarn.encode_tiles(tile, bits, keys, None)
        codes[block] = kvarn.record_codes(tile_codes, bits, group)
    return tuple(kvarn.decode_tiles(kvarn.row_codes(codes[block], bits), scales[block], bits, keys, None)
                 for codes, scales, bits, keys in ((key_codes, key_scales, key_bits, True),
                                                   (value_codes, value_scales, value_bits, False)))


def one_head(quantized, head):
    """kv head `head` of a QuantizedKeys / QuantizedValues over [kv_heads, ...]."""
    return type(quantized)(*(getattr(quantized, f.name)[head] for f in dataclasses.fields(quantized)))


def test_plane_widths_follow_the_codec():
    for bits, widths in kvarn.PLANES.items():
        assert plane_widths(bits) == PLANE_WIDTHS[bits] == (widths[0], sum(widths[1:]))
    with pytest.raises(ValueError, match="do not pack"):
        plane_widths(3)


# ---------------------------------------------------------------------------------------------------------
# Packing


def pack_source(rows, kv_heads, head_dim, seed):
    """K/V-like rows [rows, kv_heads, D] whose channels and tokens have very different spreads, and one
    channel with a large mean against its spread (an outlier, as unrotated keys have)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, kv_heads, head_dim, generator=g)
    x = x * torch.exp(torch.randn(head_dim, generator=g))
    x = x * torch.exp(0.5 * torch.randn(rows, 1, 1, generator=g))
    x[:, :, 3] = 8.0 + 0.05 * x[:, :, 3]
    return x


def scale_grid(quantized, field):
    """The [G, D] products of the per-token and per-channel factors of one tile's element steps or offsets:
    token scale x channel scale / zero (keys), channel scale x token scale / zero (values)."""
    if isinstance(quantized, kvarn.QuantizedKeys):
        return quantized.token_scale.float()[:, None] * getattr(quantized, field).float()[None, :]
    other = "token_scale" if field == "channel_scale" else field
    return quantized.channel_scale.float()[None, :] * getattr(quantized, other).float()[:, None]


def check_packed_tile(key_bits, value_bits, x_k, keys, got_keys, x_v, values, got_values):
    """The kernel's encoding of one [G, D] tile (got_*) against the reference's.

    - Each element's step and offset (scale_grid) within about two fp16 steps. The products are what the
      normalization fixes; r against c is free, and near-tied iterates at convergence (imbalance equal to
      fp32 rounding) can trade a few percent between them, so the factors alone are not compared.
    - Codes: round-to-nearest against the kernel's own stored scales; identical to the reference's nearly
      everywhere, and at most one step off where both stored the same scales (where a stored scale is one
      fp16 step away a code moves with it, by more than a step on a channel whose mean is large against
      its spread).
    - The decoded tile: within half a step wherever the reference's is (the reference misses that bound
      only where a scale or zero clamps at fp16's 65504), and no further from the tile than the reference's.
    """
    cases = ((x_k, keys, got_keys, kvarn.dequantize_keys, "channel_zero", key_bits),
             (x_v, values, got_values, kvarn.dequantize_values, "token_zero", value_bits))
    for x, want, got, decode, zero, bits in cases:
        for field in ("channel_scale", zero):
            torch.testing.assert_close(scale_grid(got, field), scale_grid(want, field), rtol=4e-3, atol=1e-7)
        if zero == "channel_zero":  # keys: per-channel scale and zero of the token-normalized tile
            own = kvarn._codes(x / got.token_scale.float()[:, None], got.channel_scale.float()[None, :],
                               got.channel_zero.float()[None, :], bits)
            same_channel = (got.channel_scale == want.channel_scale) & (got.channel_zero == want.channel_zero)
            same = (got.token_scale == want.token_scale)[:, None] & same_channel[None, :]
        else:  # values: per-token scale and zero of the channel-normalized tile
            own = kvarn._codes(x / got.channel_scale.float()[None, :], got.token_scale.float()[:, None],
                               got.token_zero.float()[:, None], bits)
            same_token = (got.token_scale == want.token_scale) & (got.token_zero == want.token_zero)
            same = (got.channel_scale == want.channel_scale)[None, :] & same_token[:, None]
        assert float((own == got.codes).float().mean()) >= 0.999
        off = (got.codes.int() - want.codes.int()).abs()
        assert float((off == 0).float().mean()) >= 0.99 and bool((off[same] <= 1).all())
        error, reference_error = (decode(got) - x).abs(), (decode(want) - x).abs()
        slack = 2e-3 * x.abs() + 1e-6
        within = error <= 0.5 * 1.01 * scale_grid(got, "channel_scale") + slack
        reference_within = reference_error <= 0.5 * 1.01 * scale_grid(want, "channel_scale") + slack
        assert (within | ~reference_within).all()
        assert float(error.norm()) <= 1.01 * float(reference_error.norm()) + 1e-6


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a constant tile's iterates overflow, as torch's do
@pytest.mark.parametrize("key_bits,value_bits,group,head_dim,dtype", [
    (4, 2, 16, 32, torch.float32), (4, 4, 64, 16, torch.float32), (5, 5, 16, 32, torch.bfloat16),
])
def test_pack_matches_the_torch_codec(key_bits, value_bits, group, head_dim, dtype):
    """Tiles gathered from shuffled source rows into scattered blocks: an ordinary tile, one with a constant
    token row and a constant channel (their stds clamp), one constant (zero scales, code 0)."""
    kv_heads, num_tiles, num_blocks = 2, 3, 5
    src_k = pack_source(num_tiles * group + 7, kv_heads, head_dim, seed=key_bits)
    src_v = pack_source(num_tiles * group + 7, kv_heads, head_dim, seed=value_bits + 10).flip(-1)
    src_rows = torch.randperm(src_k.shape[0], generator=torch.Generator().manual_seed(0))[:num_tiles * group]
    src_rows = src_rows.view(num_tiles, group)
    for src in (src_k, src_v):
        src[src_rows[1, 5]] = 0.75  # a constant token row
        src[src_rows[1], :, 6] = -1.5  # a constant channel
        src[src_rows[2], 1] = 0.25  # a constant tile (kv head 1)
    src_k, src_v = src_k.to(dtype), src_v.to(dtype)
    dst_blocks = torch.tensor([3, 0, 4], dtype=torch.int32)
    pool = empty_pool(num_blocks, kv_heads, group, head_dim, key_bits, value_bits)
    before = [t.clone() for t in pool]
    pack_tiles(src_k.to(DEVICE), src_v.to(DEVICE), src_rows.to(DEVICE), dst_blocks.to(DEVICE), *pool,
               key_bits, value_bits)
    pool = [t.cpu() for t in pool]
    for untouched in (1, 2):  # blocks no tile went to
        assert all(torch.equal(t[untouched].cpu(), b[untouched].cpu()) for t, b in zip(pool, before)
                   if t.dtype == torch.uint8)
        assert all(t[untouched].isnan().all() for t in pool[2:])
    for tile, block in enumerate(dst_blocks.tolist()):
        got_keys = unpack_keys(pool[0], pool[2], block, key_bits, head_dim)
        got_values = unpack_values(pool[1], pool[3], block, value_bits, head_dim, group)
        for head in range(kv_heads):
            x_k, x_v = src_k[src_rows[tile], head].float(), src_v[src_rows[tile], head].float()
            keys, values = kvarn.quantize_keys(x_k, key_bits), kvarn.quantize_values(x_v, value_bits)
            check_packed_tile(key_bits, value_bits, x_k, keys, one_head(got_keys, head), x_v, values,
                              one_head(got_values, head))
            if tile == 2 and head == 1:  # the constant tile: zero scales, code 0, decoded exactly
                assert not got_keys.channel_scale[head].any() and not got_keys.codes[head].any()
                assert not got_values.token_scale[head].any() and not got_values.codes[head].any()
                assert torch.equal(kvarn.dequantize_keys(one_head(got_keys, head)), x_k)
                assert torch.equal(kvarn.dequantize_values(one_head(got_values, head)), x_v)


def test_pack_rotates_unrotated_bf16_rows_as_the_codec_does():
    """The engine's side-block pack: unrotated bf16 rows, rotated in the kernel (rotation=H), at the tiny
    model's tile (G 64, head_dim 32), against the codec over the rows rotated in fp32."""
    key_bits, value_bits, group, head_dim, kv_heads = 4, 2, 64, 32, 2
    src_k = pack_source(group, kv_heads, head_dim, seed=3).to(torch.bfloat16)
    src_v = pack_source(group, kv_heads, head_dim, seed=4).flip(-1).to(torch.bfloat16)
    pool = empty_pool(1, kv_heads, group, head_dim, key_bits, value_bits)
    rotation = kvarn.hadamard(head_dim, device=DEVICE)
    rows, blocks = torch.arange(group, device=DEVICE)[None], torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pack_tiles(src_k.to(DEVICE), src_v.to(DEVICE), rows, blocks, *pool, key_bits, value_bits,
               rotation=rotation)
    pool = [t.cpu() for t in pool]
    got_keys = unpack_keys(pool[0], pool[2], 0, key_bits, head_dim)
    got_values = unpack_values(pool[1], pool[3], 0, value_bits, head_dim, group)
    for head in range(kv_heads):
        x_k, x_v = (rotate(src[:, head]) for src in (src_k, src_v))
        keys, values = kvarn.quantize_keys(x_k, key_bits), kvarn.quantize_values(x_v, value_bits)
        check_packed_tile(key_bits, value_bits, x_k, keys, one_head(got_keys, head), x_v, values,
                          one_head(got_values, head))


def test_pack_refuses_a_pool_of_the_wrong_shape():
    pool = empty_pool(2, 2, 16, 32, 4, 2)
    src = torch.zeros(16, 2, 32, device=DEVICE)
    rows = torch.arange(16, device=DEVICE).view(1, 16)
    blocks = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="key_codes must be a contiguous"):
        pack_tiles(src, src, rows, blocks, *pool, 5, 2)
    with pytest.raises(ValueError, match="src_rows must be int64"):
        pack_tiles(src, src, rows.int(), blocks, *pool, 4, 2)


# ---------------------------------------------------------------------------------------------------------
# Decode attention over a packed history


def high_precision(position, length, group, sink, tail):
    return position < sink or position >= length - max(tail, length % group)


def packed_history(lengths, kv_heads, head_dim, group, key_bits, value_bits, side_dtype, sink, tail, seed=0):
    """Rows of rotated K/V laid out as the engine would: every full tile packed (the torch codec) into a
    shuffled block, every tile holding a high-precision position also in a side block; block 0 and side
    block 0 unused and poisoned (NaN). Returns the kernel's inputs and, per row, K/V as attention reads them
    [L, kv_heads, D] fp32."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(length / group) for length in lengths)
    num_blocks = 1 + sum(length // group for length in lengths)
    num_side = 1 + sum(math.ceil(length / group) for length in lengths)
    pool = [t.cpu() for t in empty_pool(num_blocks, kv_heads, group, head_dim, key_bits, value_bits)]
    side_k = torch.full((num_side, group, kv_heads, head_dim), float("nan"), dtype=side_dtype)
    side_v = side_k.clone()
    free_blocks = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    free_side = (1 + torch.randperm(num_side - 1, generator=g)).tolist()
    block_tables = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
    side_tables = block_tables.clone()
    reads = []
    for row, length in enumerate(lengths):
        k = torch.randn(length, kv_heads, head_dim, generator=g)
        k = k * torch.exp(torch.randn(head_dim, generator=g))
        v = torch.randn(length, kv_heads, head_dim, generator=g)
        k, v = k.to(side_dtype).float(), v.to(side_dtype).float()  # as the side pool holds them
        k_read, v_read = k.clone(), v.clone()
        for tile in range(math.ceil(length / group)):
            rows = slice(tile * group, min((tile + 1) * group, length))
            if (tile + 1) * group <= length:
                block = block_tables[row, tile] = free_blocks.pop()
                k_tile, v_tile = write_reference_tile(pool, block, k[rows].transpose(0, 1),
                                                      v[rows].transpose(0, 1), key_bits, value_bits)
                for i in range(group):
                    if not high_precision(tile * group + i, length, group, sink, tail):
                        k_read[tile * group + i], v_read[tile * group + i] = k_tile[:, i], v_tile[:, i]
            if any(high_precision(p, length, group, sink, tail) for p in range(rows.start, rows.stop)):
                side = side_tables[row, tile] = free_side.pop()
                side_k[side, :rows.stop - rows.start] = k[rows].to(side_dtype)
                side_v[side, :rows.stop - rows.start] = v[rows].to(side_dtype)
        reads.append((k_read, v_read))
    tensors = dict(key_codes=pool[0], value_codes=pool[1], key_scales=pool[2], value_scales=pool[3],
                   side_k=side_k, side_v=side_v, block_tables=block_tables, side_tables=side_tables,
                   context_lens=torch.tensor(lengths, dtype=torch.int32))
    return {name: t.to(DEVICE) for name, t in tensors.items()}, reads


def attend(q, reads, scale):
    """fp32 softmax attention of q [rows, heads, D] over each row's K/V as read."""
    out = []
    for row, (k, v) in enumerate(reads):
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[row].float(), keys) * scale, -1)
        out.append(torch.einsum("hl,lhd->hd", weights, values))
    return torch.stack(out)


@pytest.mark.parametrize("group,key_bits,value_bits,sink,tail,lengths,side_dtype", [
    (16, 4, 2, 0, 0, [5, 48, 77, 130], torch.float32),
    (16, 5, 5, 8, 20, [5, 48, 77, 130], torch.float16),
    (64, 4, 4, 0, 0, [40, 128, 200, 300], torch.float32),
    (64, 4, 2, 4, 70, [40, 128, 200, 300], torch.float32),
])
def test_decode_matches_attention_over_decoded_tiles(group, key_bits, value_bits, sink, tail, lengths,
                                                     side_dtype):
    """2 query heads per kv head; a row shorter than a tile (all side rows), rows with L % G == 0 and not,
    contexts over 1 to 4 splits of one tile each (split_min_keys = G)."""
    heads, kv_heads, head_dim = 4, 2, 32
    inputs, reads = packed_history(lengths, kv_heads, head_dim, group, key_bits, value_bits, side_dtype, sink,
                                   tail)
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(1)) * 2
    out = kvarn_decode(q.to(DEVICE), **inputs, key_bits=key_bits, value_bits=value_bits, sink=sink, tail=tail,
                       num_splits=4, split_min_keys=group)
    assert out.dtype == torch.float32 and out.shape == q.shape
    want = attend(q, reads, head_dim ** -0.5)
    assert float((out.cpu() - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("group,sink,tail,lengths", [(16, 8, 20, [5, 48, 77, 130]), (16, 0, 0, [16, 33])])
def test_decode_with_unrotated_side_rows_gives_the_unrotated_output(group, sink, tail, lengths):
    """The engine's side pool keeps rows as the model made them: with q given, side rows score with q and
    their share stays unrotated, the packed share is rotated back; the same attention, in the model's
    basis."""
    heads, kv_heads, head_dim = 4, 2, 32
    inputs, reads = packed_history(lengths, kv_heads, head_dim, group, 4, 2, torch.float32, sink, tail)
    rotation = kvarn.hadamard(head_dim, device=DEVICE)
    inputs["side_k"], inputs["side_v"] = rotate(inputs["side_k"]), rotate(inputs["side_v"])
    q_r = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(4)) * 2
    out = kvarn_decode(q_r.to(DEVICE), **inputs, key_bits=4, value_bits=2, sink=sink, tail=tail, num_splits=4,
                       split_min_keys=group, q=rotate(q_r.to(DEVICE)), rotation=rotation)
    want = rotate(attend(q_r, reads, head_dim ** -0.5))
    assert float((out.cpu() - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_decode_of_one_row_takes_a_query_view_whose_row_stride_differs():
    """One decode row's unrotated query is a view of the model's qkv (row stride 3 x heads x D; contiguous()
    keeps a size-1 dim's stride), its rotation a fresh tensor: the strides differ only where the size is 1,
    which the kernel never steps along."""
    inputs, reads = packed_history([77], 2, 32, 16, 4, 2, torch.float32, 8, 20)
    rotation = kvarn.hadamard(32, device=DEVICE)
    inputs["side_k"], inputs["side_v"] = rotate(inputs["side_k"]), rotate(inputs["side_v"])
    qkv = torch.randn(1, 3 * 4, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    q = qkv[:, :4].contiguous()
    assert q.stride(0) == 3 * 4 * 32
    q_r = rotate(q).contiguous()
    out = kvarn_decode(q_r, **inputs, key_bits=4, value_bits=2, sink=8, tail=20, num_splits=2,
                       split_min_keys=16, q=q, rotation=rotation)
    want = attend(q_r.cpu(), reads, 32 ** -0.5)
    assert float((out.cpu() - rotate(want)).abs().max()) <= 1e-4 * float(want.abs().max())


def test_decode_of_an_empty_row_gives_zeros_and_leaves_the_others_alone():
    inputs, reads = packed_history([0, 33], 2, 32, 16, 4, 2, torch.float32, 0, 0)
    q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(2))
    out = kvarn_decode(q.to(DEVICE), **inputs, key_bits=4, value_bits=2, num_splits=2, split_min_keys=16)
    assert not out[0].any()
    torch.testing.assert_close(out[1].cpu(), attend(q[1:], reads[1:], 32 ** -0.5)[0], rtol=1e-4, atol=1e-5)


def test_pack_then_decode_equals_the_packed_sequence_reference():
    """The engine's flow on one row: K/V rows in side blocks, the full tiles packed by the pack kernel
    straight from them, the query attended; against PackedSequence (the reference store) at the same sink
    and tail. PackedSequence runs unrotated here: its rotation of a [kv_heads, G, D] tile and `rotate` of
    the rows round differently, which can move a code by one step. The interpreter then reproduces the
    codec's codes and the two agree to fp32 rounding; on CUDA a code may be one step off (exp, log and sqrt
    round differently there)."""
    heads, kv_heads, head_dim, group, sink, tail, length = 4, 2, 32, 16, 8, 20, 70
    fmt = KVarNFormat("kvarn_k4v2_g16", 4, 2, group)  # a 16-token tile, to stay small
    g = torch.Generator().manual_seed(3)
    k = torch.randn(length, kv_heads, head_dim, generator=g)
    v = torch.randn(length, kv_heads, head_dim, generator=g)
    q = torch.randn(length, heads, head_dim, generator=g)
    store = PackedSequence(fmt, 1, heads, kv_heads, head_dim, sink=sink, tail=tail, rotate=False)
    store(q[:-1], k[:-1], v[:-1], 0)
    want = store(q[-1:], k[-1:], v[-1:], 0)[0]

    tiles, full = math.ceil(length / group), length // group
    side_k = torch.zeros(tiles * group, kv_heads, head_dim, device=DEVICE)
    side_v = torch.zeros_like(side_k)
    side_k[:length], side_v[:length] = k.to(DEVICE), v.to(DEVICE)
    pool = empty_pool(full + 1, kv_heads, group, head_dim, fmt.key_bits, fmt.value_bits)
    src_rows = torch.arange(full * group, device=DEVICE).view(full, group)
    dst_blocks = torch.arange(full, 0, -1, dtype=torch.int32)  # tile t in block full - t; block 0 unused
    pack_tiles(side_k, side_v, src_rows, dst_blocks.to(DEVICE), *pool, fmt.key_bits, fmt.value_bits)
    block_tables = torch.cat([dst_blocks, torch.full((tiles - full,), -1, dtype=torch.int32)])[None]
    side_tables = torch.arange(tiles, dtype=torch.int32)[None]
    side_k, side_v = (t.view(tiles, group, kv_heads, head_dim) for t in (side_k, side_v))
    got = kvarn_decode(q[-1:].to(DEVICE), *pool, side_k, side_v, block_tables.to(DEVICE),
                       side_tables.to(DEVICE), torch.tensor([length], dtype=torch.int32, device=DEVICE),
                       fmt.key_bits, fmt.value_bits, sink=sink, tail=tail, num_splits=2,
                       split_min_keys=group)[0].cpu()
    tolerance = 1e-4 if DEVICE == "cpu" else 2e-2
    assert float((got - want).abs().max()) <= tolerance * float(want.abs().max())


# ---------------------------------------------------------------------------------------------------------
# Prefill attention over a packed history


K4V2_G16 = KVarNFormat("kvarn_k4v2_g16", 4, 2, 16)  # a 16-token tile, to stay small


@dataclasses.dataclass
class PrefillCase:
    pool: dict  # the kernel's pool, format and window arguments
    tables: tuple[torch.Tensor, torch.Tensor]  # the row's block table and side table, int32 [tiles]
    chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v of the chunk's positions
    first: int  # the chunk's first position
    want: torch.Tensor  # the reference's output for the chunk, fp32


def prefill_case(fmt, heads, kv_heads, head_dim, sink, tail, first, new, dtype, seed=5) -> PrefillCase:
    """One row's history kept the reference way (cache/kvarn_pool.py), its blocks and side blocks shuffled in
    a poisoned pool (NaN scales and side rows wherever nothing was stored; block 0 and side block 0 unused):
    positions 0 .. first - 1 stored as one chunk, then `new` more as a chunk whose tiles are packed and rows
    kept before attention, as the Triton path does. A tile has a side block only where the pool needs one (the
    chunk begins inside it) or a query of the chunk reads one of its earlier positions in high precision, so
    a read of any other side row shows as NaN. The reference: attend_two_ways (fp32) by the per-query rule."""
    g, length = fmt.group, first + new
    tiles = math.ceil(length / g)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, n, head_dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    k = k * torch.exp(torch.randn(head_dim, generator=gen))  # channels of unlike spread
    q, k, v = (x.to(dtype).to(DEVICE) for x in (q, k, v))
    positions = torch.arange(length, device=DEVICE)
    hp = packed_attention.high_precision(positions[first:], positions, g, sink, tail)
    side_ids = (1 + torch.randperm(tiles, generator=gen)).tolist()
    read_before = [bool(hp[:, t * g:min(first, (t + 1) * g)].any()) for t in range(tiles)]
    side_table = [side_ids[t] if t * g < first < (t + 1) * g or read_before[t] else -1 for t in range(tiles)]
    table = (1 + torch.randperm(tiles, generator=gen)).to(torch.int32).to(DEVICE)
    pool = KVarNPool(fmt, SlotMap(1, 1), tiles + 1, kv_heads, head_dim, dtype, torch.device(DEVICE), sink,
                     tail, tiles + 1)
    for poisoned in (pool.key_scales, pool.value_scales, pool.side_keys, pool.side_values):
        poisoned.fill_(float("nan"))
    scale = head_dim ** -0.5
    packed_attention.attend_row_through_pool(pool, 0, side_table, table, 0, q[:first], k[:first], v[:first],
                                             scale)
    chunk = slice(first, length)
    pool.pack_filled(0, side_table, table, first, k[chunk], v[chunk])
    exact, packed = pool.read(0, side_table, table, first, k[chunk], v[chunk])
    want = packed_attention.attend_two_ways(q[chunk], exact, packed, first, hp, scale)
    pool.write_side(0, side_table, first, k[chunk], v[chunk])
    arguments = dict(key_codes=pool.key_codes[0], value_codes=pool.value_codes[0],
                     key_scales=pool.key_scales[0], value_scales=pool.value_scales[0],
                     side_k=pool.side_keys[0], side_v=pool.side_values[0], rotation=pool.rotation,
                     key_bits=fmt.key_bits, value_bits=fmt.value_bits, sink=sink, tail=tail, scale=scale)
    return PrefillCase(arguments, (table, torch.tensor(side_table, dtype=torch.int32, device=DEVICE)),
                       (q[chunk], k[chunk], v[chunk]), first, want)


def prefill(case: PrefillCase, block_m: int, before: int = 0, out: torch.Tensor | None = None):
    """The kernel over the case's chunk as row 1 of a step whose first `before` tokens are row 0's (a row
    with no history, left out of the work list): the step's output [before + new, heads, D]."""
    def step(x):
        return torch.cat([torch.zeros(before, *x.shape[1:], dtype=x.dtype, device=x.device), x])

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    new = case.chunk[0].shape[0]
    block_table, side_table = (torch.stack([torch.full_like(t, -1), t]) for t in case.tables)
    return kvarn_prefill(*map(step, case.chunk), **case.pool, block_tables=block_table,
                         side_tables=side_table, query_start_loc=ints([0, before, before + new]),
                         context_lens=ints([before, case.first + new]),
                         work=ints([[1, m0] for m0 in range(0, new, block_m)]), block_m=block_m, out=out)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest entry of |got - want| over the largest of |want|."""
    return float((got.float().cpu() - want.cpu()).abs().max()) / float(want.abs().max())


@pytest.mark.parametrize("sink,tail,first", [(8, 20, 40), (0, 0, 37), (16, 0, 48)])
def test_prefill_over_a_packed_history_matches_the_reference(sink, tail, first):
    """A chunk of 30 queries (two programs of 16, one part-filled) over a history stored the reference way,
    chunks that start inside a tile and on its edge, fp32 rows. The packed keys and values, q H and the
    softmax weights go through fp16 (steps of 2^-11, relative), so the output is within 2e-3 of its largest
    entry (seen: up to 6e-4)."""
    case = prefill_case(K4V2_G16, 4, 2, 32, sink, tail, first, 30, torch.float32)
    got = prefill(case, 16)
    assert got.dtype == torch.float32
    assert relative_error(got, case.want) <= 2e-3


def test_prefill_reads_high_precision_rows_exactly():
    """A tail longer than the history puts every position in high precision: only side rows and the chunk's
    own K/V are read, by fp32 dots for fp32 rows, and the output is the reference's to fp32 rounding,
    through both of the kernel's rotations of that share (into the packed tiles' basis and back, each in two
    fp16 parts against H's exact signs)."""
    case = prefill_case(K4V2_G16, 4, 2, 32, 0, 1000, 40, 30, torch.float32)
    assert relative_error(prefill(case, 16), case.want) <= 1e-5


@pytest.mark.parametrize("name,sink,tail", [("kvarn_k4v2_g64", 0, 0), ("kvarn_k4v4_g64", 16, 32),
                                            ("kvarn_k5v5_g64", 64, 16), ("kvarn_k4v2_g128", 0, 0)])
def test_prefill_of_bf16_rows_in_programs_of_128_queries(name, sink, tail):
    """The engine's configuration: bf16 rows, programs of 128 queries, pieces of 64 keys (two a tile at
    G = 128), a 4-bit, a 2-bit and a 5-bit plane (4 + 1). A 150-query chunk after 200 stored positions: the
    first program has pieces that every query reads packed (the unmasked path), the second is part-filled.
    The chunk is row 1 of its step, behind row 0's 3 tokens, and the output goes to a bf16 tensor: row 0's
    entries stay as they were, and each of the chunk's is within 2e-3 of the largest (fp16 operands, as
    above) and 2^-7 of itself (its bf16 rounding: 8 significant bits, truncated by the interpreter; a GPU
    rounds to nearest, within half that)."""
    case = prefill_case(parse_kv_cache_dtype(name), 4, 2, 32, sink, tail, 200, 150, torch.bfloat16)
    out = torch.full((153, 4, 32), 7.0, dtype=torch.bfloat16, device=DEVICE)
    assert prefill(case, 128, before=3, out=out) is out
    assert bool((out[:3] == 7.0).all())
    want = case.want.to(DEVICE)
    assert bool(((out[3:].float() - want).abs() <= 2 ** -7 * want.abs() + 2e-3 * want.abs().max()).all())


def test_prefill_refuses_what_it_cannot_read():
    case = prefill_case(K4V2_G16, 4, 2, 32, 0, 0, 16, 16, torch.float32)
    bad_rotation = dict(case.pool, rotation=case.pool["rotation"].double())
    with pytest.raises(ValueError, match="rotation must be a contiguous fp32"):
        prefill(dataclasses.replace(case, pool=bad_rotation), 16)
    with pytest.raises(ValueError, match="block_m one of 16, 32, 64, 128"):
        prefill(case, 48)
    with pytest.raises(ValueError, match="out must have q's shape"):
        prefill(case, 16, out=torch.zeros(16, 4, 16, device=DEVICE))


def test_rotate_is_the_codecs_hadamard_and_its_own_inverse():
    x = torch.randn(5, 2, 32, dtype=torch.float64)
    torch.testing.assert_close(rotate(x), x.float() @ kvarn.hadamard(32))
    torch.testing.assert_close(rotate(rotate(x)), x.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# CUDA, at Ouro-1.4B's attention shape (16 query heads, 16 kv heads, head_dim 128)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(KVARN_PRESETS))
def test_pack_matches_the_torch_codec_at_ouro_shape(name):
    key_bits, value_bits, group = KVARN_PRESETS[name]
    kv_heads, head_dim, num_tiles = 16, 128, 8
    # Rotated, as the engine packs them: the outlier channel spreads over all channels. (Unrotated, at 128
    # tokens, the normalization can push a tile's value token scales past fp16's range, where they clamp.)
    src_k = rotate(pack_source(num_tiles * group, kv_heads, head_dim, seed=1)).to(torch.bfloat16)
    src_v = rotate(pack_source(num_tiles * group, kv_heads, head_dim, seed=2)).to(torch.bfloat16)
    src_rows = torch.arange(num_tiles * group).view(num_tiles, group)
    dst_blocks = torch.arange(num_tiles, dtype=torch.int32)
    pool = empty_pool(num_tiles, kv_heads, group, head_dim, key_bits, value_bits)
    pack_tiles(src_k.to(DEVICE), src_v.to(DEVICE), src_rows.to(DEVICE), dst_blocks.to(DEVICE), *pool,
               key_bits, value_bits)
    pool = [t.cpu() for t in pool]
    for tile in range(num_tiles):
        got_keys = unpack_keys(pool[0], pool[2], tile, key_bits, head_dim)
        got_values = unpack_values(pool[1], pool[3], tile, value_bits, head_dim, group)
        x_k = src_k[src_rows[tile]].float().transpose(0, 1)
        x_v = src_v[src_rows[tile]].float().transpose(0, 1)
        keys, values = kvarn.quantize_keys(x_k, key_bits), kvarn.quantize_values(x_v, value_bits)
        for head in range(kv_heads):
            check_packed_tile(key_bits, value_bits, x_k[head], one_head(keys, head), one_head(got_keys, head),
                              x_v[head], one_head(values, head), one_head(got_values, head))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kvarn_k4v2_g64", "kvarn_k5v5_g64", "kvarn_k4v4_g128"])
def test_decode_at_ouro_shape_with_a_bf16_side_pool(name):
    key_bits, value_bits, group = KVARN_PRESETS[name]
    heads, kv_heads, head_dim, sink, tail = 16, 16, 128, 64, 64
    lengths = [1, 63, 64, 1000, 4096 + 17]
    inputs, reads = packed_history(lengths, kv_heads, head_dim, group, key_bits, value_bits, torch.bfloat16,
                                   sink, tail)
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(torch.bfloat16)
    out = kvarn_decode(q.to(DEVICE), **inputs, key_bits=key_bits, value_bits=value_bits, sink=sink, tail=tail)
    want = attend(q.float(), reads, head_dim ** -0.5)
    assert float((out.cpu() - want).abs().max()) <= 1e-3 * float(want.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("name,block_m", [("kvarn_k4v2_g64", 128), ("kvarn_k4v2_g64", 64),
                                          ("kvarn_k4v4_g64", 128), ("kvarn_k5v5_g64", 128),
                                          ("kvarn_k4v2_g128", 128)])
def test_prefill_at_ouro_shape_with_a_bf16_side_pool(name, block_m):
    """16 query heads, 16 kv heads, head_dim 128, sink 64 and tail 64, bf16 rows: a chunk of 300 queries after
    2,000 stored positions (pieces every query reads packed, then masked ones), in the engine's 128-query
    programs and in 64-query ones, against the reference. Within 2e-3 of the largest output entry, as on
    CPU (fp16 operands; there about 5e-4)."""
    case = prefill_case(parse_kv_cache_dtype(name), 16, 16, 128, 64, 64, 2000, 300, torch.bfloat16)
    assert relative_error(prefill(case, block_m), case.want) <= 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("first,new", [(40, 40), (80, 18), (64, 34)])
def test_prefill_at_the_tiny_models_shape_with_bf16_rows(first, new):
    """The engine test's shape (8 heads, 8 kv heads, head_dim 32, g64, sink 16, tail 32, bf16) in its chunks
    of 40 tokens, the prefill kernel alone. With its high-precision loop software-pipelined, Triton 3.6 on the
    H200 got this shape wrong (and the bf16 engine test's first tokens with it); unpipelined it passes
    (benchmarks/results/kvarn_kernels-2026-12-03-bfdee90.md, its gpu-tests section)."""
    case = prefill_case(parse_kv_cache_dtype("kvarn_k4v2_g64"), 8, 8, 32, 16, 32, first, new, torch.bfloat16)
    assert relative_error(prefill(case, 128), case.want) <= 2e-3
