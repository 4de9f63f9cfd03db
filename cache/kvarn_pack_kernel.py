"""Packing KVarN tiles in Triton (arXiv 2606.03458): rotated K/V rows in, a pool block's bit-plane codes and
fp16 scales out, with the arithmetic of the plain-torch codec (cache/kvarn.py: quantize_keys,
quantize_values, pack_codes), which is the reference these kernels are tested against.

One program quantizes one (tile, kv head): its G key rows and G value rows, gathered through a row-index
table from a source viewed as [rows, kv_heads, D] (a side block, or a chunk's new K/V), and rotated by the
Hadamard matrix first: either by the caller (`rotate`; the source is rotated already) or in the kernel
(`pack_tiles(..., rotation=H)`, an fp32 dot: the engine's side blocks, which hold unrotated rows). A tile
whose pool block is negative is skipped, so a captured CUDA graph can pack a fixed list of candidates of
which only some completed their tile in the step being replayed.

Pool layout of one (loop, layer) slot, NB blocks:
    key_codes    uint8 [NB, KVH, G, D * key_bits / 8]    a token row's bit planes, in kvarn.PLANES order
    value_codes  uint8 [NB, KVH, G, D * value_bits / 8]  (5 bits: 40-bit columns, kvarn.record_codes)
    key_scales   fp16  [NB, KVH, 2 D + G]    channel scale [D], channel zero [D], token scale [G]
    value_scales fp16  [NB, KVH, D + 2 G]    channel scale [D], token scale [G], token zero [G]

Floating order differs from torch (reductions, exp and log), so a scale can land one fp16 step away from the
reference's and a code that sits on a rounding boundary one step away; rounding itself is half-to-even, as
torch.round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cache import kvarn
from cache.kv_format import check_tile_dims
from triton_runtime.kvarn_record import high_byte_offset

FP16_MAX = tl.constexpr(kvarn.FP16_MAX)


def plane_widths(bits: int) -> tuple[int, int]:
    """(low plane width, high plane width or 0) of `bits`-bit codes, from kvarn.PLANES."""
    if bits not in kvarn.PLANES:
        raise ValueError(f"codes of {bits} bits do not pack; supported: {sorted(kvarn.PLANES)}")
    widths = kvarn.PLANES[bits]
    return widths[0], widths[1] if len(widths) > 1 else 0


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the orthonormal Hadamard matrix H (symmetric, so this also rotates back), in fp32."""
    return x.float() @ kvarn.hadamard(x.shape[-1], device=x.device)


@triton.jit
def _div(a, b):
    """a / b rounded to nearest as torch divides; `/` on fp32 may be approximate (NVIDIA: div.full.f32)."""
    return tl.math.div_rn(a, b)


@triton.jit
def _centred_std(x, AXIS: tl.constexpr, COUNT: tl.constexpr):
    """kvarn.centred_std along AXIS (COUNT elements): the mean first, then the mean squared deviation."""
    deviation = x - tl.expand_dims(_div(tl.sum(x, AXIS), COUNT * 1.0), AXIS)
    return tl.sqrt_rn(_div(tl.sum(deviation * deviation, AXIS), COUNT * 1.0))


@triton.jit
def _imbalance(n, G: tl.constexpr, D: tl.constexpr):
    """The largest over the smallest of n's row and column stds."""
    rows = _centred_std(n, 1, D)
    columns = _centred_std(n, 0, G)
    largest = tl.maximum(tl.max(rows, 0), tl.max(columns, 0))
    smallest = tl.minimum(tl.min(rows, 0), tl.min(columns, 0))
    return _div(largest, tl.maximum(smallest, 1e-30))


@triton.jit
def _normalized(x, log_r, log_c):
    return x * tl.exp(-log_r)[:, None] * tl.exp(-log_c)[None, :]


