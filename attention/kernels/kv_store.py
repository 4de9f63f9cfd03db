"""Writes new tokens' K and V into one slot's pages through the slot mapping, in one launch."""

import triton
import triton.language as tl


@triton.jit
def kv_store_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program per new token: all its kv heads. The cache plane is [blocks, block_size, kv_heads, D]
    contiguous, so `slot * kv_heads * D` addresses the token; it is 64-bit because a large pool exceeds
    2^31 elements. A slot of -1 (a generated token under kv_sharing="last", in no per-loop plane) is
    skipped: the decode kernel stores it."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < KV_HEADS)[:, None] & (tl.zeros([BLOCK_H, 1], tl.int64) + slot >= 0)
    dst = slot * (KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)
