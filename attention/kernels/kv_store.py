"""Writes new tokens' K and V into one slot's pages through the slot mapping, in one launch."""

import triton
import triton.language as tl

from triton_runtime.pdl import launch_dependents, wait_for_previous

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def round_to_e4m3(x):
    """fp32 x, |x| <= 448, rounded to the nearest e4m3 value (ties to even), still fp32: the cast that
    follows is then exact. Done in arithmetic because the interpreter's fp32 -> fp8 cast drops the carry
    into the exponent (0.123 gives 0.0625); on the GPU the hardware cast agrees. The spacing of x's binade is
    2^(e - 3) for biased exponent e, and 2^-9 below 2^-6 (subnormals); x / spacing is below 16 in magnitude,
    and adding and subtracting 1.5 * 2^23 rounds it to an integer, half to even. A negative that rounds to
    zero gives +0 where torch's cast gives -0: the same value, another byte."""
    exponent = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    spacing = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    inverse = ((257 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / spacing, exactly
    return ((x * inverse + 12582912.0) - 12582912.0) * spacing


@triton.jit
def encode_kv(x, scale, QUANTIZED: tl.constexpr, cache_dtype: tl.constexpr):
    """K or V as the cache stores it: with QUANTIZED (an fp8 pool, attention/fp8.py) the round to nearest
    of clamp(x / scale, +-448), with an IEEE division, so every backend stores the same values; otherwise a
    cast."""
    if QUANTIZED:
        x = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
        return round_to_e4m3(x).to(cache_dtype)
    else:
        return x.to(cache_dtype)


@triton.jit
def kv_store_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, scales_ptr, slot_mapping_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    QUANTIZED: tl.constexpr, PDL: tl.constexpr,
):
    """One program per new token: all its kv heads. The cache plane is [blocks, block_size, kv_heads, D]
    contiguous, so `slot * kv_heads * D` addresses the token; it is 64-bit because a large pool exceeds
    2^31 elements. A slot of -1 (a generated token under kv_sharing="last", in no per-loop plane) is
    skipped: the decode kernel stores it. A head is BLOCK_D = next_power_of_2(HEAD_DIM) lanes, masked to
    HEAD_DIM where wider. With QUANTIZED, scales_ptr holds the slot's fp8 key scales then
    value scales, one per kv head. With PDL (triton_runtime/pdl.py) the slot mapping and the scales, which no
    kernel of the step writes, are read before the wait for the previous kernel; k and v after it."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (tl.zeros([BLOCK_H, 1], tl.int64) + slot >= 0)
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d < HEAD_DIM)[None, :]
    dst = slot * (KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k_scale, v_scale = 1.0, 1.0
    if QUANTIZED:
        k_scale = tl.load(scales_ptr + offs_h, mask=offs_h < KV_HEADS, other=1.0)[:, None]
        v_scale = tl.load(scales_ptr + KV_HEADS + offs_h, mask=offs_h < KV_HEADS, other=1.0)[:, None]
    wait_for_previous(PDL)
    launch_dependents(PDL)
    k = tl.load(k_ptr + token * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, encode_kv(k, k_scale, QUANTIZED, key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, encode_kv(v, v_scale, QUANTIZED, value_cache_ptr.dtype.element_ty),
             mask=mask)