@triton.jit
def _sinkhorn(x, G: tl.constexpr, D: tl.constexpr, ITERATIONS: tl.constexpr):
    """kvarn.sinkhorn_normalize of one tile x [G, D]: (log r [G], log c [D]) of the best-balanced iterate."""
    deviation = x - _div(tl.sum(tl.sum(x, 1), 0), G * D * 1.0)
    floor = tl.maximum(tl.sqrt_rn(_div(tl.sum(tl.sum(deviation * deviation, 1), 0), G * D * 1.0)), 1e-30)
    std_min, std_max = floor * 1e-3, floor * 1e3
    log_r = tl.zeros([G], tl.float32)
    log_c = tl.zeros([D], tl.float32)
    best = _imbalance(x, G, D)
    best_r, best_c = log_r, log_c
    for _ in range(ITERATIONS):
        column_std = _centred_std(_normalized(x, log_r, log_c), 0, G)
        log_c = log_c + tl.log(tl.minimum(tl.maximum(column_std, std_min), std_max))
        row_std = _centred_std(_normalized(x, log_r, log_c), 1, D)
        log_r = log_r + tl.log(tl.minimum(tl.maximum(row_std, std_min), std_max))
        score = _imbalance(_normalized(x, log_r, log_c), G, D)
        better = score < best
        best = tl.where(better, score, best)
        best_r = tl.where(better, log_r, best_r)
        best_c = tl.where(better, log_c, best_c)
    return best_r, best_c


@triton.jit
def _fp16(x):
    """x as stored: clamped to fp16's finite range, rounded to fp16 (to nearest even), back in fp32."""
    return tl.minimum(tl.maximum(x, -FP16_MAX), FP16_MAX).to(tl.float16).to(tl.float32)


@triton.jit
def _round_half_even(y):
    """torch.round: to the nearest integer, ties to even (exact in fp32: floor and the fraction are)."""
    down = tl.floor(y)
    fraction = y - down
    odd = (down - 2.0 * tl.floor(down * 0.5)) != 0
    return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), down + 1.0, down)


@triton.jit
def _codes(y, scale, zero, LEVELS: tl.constexpr):
    """kvarn._codes: round((y - zero) / scale) in [0, LEVELS], int32; a zero scale gives code 0 (and so does
    a NaN, which only a degenerate tile produces)."""
    safe = tl.where(scale == 0, 1.0, scale)
    code = _round_half_even(_div(y - zero, safe))
    code = tl.where(code == code, code, 0.0)
    return tl.minimum(tl.maximum(code, 0.0), LEVELS).to(tl.int32)


