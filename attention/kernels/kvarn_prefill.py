"""Prefill attention over a KVarN-packed history (arXiv 2606.03458) on tensor cores: many queries per row,
causal, each query reading every key position either in high precision or through its packed tile, by
KVarN's per-query rule (attention/packed_attention.py: high_precision).

Query i at position P reads position p in high precision when p < sink or p >= (P + 1) - max(tail,
(P + 1) % G): the newest `tail` positions of its history and its own unfilled tile. Every other position it
reads lies in a full tile, which the caller has packed (this chunk's full tiles included) before attention.
High-precision values come from the side pool for positions before the chunk (side block
side_tables[row, p // G], offset p % G) and from the chunk's own k, v for the rest; both are unrotated, as
the model made them, and score with the unrotated query q. Packed tiles hold rotated keys and values
(x H) and score with q H.

A program takes BLOCK_M queries through the keys 64 at a time (a piece; a whole tile when G < 64). Masked
pieces (below the sink, or past the first query's window: near the diagonal) come first, twice: their
high-precision keys, in the model's basis, in their own online softmax; then that share of the output is
rotated into the packed basis (x H) and becomes the one accumulator, which the masked pieces' packed keys
and then the other pieces join. Those others lie between the sink and every query's window, so every
query reads them packed: no masks (the fast path, and the bulk of a long history). The accumulator is
rotated back (x H^T) once, at the end. One [BLOCK_M, D] accumulator at a time, not two, is what keeps the
kernel within the register file (sm_90, BLOCK_M 128, 8 warps: 250 to 255 registers, no spills).

A piece's codes come out of their bit planes in registers (decode's in-place unpacking: mask, or into the
bits of 2^23, subtract 2^23) and are dequantized in fp32 with every scale (the codec's K = r_i (code_ij s_j
+ z_j), V = c_j (code_ij t_i + u_i)), then rounded once to fp16 for tl.dot, which accumulates in fp32. The
decode kernel folds the scales into its one query instead; here a piece's codes serve BLOCK_M queries, so
scaling the code tile (64 x D products a piece) costs less than scaling the queries' side (BLOCK_M x D a
piece, and as much again for a per-tile channel scale on the output).

fp16 rather than bf16: 11 significant bits against 8, so each rounding is 8 times smaller, and the range
suffices: every fp16 operand is a key, a value, the scaled q H or a softmax weight, each below 65504 for a
model whose K/V fit fp16 (beyond it they would turn inf and NaN, not wrong quietly). High-precision rows go
through fp16 dots when 16-bit (bf16 widens to fp16 exactly in that range: exact products, as the
reference's fp32; the weights p are rounded to fp16) and through fp32 ("ieee") dots when fp32. The
rotations use H's entries, +-D^-1/2, as exact fp16 signs, with the rotated operand split into two fp16
parts: fp32-accurate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.kvarn_decode import MAGIC, PLANE_WIDTHS, _column, _lane_code, _top_part, lane_shift
from attention.kernels.prefill import chunk_of_work_item
from triton_runtime.kvarn_record import high_byte_offset

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _plane_columns(tile_ptr, rows, one, ROW_BYTES: tl.constexpr, FIRST_BYTE: tl.constexpr,
                   WIDTH: tl.constexpr, D: tl.constexpr):
    """One bit plane's columns (decode's layout: a column is 8 codes of a row, channels 8c .. 8c + 7, one
    element of the plane) of the tile rows `rows` [N]: uint32 [N, D / 8], each read whole where the plane's
    rows hold whole elements. one: 1, hidden from the compiler (the kernel says why)."""
    cols = tl.arange(0, D // 8) * one
    return _column(tile_ptr + FIRST_BYTE + rows[:, None] * ROW_BYTES + cols[None, :] * WIDTH, ROW_BYTES,
                   FIRST_BYTE, WIDTH)


@triton.jit
def _channel_lanes(ptr, D: tl.constexpr):
    """An fp16 per-channel vector [D] at ptr as 8 fp32 tensors [1, D / 8], lane k holding channels 8c + k
    (decode's _lanes, on a row)."""
    x = tl.load(ptr + tl.arange(0, D // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, [D // 8, 2, 2, 2]))  # lane k = 4 * i + 2 * j + l at [c, i, j, l]
    even_0, even_1 = tl.split(even)
    odd_0, odd_1 = tl.split(odd)
    x0, x4 = tl.split(even_0)
    x2, x6 = tl.split(even_1)
    x1, x5 = tl.split(odd_0)
    x3, x7 = tl.split(odd_1)
    return (x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :], x6[None, :],
            x7[None, :])


@triton.jit
def _join_lanes(x0, x1, x2, x3, x4, x5, x6, x7):
    """8 tensors [N, D / 8] as one [N, D], x_k at channels 8c + k (_channel_lanes' inverse, on tiles)."""
    x = tl.join(tl.join(tl.join(x0, x4), tl.join(x2, x6)), tl.join(tl.join(x1, x5), tl.join(x3, x7)))
    return tl.reshape(x, [x0.shape[0], x0.shape[1] * 8])


@triton.jit
def _unit(k: tl.constexpr, WIDTH: tl.constexpr, FACTOR: tl.constexpr):
    """FACTOR / 2^lane_shift(k, WIDTH): what undoes _lane_code's shift of lane k (a power of two)."""
    return FACTOR / (1 << lane_shift(k, WIDTH))


@triton.jit
def _lane(low, high, magic, scale, offset, outer, k: tl.constexpr, LOW_BITS: tl.constexpr,
          HIGH_BITS: tl.constexpr):
    """Lane k of a tile (channels 8c + k) dequantized, fp16 [N, D / 8]: (code scale + offset) outer in fp32,
    the code from the low plane's columns and the high plane's, if any (each a triple for _lane_code: the
    columns, the columns >> 12, and for 5-bit codes, read whole from `low`, their _top_part). Keys: scale
    and offset per channel, outer per token; values the other way round."""
    FIVE: tl.constexpr = (LOW_BITS == 4) and (HIGH_BITS == 1)
    WIDTH: tl.constexpr = 5 if FIVE else LOW_BITS  # the width the low plane's columns are read at
    x = _lane_code(low[0], low[1], low[2], magic, k, WIDTH) * (scale * _unit(k, WIDTH, 1.0)) + offset
    if HIGH_BITS > 0 and not FIVE:
        x += (_lane_code(high[0], high[1], high[2], magic, k, HIGH_BITS)
              * (scale * _unit(k, HIGH_BITS, 1 << LOW_BITS)))
    return (x * outer).to(tl.float16)


@triton.jit
def _dequantize(tile_ptr, rows, one, magic, scale, offset, outer, D: tl.constexpr, G: tl.constexpr,
                LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr):
    """Rows `rows` of a packed tile's codes (of G rows) at tile_ptr, dequantized: fp16 [N, D], each
    (code_ij scale + offset) outer, computed in fp32 and rounded once. Per-channel factors come as 8 lanes
    (_channel_lanes), per-token ones as [N, 1]; either way each of scale, offset and outer is indexed
    [k] by lane."""
    ROW_BYTES: tl.constexpr = D * (LOW_BITS + HIGH_BITS) // 8
    if (LOW_BITS == 4) and (HIGH_BITS == 1):  # 40-bit columns (kvarn.record_codes)
        columns = _plane_columns(tile_ptr, rows, one, D // 2, 0, 4, D)
        high_at = high_byte_offset(rows[:, None], tl.arange(0, D // 8)[None, :] * one, G, D)
        low = (columns, columns >> 12, _top_part(columns, tl.load(tile_ptr + high_at).to(tl.uint32)))
        high = low
    elif HIGH_BITS > 0:
        columns = _plane_columns(tile_ptr, rows, one, ROW_BYTES, 0, LOW_BITS, D)
        high_columns = _plane_columns(tile_ptr, rows, one, ROW_BYTES, D * LOW_BITS // 8, HIGH_BITS, D)
        high = (high_columns, high_columns >> 12, high_columns)
        low = (columns, columns >> 12, columns)
    else:
        columns = _plane_columns(tile_ptr, rows, one, ROW_BYTES, 0, LOW_BITS, D)
        low = (columns, columns >> 12, columns)
        high = low
    tile = _join_lanes(
        _lane(low, high, magic, scale[0], offset[0], outer[0], 0, LOW_BITS, HIGH_BITS),
        _lane(low, high, magic, scale[1], offset[1], outer[1], 1, LOW_BITS, HIGH_BITS),
        _lane(low, high, magic, scale[2], offset[2], outer[2], 2, LOW_BITS, HIGH_BITS),
        _lane(low, high, magic, scale[3], offset[3], outer[3], 3, LOW_BITS, HIGH_BITS),
        _lane(low, high, magic, scale[4], offset[4], outer[4], 4, LOW_BITS, HIGH_BITS),
        _lane(low, high, magic, scale[5], offset[5], outer[5], 5, LOW_BITS, HIGH_BITS),
        _lane(low, high, magic, scale[6], offset[6], outer[6], 6, LOW_BITS, HIGH_BITS),
        _lane(low, high, magic, scale[7], offset[7], outer[7], 7, LOW_BITS, HIGH_BITS))
    # Times a 1 the compiler cannot see: an op between the lanes' join and the dot's shared-memory copy.
    # Without it Triton 3.6 folds the reshape into that copy and fails on sm_90 ("Illegal shared layout",
    # in TritonGPUOptimizeDotOperands); 3.8 compiles either. Exact: x * 1 == x in fp16.
    return tile * one.to(tl.float16)


@triton.jit
def _packed_keys(key_codes_ptr, key_scales_ptr, slot, rows, one, magic, D: tl.constexpr, G: tl.constexpr,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr):
    """Keys `rows` of the packed tile at `slot` (block * KV_HEADS + kv head), rotated: fp16 [N, D], each
    r_i (code_ij s_j + z_j)."""
    scales = key_scales_ptr + slot * (2 * D + G)
    token_scale = tl.load(scales + 2 * D + rows).to(tl.float32)[:, None]
    rows_of = (token_scale, token_scale, token_scale, token_scale, token_scale, token_scale, token_scale,
               token_scale)
    return _dequantize(key_codes_ptr + slot * (G * D * (LOW_BITS + HIGH_BITS) // 8), rows, one, magic,
                       _channel_lanes(scales, D), _channel_lanes(scales + D, D), rows_of, D, G, LOW_BITS,
                       HIGH_BITS)


@triton.jit
def _packed_values(value_codes_ptr, value_scales_ptr, slot, rows, one, magic, D: tl.constexpr,
                   G: tl.constexpr, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr):
    """Values `rows` of the packed tile at `slot`, rotated: fp16 [N, D], each c_j (code_ij t_i + u_i)."""
    scales = value_scales_ptr + slot * (D + 2 * G)
    t = tl.load(scales + D + rows).to(tl.float32)[:, None]
    u = tl.load(scales + D + G + rows).to(tl.float32)[:, None]
    return _dequantize(value_codes_ptr + slot * (G * D * (LOW_BITS + HIGH_BITS) // 8), rows, one, magic,
                       (t, t, t, t, t, t, t, t), (u, u, u, u, u, u, u, u), _channel_lanes(scales, D), D, G,
                       LOW_BITS, HIGH_BITS)


@triton.jit
def _signs(rotation_ptr, D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The signs of H (or of H^T), fp16 [D, D] of +-1: H's entries are +-D^-1/2 (kvarn.hadamard), so
    H sqrt(D) rounds to them exactly."""
    offs = tl.arange(0, D)
    if TRANSPOSED:
        h = tl.load(rotation_ptr + offs[:, None] + offs[None, :] * D)
    else:
        h = tl.load(rotation_ptr + offs[:, None] * D + offs[None, :])
    return (h * (D ** 0.5)).to(tl.float16)


@triton.jit
def _rotate(x, signs, SPLIT: tl.constexpr):
    """x [M, D] fp32 times H's signs on tensor cores: x rounded to fp16, or with SPLIT as the sum of two fp16
    parts (x's fp16 rounding and what it left), whose products with +-1 are exact: then within fp32
    rounding of x's own product."""
    high = x.to(tl.float16)
    y = tl.dot(high, signs)
    if SPLIT:
        y = tl.dot((x - high.to(tl.float32)).to(tl.float16), signs, y)
    return y


@triton.jit
def _softmax_step(s, m_i, l_i, MASKED: tl.constexpr):
    """One piece's base-2 scores s [M, N] (-inf where not read) into a running (max, sum): the new max,
    sum, the weights p and the factor alpha for the accumulator. Where every score of a query row so far is
    -inf (possible only MASKED) the row is shifted by 0 instead, which keeps exp2's arguments finite."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _packed_piece(q_rot, m_i, l_i, acc, c0, block, kv_head, sink, window, one, magic, key_codes_ptr,
                  value_codes_ptr, key_scales_ptr, value_scales_ptr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                  G: tl.constexpr, N: tl.constexpr, K_LOW_BITS: tl.constexpr, K_HIGH_BITS: tl.constexpr,
                  V_LOW_BITS: tl.constexpr, V_HIGH_BITS: tl.constexpr, MASKED: tl.constexpr):
    """Keys c0 .. c0 + N - 1 of a packed tile (in block `block`) into the running (max, sum, rotated
    accumulator). q_rot fp16 [M, D]: q H times the score scale. With MASKED only the positions a query
    reads packed count (p >= sink and p < its window, [M]); without, all of them."""
    slot = block * KV_HEADS + kv_head
    rows = c0 % G + tl.arange(0, N)
    keys = _packed_keys(key_codes_ptr, key_scales_ptr, slot, rows, one, magic, D, G, K_LOW_BITS, K_HIGH_BITS)
    s = tl.dot(q_rot, tl.trans(keys))
    if MASKED:
        positions = c0 + tl.arange(0, N)
        s = tl.where((positions[None, :] >= sink) & (positions[None, :] < window[:, None]), s, float("-inf"))
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, MASKED)
    values = _packed_values(value_codes_ptr, value_scales_ptr, slot, rows, one, magic, D, G, V_LOW_BITS,
                            V_HIGH_BITS)
    return m_i, l_i, tl.dot(p.to(tl.float16), values, acc * alpha[:, None])


@triton.jit
def _exact_dot(a, b, acc, EXACT_FP32: tl.constexpr):
    """acc + a @ b, of high-precision rows: fp32 products of fp32 operands, else of fp16 ones."""
    if EXACT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)


@triton.jit
def _exact_piece(q, m_i, l_i, acc, c0, first, key_end, first_window, query_pos, window, sink, qk_scale,
                 side_block, new_rows, kv_head, k_ptr, v_ptr, side_k_ptr, side_v_ptr, stride_kn, stride_kh,
                 stride_vn, stride_vh, KV_HEADS: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                 N: tl.constexpr, EXACT_FP32: tl.constexpr):
    """Keys c0 .. c0 + N - 1 (one tile's) that a query reads in high precision into the high-precision
    state: before the chunk from the tile's side block, from the chunk's k, v after. A side row is loaded
    only where some query reads it so (from first_window on, the program's first query's window, or below
    the sink), so a tile without a side block is never read. q: the unrotated query [M, D]."""
    offs_d = tl.arange(0, D)
    positions = c0 + tl.arange(0, N)
    in_range = positions < key_end
    from_side = in_range & (positions < first) & ((positions < sink) | (positions >= first_window))
    from_new = in_range & (positions >= first)
    side_rows = ((side_block * G + positions % G) * KV_HEADS + kv_head) * D
    chunk_rows = (new_rows + positions - first).to(tl.int64)
    keys = (tl.load(side_k_ptr + side_rows[:, None] + offs_d[None, :], mask=from_side[:, None], other=0.0)
            .to(tl.float32)
            + tl.load(k_ptr + chunk_rows[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
                      mask=from_new[:, None], other=0.0).to(tl.float32))
    s = _exact_dot(q, tl.trans(keys), None, EXACT_FP32) * qk_scale
    high = (positions[None, :] < sink) | (positions[None, :] >= window[:, None])
    s = tl.where(high & (positions[None, :] <= query_pos[:, None]) & in_range[None, :], s, float("-inf"))
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, True)
    values = (tl.load(side_v_ptr + side_rows[:, None] + offs_d[None, :], mask=from_side[:, None], other=0.0)
              .to(tl.float32)
              + tl.load(v_ptr + chunk_rows[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
                        mask=from_new[:, None], other=0.0).to(tl.float32))
    return m_i, l_i, _exact_dot(p, values, acc * alpha[:, None], EXACT_FP32)


@triton.jit
def _masked_piece(i, low_pieces, fast_hi, N: tl.constexpr):
    """The first key of the i-th masked piece: the low pieces from 0, then the rest from fast_hi."""
    return tl.where(i < low_pieces, i * N, fast_hi + (i - low_pieces) * N)


@triton.jit
def _window(position, tail, G: tl.constexpr):
    """Where the high-precision positions of the query at `position` begin (its tail and unfilled tile)."""
    return position + 1 - tl.maximum(tail, (position + 1) % G)


# The table strides (the step's longest tables) change per step: one compiled kernel for every value.
@triton.jit(do_not_specialize=["stride_bt", "stride_st"])
def kvarn_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, rotation_ptr,
    key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, side_k_ptr, side_v_ptr,
    block_tables_ptr, side_tables_ptr, query_start_loc_ptr, context_lens_ptr, work_ptr,
    sink, tail, scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_bt, stride_st,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, K_LOW_BITS: tl.constexpr, K_HIGH_BITS: tl.constexpr, V_LOW_BITS: tl.constexpr,
    V_HIGH_BITS: tl.constexpr, EXACT_FP32: tl.constexpr,
):
    """Grid (work items, HEADS). Work item i = (row, m0): queries m0 .. m0 + BLOCK_M - 1 of the row's chunk.
    q [N, HEADS, D] unrotated; k, v [N, KV_HEADS, D] the step's new K/V; out [N, HEADS, D] (strides
    stride_on, stride_oh, last dim contiguous) gets the unrotated output. rotation: H fp32 [D, D],
    contiguous. Pool tensors: one slot's, contiguous. EXACT_FP32: the high-precision rows (and q) are fp32."""
    N: tl.constexpr = min(TILE, 64)
    head = tl.program_id(1)
    row, m0, token0, query_len, context_len = chunk_of_work_item(work_ptr, query_start_loc_ptr,
                                                                 context_lens_ptr)
    first = context_len - query_len  # the chunk's first position
    kv_head = head // (HEADS // KV_HEADS)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < query_len
    tokens = (token0 + offs_m).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_qn + head * stride_qh + offs_d[None, :]
    qk_scale = scale * LOG2E
    query_pos = first + offs_m
    window = _window(query_pos, tail, TILE)  # high precision from here on, per query
    first_window = _window(first + m0, tail, TILE)  # the smallest window of the program
    last_window = _window(first + tl.minimum(m0 + BLOCK_M, query_len) - 1, tail, TILE)  # the largest
    blocks = block_tables_ptr + row.to(tl.int64) * stride_bt
    side_blocks = side_tables_ptr + row.to(tl.int64) * stride_st
    key_end = tl.minimum(context_len, first + m0 + BLOCK_M)
    # Pieces from fast_lo to fast_hi are at or above the sink and below every query's window, so every
    # query reads them packed (and sees them: a window never passes its query). The others, below fast_lo and
    # from fast_hi to key_end, are masked: masked_piece(i) is the i-th.
    fast_lo = tl.cdiv(sink, N) * N
    fast_hi = tl.maximum(first_window // N * N, fast_lo)
    low_pieces = tl.cdiv(tl.minimum(fast_lo, key_end), N)
    masked_pieces = low_pieces + tl.cdiv(tl.maximum(key_end - fast_hi, 0), N)

    # 1. The high-precision rows, in the model's basis, in their own online softmax.
    q = tl.load(q_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32 if EXACT_FP32 else tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Not software-pipelined (num_stages=1). Pipelined (Triton's default here), this loop gave wrong outputs
    # on an H200 under Triton 3.6 at head_dim 32 with bf16 rows (fp16 dots), while fp32 rows and head_dim
    # 128 were right; unpipelined, every case is (tests/test_kvarn_kernels.py, the bf16 cases at head_dim
    # 32). The loop takes a few pieces a program (the sink's and the diagonal's), so little is lost.
    for i in tl.range(0, masked_pieces, num_stages=1):  # each starts below the sink or ends past the window
        c0 = _masked_piece(i, low_pieces, fast_hi, N)
        side_block = tl.maximum(tl.load(side_blocks + c0 // TILE), 0).to(tl.int64)
        m_i, l_i, acc = _exact_piece(
            q, m_i, l_i, acc, c0, first, key_end, first_window, query_pos, window, sink, qk_scale, side_block,
            token0, kv_head, k_ptr, v_ptr, side_k_ptr, side_v_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
            KV_HEADS, HEAD_DIM, TILE, N, EXACT_FP32)
    # 2. Their share into the packed tiles' basis (x H), normalized first (so bounded by its values, for
    # _rotate's fp16 parts), the one accumulator from here on; the query into that basis too (q H, times
    # the score scale: the packed pieces' fp16 operand; a 16-bit q is exact in fp16).
    signs = _signs(rotation_ptr, HEAD_DIM, False)
    acc = _rotate(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], signs, True) * (l_i * HEAD_DIM ** -0.5)[:, None]
    q_rot = _rotate(q.to(tl.float32), signs, EXACT_FP32)
    q_rot = (q_rot * (qk_scale * HEAD_DIM ** -0.5)).to(tl.float16)
    # The bits of 2^23 for _lane_code, in a register (decode's reason: each mask keeps its immediate). And a
    # 1 the compiler cannot see, for the code columns' index: their loads then stay one element a thread,
    # so that a thread takes one column (8 channels) of 4 rows, not 4 columns (32 channels) of one row: 8
    # per-channel scales to widen per piece, not 32 (733 instructions a piece on sm_90, not 848; k4v2).
    magic = MAGIC + tl.minimum(context_len, 0).to(tl.uint32)
    one = 1 + tl.minimum(context_len, 0)
    # 3. The masked pieces' packed keys.
    for i in range(0, masked_pieces):
        c0 = _masked_piece(i, low_pieces, fast_hi, N)
        if tl.maximum(c0, sink) < tl.minimum(c0 + N, last_window):  # some query reads some key packed
            # such a key lies in a full tile, which has its block
            block = tl.maximum(tl.load(blocks + c0 // TILE), 0).to(tl.int64)
            m_i, l_i, acc = _packed_piece(
                q_rot, m_i, l_i, acc, c0, block, kv_head, sink, window, one, magic, key_codes_ptr,
                value_codes_ptr, key_scales_ptr, value_scales_ptr, KV_HEADS, HEAD_DIM, TILE, N, K_LOW_BITS,
                K_HIGH_BITS, V_LOW_BITS, V_HIGH_BITS, True)
    # 4. The rest, every key packed for every query: no masks.
    for c0 in range(fast_lo, fast_hi, N):
        block = tl.load(blocks + c0 // TILE).to(tl.int64)
        m_i, l_i, acc = _packed_piece(
            q_rot, m_i, l_i, acc, c0, block, kv_head, sink, window, one, magic, key_codes_ptr,
            value_codes_ptr, key_scales_ptr, value_scales_ptr, KV_HEADS, HEAD_DIM, TILE, N, K_LOW_BITS,
            K_HIGH_BITS, V_LOW_BITS, V_HIGH_BITS, False)

    # 5. Back to the model's basis (x H^T), normalized first as in 2.
    acc = _rotate(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], _signs(rotation_ptr, HEAD_DIM, True), True)
    out_ptrs = out_ptr + tokens[:, None] * stride_on + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, (acc * HEAD_DIM ** -0.5).to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def kvarn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_codes: torch.Tensor,
                  value_codes: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor,
                  side_k: torch.Tensor, side_v: torch.Tensor, block_tables: torch.Tensor,
                  side_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                  work: torch.Tensor, key_bits: int, value_bits: int, rotation: torch.Tensor, sink: int = 0,
                  tail: int = 0, scale: float | None = None, block_m: int = 128,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the new tokens of the rows in `work` over their packed histories: the unrotated
    output [N, heads, D], into `out` (any float dtype, last dim contiguous) or a new fp32 tensor (zero at
    tokens of other rows); `out`'s other tokens are left as they are.

    q [N, heads, D] (unrotated; last dim contiguous), k, v [N, kv_heads, D]: the step's new tokens, row after
    row (rows own query_start_loc[r]:query_start_loc[r+1]); their K/V must already be stored: the tiles they
    complete packed, as kvarn_decode's pool layout holds them (one slot's tensors, contiguous). block_tables,
    side_tables int32 [rows, blocks]; context_lens int32 [rows]; work int32 [items, 2]: (row, first query),
    block_m queries each (16, 32, 64 or 128; 8 warps at 128, else 4). rotation: H = kvarn.hadamard(D), fp32
    (the kernel uses its entries as +-D^-1/2)."""
    heads, head_dim = q.shape[1:]
    if (rotation.shape != (head_dim, head_dim) or rotation.dtype != torch.float32
            or not rotation.is_contiguous()):
        raise ValueError(f"rotation must be a contiguous fp32 [{head_dim}, {head_dim}], got {rotation.dtype} "
                         f"{list(rotation.shape)}")
    if q.stride(2) != 1 or block_m not in (16, 32, 64, 128):
        raise ValueError(f"q's last dim must be contiguous (strides {q.stride()}) and block_m one of 16, 32, "
                         f"64, 128 (got {block_m})")
    if out is None:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must have q's shape {list(q.shape)} with its last dim contiguous, got "
                         f"{list(out.shape)} at strides {out.stride()}")
    if work.shape[0] == 0:
        return out
    (k_low, k_high), (v_low, v_high) = PLANE_WIDTHS[key_bits], PLANE_WIDTHS[value_bits]
    exact_fp32 = torch.float32 in (q.dtype, k.dtype, side_k.dtype)
    kvarn_prefill_kernel[(work.shape[0], heads)](
        q, k, v, out, rotation, key_codes, value_codes, key_scales, value_scales, side_k, side_v,
        block_tables, side_tables, query_start_loc, context_lens, work, sink, tail,
        head_dim ** -0.5 if scale is None else scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), side_tables.stride(0),
        heads, key_codes.shape[1], head_dim, key_codes.shape[2], block_m, k_low, k_high, v_low, v_high,
        exact_fp32, num_warps=8 if block_m == 128 else 4, num_stages=2)
    return out
