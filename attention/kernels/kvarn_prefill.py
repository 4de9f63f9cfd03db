"""Prefill attention over a KVarN-packed history (arXiv 2606.03458): many queries per row, causal, each
query reading every key position either in high precision or through its packed tile, by KVarN's
per-query rule (attention/packed_attention.py: high_precision).

Query i at position P reads position p in high precision when p < sink or p >= (P + 1) - max(tail,
(P + 1) % G): the newest `tail` positions of its history and its own unfilled tile. Every other position it
reads lies in a full tile, which the caller has packed (this chunk's full tiles included) before attention.
High-precision values come from the side pool for positions before the chunk (side block
side_tables[row, p // G], offset p % G) and from the chunk's own k, v for the rest; both are unrotated, as
the model made them. Packed tiles are read in the rotated basis. So each program keeps two accumulators:
the high-precision share of the output, in the model's basis, and the packed share, rotated; the caller
adds the second rotated back (out = out + out_r H^T). Scores: q . k for high-precision keys, (q H) . (k H)
for packed ones.

The tile codec's layout and folded forms are attention/kernels/kvarn_decode.py's. The dots are fp32
(input_precision="ieee"): exact against the reference, not yet fast (no tensor-core path).
"""

import torch
import triton
import triton.language as tl

from attention.kernels.kvarn_decode import PLANE_WIDTHS, _unpack_codes
from attention.kernels.prefill import chunk_of_work_item

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