@triton.jit
def _store_plane(codes, row_ptr, offs_g, ROW_BYTES: tl.constexpr, FIRST_BYTE: tl.constexpr,
                 WIDTH: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """codes [G, D] (their low WIDTH bits) as one bit plane: value j of a byte in bits j * WIDTH on."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    part = tl.reshape(codes & ((1 << WIDTH) - 1), [G, D // PER_BYTE, PER_BYTE])
    shifts = tl.arange(0, PER_BYTE) * WIDTH
    packed = tl.sum(part << shifts[None, None, :], 2)
    offs_b = tl.arange(0, D // PER_BYTE)
    tl.store(row_ptr + offs_g[:, None] * ROW_BYTES + FIRST_BYTE + offs_b[None, :], packed.to(tl.uint8))


@triton.jit
def _store_codes(codes, tile_ptr, offs_g, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr,
                 G: tl.constexpr, D: tl.constexpr):
    """A tile's codes [G, D] into its rows of planes: the low plane, then (if HIGH_BITS) the high one; 5-bit
    codes as 40-bit columns (_store_five_bit_columns)."""
    ROW_BYTES: tl.constexpr = D * (LOW_BITS + HIGH_BITS) // 8
    if (LOW_BITS == 4) and (HIGH_BITS == 1):
        _store_five_bit_columns(codes, tile_ptr, offs_g, G, D)
    else:
        _store_plane(codes, tile_ptr, offs_g, ROW_BYTES, 0, LOW_BITS, G, D)
        if HIGH_BITS > 0:
            _store_plane(codes >> LOW_BITS, tile_ptr, offs_g, ROW_BYTES, D * LOW_BITS // 8, HIGH_BITS, G, D)


@triton.jit
def _store_five_bit_columns(codes, tile_ptr, offs_g, G: tl.constexpr, D: tl.constexpr):
    """5-bit codes [G, D] as kvarn.record_codes lays them out: each column of 8 a 40-bit integer (code k at
    bit 5k); every row's low 4 bytes of its columns first, then the high bytes (high_byte_offset)."""
    part = tl.reshape(codes.to(tl.int64), [G, D // 8, 8])
    column = tl.sum(part << (tl.arange(0, 8) * 5)[None, None, :], 2)  # [G, D / 8]
    offs_c = tl.arange(0, D // 8)
    low = (column[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 255
    low_ptrs = (tile_ptr + offs_g[:, None, None] * (D // 2) + offs_c[None, :, None] * 4
                + tl.arange(0, 4)[None, None, :])
    tl.store(low_ptrs, low.to(tl.uint8))
    tl.store(tile_ptr + high_byte_offset(offs_g[:, None], offs_c[None, :], G, D), (column >> 32).to(tl.uint8))


@triton.jit
def _load_tile(src_ptr, rows_ptr, tile, kv_head, stride_row, stride_head, offs_g, offs_d, rotation,
               G: tl.constexpr, ROTATE: tl.constexpr):
    """The tile's G rows of kv head kv_head, fp32 [G, D], times the rotation when ROTATE (plain fp32 FMAs,
    "ieee": no TF32 rounding of the rows)."""
    rows = tl.load(rows_ptr + tile * G + offs_g)  # int64
    ptrs = src_ptr + rows[:, None] * stride_row + kv_head * stride_head + offs_d[None, :]
    x = tl.load(ptrs).to(tl.float32)
    if ROTATE:
        x = tl.dot(x, rotation, input_precision="ieee")
    return x


@triton.jit
def kvarn_pack_kernel(
    src_k_ptr, src_v_ptr, src_rows_ptr, dst_blocks_ptr, rotation_ptr,
    key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr,
    stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    KV_HEADS: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    K_LOW_BITS: tl.constexpr, K_HIGH_BITS: tl.constexpr, V_LOW_BITS: tl.constexpr, V_HIGH_BITS: tl.constexpr,
    ITERATIONS: tl.constexpr, ROTATE: tl.constexpr,
):
    """Grid (tiles, KV_HEADS). Program (t, h) quantizes the rows src_rows[t, :] of kv head h, keys then
    values, into block dst_blocks[t], or does nothing where that is negative. With ROTATE the rows are
    rotated by rotation_ptr's fp32 [D, D] matrix first (not read otherwise). The pool tensors are
    contiguous; block offsets are 64-bit."""
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    block = tl.load(dst_blocks_ptr + tile)
    if block < 0:
        return
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, D)
    slot = block.to(tl.int64) * KV_HEADS + kv_head
    rotation = tl.zeros([D, D], tl.float32)
    if ROTATE:
        rotation = tl.load(rotation_ptr + offs_d[:, None] * D + offs_d[None, :])

    # Keys: per-channel scale s and zero z of the token-normalized tile, per-token scale r.
    KEY_LEVELS: tl.constexpr = (1 << (K_LOW_BITS + K_HIGH_BITS)) - 1
    x = _load_tile(src_k_ptr, src_rows_ptr, tile, kv_head, stride_k_row, stride_k_head, offs_g, offs_d,
                   rotation, G, ROTATE)
    log_r, log_c = _sinkhorn(x, G, D, ITERATIONS)
    token_scale = _fp16(tl.exp(log_r))
    channel = tl.exp(log_c)
    x = _div(x, token_scale[:, None])
    n = _div(x, channel[None, :])
    low, high = tl.min(n, 0), tl.max(n, 0)
    channel_scale = _fp16(_div(channel * (high - low), KEY_LEVELS * 1.0))
    channel_zero = _fp16(channel * low)
    codes = _codes(x, channel_scale[None, :], channel_zero[None, :], KEY_LEVELS)
    KEY_ROW_BYTES: tl.constexpr = D * (K_LOW_BITS + K_HIGH_BITS) // 8
    _store_codes(codes, key_codes_ptr + slot * (G * KEY_ROW_BYTES), offs_g, K_LOW_BITS, K_HIGH_BITS, G, D)
    scales = key_scales_ptr + slot * (2 * D + G)
    tl.store(scales + offs_d, channel_scale.to(tl.float16))
    tl.store(scales + D + offs_d, channel_zero.to(tl.float16))
    tl.store(scales + 2 * D + offs_g, token_scale.to(tl.float16))

    # Values: per-token scale t and zero u of the channel-normalized tile, per-channel scale c.
    VALUE_LEVELS: tl.constexpr = (1 << (V_LOW_BITS + V_HIGH_BITS)) - 1
    x = _load_tile(src_v_ptr, src_rows_ptr, tile, kv_head, stride_v_row, stride_v_head, offs_g, offs_d,
                   rotation, G, ROTATE)
    log_r, log_c = _sinkhorn(x, G, D, ITERATIONS)
    channel_scale = _fp16(tl.exp(log_c))
    token = tl.exp(log_r)
    n = _div(_div(x, token[:, None]), channel_scale[None, :])
    low, high = tl.min(n, 1), tl.max(n, 1)
    token_scale = _fp16(_div(token * (high - low), VALUE_LEVELS * 1.0))
    token_zero = _fp16(token * low)
    codes = _codes(_div(x, channel_scale[None, :]), token_scale[:, None], token_zero[:, None], VALUE_LEVELS)
    VALUE_ROW_BYTES: tl.constexpr = D * (V_LOW_BITS + V_HIGH_BITS) // 8
    _store_codes(codes, value_codes_ptr + slot * (G * VALUE_ROW_BYTES), offs_g, V_LOW_BITS, V_HIGH_BITS, G,
                 D)
    scales = value_scales_ptr + slot * (D + 2 * G)
    tl.store(scales + offs_d, channel_scale.to(tl.float16))
    tl.store(scales + D + offs_g, token_scale.to(tl.float16))
    tl.store(scales + D + G + offs_g, token_zero.to(tl.float16))


def pack_tiles(src_k: torch.Tensor, src_v: torch.Tensor, src_rows: torch.Tensor, dst_blocks: torch.Tensor,
               key_codes: torch.Tensor, value_codes: torch.Tensor, key_scales: torch.Tensor,
               value_scales: torch.Tensor, key_bits: int, value_bits: int, iterations: int = 8,
               num_warps: int | None = None, rotation: torch.Tensor | None = None) -> None:
    """Quantize and pack num_tiles tiles of every kv head in one launch.

    src_k, src_v: K and V viewed as [rows, kv_heads, D] (any float dtype; the last dim contiguous), rotated
    already, or unrotated with `rotation` (fp32 [D, D], contiguous: the kernel rotates them).
    src_rows: int64 [num_tiles, G], the source rows of each tile's tokens, in order.
    dst_blocks: int32 [num_tiles], the pool block each tile goes to (a negative one: the tile is skipped).
    key_codes, value_codes, key_scales, value_scales: one slot's pool tensors (module docstring), contiguous.
    """
    num_blocks, kv_heads, group = key_codes.shape[:3]
    head_dim = src_k.shape[-1]
    check_tile_dims(group, head_dim)
    k_low, k_high = plane_widths(key_bits)
    v_low, v_high = plane_widths(value_bits)
    expected = {
        "key_codes": (key_codes, (num_blocks, kv_heads, group, head_dim * key_bits // 8), torch.uint8),
        "value_codes": (value_codes, (num_blocks, kv_heads, group, head_dim * value_bits // 8), torch.uint8),
        "key_scales": (key_scales, (num_blocks, kv_heads, 2 * head_dim + group), torch.float16),
        "value_scales": (value_scales, (num_blocks, kv_heads, head_dim + 2 * group), torch.float16),
    }
    for name, (tensor, shape, dtype) in expected.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {list(shape)}, got "
                             f"{tensor.dtype} {list(tensor.shape)}")
    for name, src in (("src_k", src_k), ("src_v", src_v)):
        if src.dim() != 3 or src.shape[1:] != (kv_heads, head_dim) or src.stride(2) != 1:
            raise ValueError(f"{name} must be [rows, {kv_heads}, {head_dim}] with a contiguous last dim, got "
                             f"{list(src.shape)}")
    num_tiles = dst_blocks.shape[0]
    if (src_rows.shape != (num_tiles, group) or src_rows.dtype != torch.int64
            or dst_blocks.dtype != torch.int32):
        raise ValueError(f"src_rows must be int64 [{num_tiles}, {group}] and dst_blocks int32 [{num_tiles}]")
    if rotation is not None and (rotation.shape != (head_dim, head_dim) or rotation.dtype != torch.float32
                                 or not rotation.is_contiguous()):
        raise ValueError(f"rotation must be a contiguous fp32 [{head_dim}, {head_dim}] matrix, got "
                         f"{rotation.dtype} {list(rotation.shape)}")
    if num_tiles == 0:
        return
    if num_warps is None:  # a [G, D] fp32 tile in registers: about 32 values per thread
        num_warps = max(4, min(16, group * head_dim // 1024))
    kvarn_pack_kernel[(num_tiles, kv_heads)](
        src_k, src_v, src_rows.contiguous(), dst_blocks.contiguous(),
        rotation if rotation is not None else dst_blocks,
        key_codes, value_codes, key_scales, value_scales,
        src_k.stride(0), src_k.stride(1), src_v.stride(0), src_v.stride(1),
        kv_heads, group, head_dim, k_low, k_high, v_low, v_high, iterations, rotation is not None,
        num_warps=num_warps,
    )