# The table strides (the step's longest tables) change per step: one compiled kernel for every value.
@triton.jit(do_not_specialize=["stride_bt", "stride_st"])
def kvarn_prefill_kernel(
    q_ptr, q_rot_ptr, k_ptr, v_ptr, out_ptr, out_rot_ptr,
    key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, side_k_ptr, side_v_ptr,
    block_tables_ptr, side_tables_ptr, query_start_loc_ptr, context_lens_ptr, work_ptr,
    sink, tail, scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_st,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, K_LOW_BITS: tl.constexpr, K_HIGH_BITS: tl.constexpr, V_LOW_BITS: tl.constexpr,
    V_HIGH_BITS: tl.constexpr,
):
    """Grid (work items, HEADS). Work item i = (row, m0): queries m0 .. m0 + BLOCK_M - 1 of the row's chunk.
    q [N, HEADS, D] unrotated and q_rot = q H (the same strides); k, v [N, KV_HEADS, D] the step's new K/V;
    out and out_rot fp32 [N, HEADS, D], contiguous. Pool tensors: one slot's, contiguous."""
    head = tl.program_id(1)
    row, m0, token0, query_len, context_len = chunk_of_work_item(work_ptr, query_start_loc_ptr,
                                                                 context_lens_ptr)
    first = context_len - query_len  # the chunk's first position
    kv_head = head // (HEADS // KV_HEADS)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_g = tl.arange(0, TILE)
    mask_m = offs_m < query_len
    tokens = (token0 + offs_m).to(tl.int64)
    q_offsets = tokens[:, None] * stride_qn + head * stride_qh + offs_d[None, :]
    qk_scale = scale * LOG2E
    q = tl.load(q_ptr + q_offsets, mask=mask_m[:, None], other=0.0).to(tl.float32) * qk_scale
    q_rot = tl.load(q_rot_ptr + q_offsets, mask=mask_m[:, None], other=0.0).to(tl.float32) * qk_scale
    query_pos = first + offs_m
    window = query_pos + 1 - tl.maximum(tail, (query_pos + 1) % TILE)  # high precision from here on

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc_rot = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    blocks = block_tables_ptr + row.to(tl.int64) * stride_bt
    side_blocks = side_tables_ptr + row.to(tl.int64) * stride_st
    key_end = tl.minimum(context_len, first + m0 + BLOCK_M)
    packed_end = context_len // TILE * TILE  # tiles below are packed
    for t0 in range(0, key_end, TILE):
        tile = t0 // TILE
        positions = t0 + offs_g
        in_range = positions < key_end
        # High-precision rows: before the chunk from the tile's side block, from the chunk's k, v after.
        from_side = in_range & (positions < first)
        from_new = in_range & (positions >= first)
        side_block = tl.maximum(tl.load(side_blocks + tile), 0).to(tl.int64)
        side_rows = ((side_block * TILE + offs_g) * KV_HEADS + kv_head) * HEAD_DIM
        new_rows = (token0 + positions - first).to(tl.int64)
        k_exact = (tl.load(side_k_ptr + side_rows[:, None] + offs_d[None, :], mask=from_side[:, None],
                           other=0.0).to(tl.float32)
                   + tl.load(k_ptr + new_rows[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
                             mask=from_new[:, None], other=0.0).to(tl.float32))
        v_exact = (tl.load(side_v_ptr + side_rows[:, None] + offs_d[None, :], mask=from_side[:, None],
                           other=0.0).to(tl.float32)
                   + tl.load(v_ptr + new_rows[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
                             mask=from_new[:, None], other=0.0).to(tl.float32))
        high = (positions[None, :] < sink) | (positions[None, :] >= window[:, None])
        visible = (positions[None, :] <= query_pos[:, None]) & in_range[None, :] & mask_m[:, None]
        s = _dot(q, tl.trans(k_exact))
        packed = t0 + TILE <= packed_end
        # A tile without a block (-1) is never dereferenced; clamping keeps even its address in the pool.
        slot = tl.maximum(tl.load(blocks + tile), 0).to(tl.int64) * KV_HEADS + kv_head
        if packed:  # dequantize the tile in registers (the folded forms of the codec)
            key_scales = key_scales_ptr + slot * (2 * HEAD_DIM + TILE)
            key_codes = _unpack_codes(key_codes_ptr + slot * (TILE * HEAD_DIM * (K_LOW_BITS + K_HIGH_BITS)
                                                              // 8),
                                      offs_g, K_LOW_BITS, K_HIGH_BITS, TILE, HEAD_DIM)
            k_packed = tl.load(key_scales + 2 * HEAD_DIM + offs_g).to(tl.float32)[:, None] * (
                key_codes * tl.load(key_scales + offs_d).to(tl.float32)[None, :]
                + tl.load(key_scales + HEAD_DIM + offs_d).to(tl.float32)[None, :])
            s = tl.where(high, s, _dot(q_rot, tl.trans(k_packed)))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query row with nothing visible yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(tl.where(high, p, 0.0), v_exact)
        acc_rot = acc_rot * alpha[:, None]
        if packed:
            value_scales = value_scales_ptr + slot * (HEAD_DIM + 2 * TILE)
            value_codes = _unpack_codes(
                value_codes_ptr + slot * (TILE * HEAD_DIM * (V_LOW_BITS + V_HIGH_BITS) // 8), offs_g,
                V_LOW_BITS, V_HIGH_BITS, TILE, HEAD_DIM)
            v_packed = tl.load(value_scales + offs_d).to(tl.float32)[None, :] * (
                value_codes * tl.load(value_scales + HEAD_DIM + offs_g).to(tl.float32)[:, None]
                + tl.load(value_scales + HEAD_DIM + TILE + offs_g).to(tl.float32)[:, None])
            acc_rot += _dot(tl.where(high, 0.0, p), v_packed)
        m_i = m_new

    norm = tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = tokens[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :]
    tl.store(out_ptr + out_offsets, acc / norm, mask=mask_m[:, None])
    tl.store(out_rot_ptr + out_offsets, acc_rot / norm, mask=mask_m[:, None])


def kvarn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_codes: torch.Tensor,
                  value_codes: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor,
                  side_k: torch.Tensor, side_v: torch.Tensor, block_tables: torch.Tensor,
                  side_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                  work: torch.Tensor, key_bits: int, value_bits: int, rotation: torch.Tensor, sink: int = 0,
                  tail: int = 0, scale: float | None = None, block_m: int = 16) -> torch.Tensor:
    """Causal attention of the new tokens of the rows in `work` over their packed histories: the unrotated
    output, fp32 [N, heads, D] (zero at tokens of other rows).

    q [N, heads, D] (unrotated), k, v [N, kv_heads, D]: the step's new tokens, row after row (rows own
    query_start_loc[r]:query_start_loc[r+1]); their K/V must already be stored: the tiles they complete
    packed, as kvarn_decode's pool layout holds them (one slot's tensors, contiguous). block_tables,
    side_tables int32 [rows, blocks]; context_lens int32 [rows]; work int32 [items, 2]: (row, first query),
    block_m queries each. rotation: H, D x D fp32."""
    query = q.float().contiguous()
    query_rot = query @ rotation
    exact, rotated = torch.zeros_like(query), torch.zeros_like(query)
    if work.shape[0] == 0:
        return exact
    heads, head_dim = q.shape[1:]
    (k_low, k_high), (v_low, v_high) = PLANE_WIDTHS[key_bits], PLANE_WIDTHS[value_bits]
    kvarn_prefill_kernel[(work.shape[0], heads)](
        query, query_rot, k, v, exact, rotated, key_codes, value_codes, key_scales, value_scales, side_k,
        side_v, block_tables, side_tables, query_start_loc, context_lens, work, sink, tail,
        head_dim ** -0.5 if scale is None else scale, query.stride(0), query.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), block_tables.stride(0), side_tables.stride(0),
        heads, key_codes.shape[1], head_dim, key_codes.shape[2], block_m, k_low, k_high, v_low, v_high,
        num_warps=4)
    return exact + rotated @ rotation.T
