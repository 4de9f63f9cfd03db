"""Split-KV flash decoding over a KVarN-packed history (arXiv 2606.03458): one query per row, its context
cut into splits of whole G-token tiles, each position read either from its packed tile or, in high
precision, from the side pool.

Position p of a row of context length L is a side row (side block side_tables[row, p // G], offset p % G)
when p < sink or p >= L - max(tail, L % G), which covers the unfilled tile; otherwise it is read from the
packed tile block_tables[row, p // G]. Every position is read from the pools: the caller stores (and packs)
the new token before attention.

The pool tensors and their layout are those of cache/kvarn_pack_kernel.py (codes of a token row in bit
planes, 5-bit codes as cache/kvarn.py's record_codes lays them out; fp16 scales). Scores and outputs use
the folded scale forms of the codec (kvarn.packed_scores and kvarn.packed_output): per tile, with channel
scale s, channel zero z, token scale r of the keys and channel scale c, token scale t, token zero u of the
values,
    score_i = r_i (sum_j (q_j s_j) code_ij + q . z)
    out_j   = c_j (sum_i (p_i t_i) code_ij + sum_i p_i u_i)
so the bit planes are unpacked in registers and no dequantized copy exists. Queries and outputs are in the
rotated basis (q_r = q H; the caller rotates the output back with H^T). With TWO_BASES (`kvarn_decode(...,
q=, rotation=)`, as the engine runs it) the side rows are the model's own, unrotated: they score with q, and
only the packed tiles' share of the output is rotated back.

The decode kernel is ALU-bound (a few instructions per code against half a byte or less read per code),
so it never builds a [G, D] code tile: each thread reads whole words of a bit plane and takes their
codes apart in place, lane by lane (the comment above MAGIC), with no int-to-float conversion and no
exchange of tiles between threads; each warp keeps its own online softmax over its rows of every tile, and
the side rows keep one of their own, read after the packed tiles. The states merge once, at the end of
the program.

Partial state for several splits is decode.py's: fp32 acc [P, D], then max [P], then sum [P], merged by its
`decode_merge_kernel`; scores are in base 2 (q is pre-scaled by scale * log2 e).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.decode import (decode_merge_kernel, host_split_count, split_bounds, split_cap,
                                      split_count)
from attention.kernels.rotate import rotate_rows

LOG2E = tl.constexpr(1.4426950408889634)
# (low plane width, high plane width or 0) per code width: the codec's bit planes (kvarn.PLANES).
PLANE_WIDTHS = {2: (2, 0), 4: (4, 0), 5: (4, 1), 8: (4, 4)}


# Decode's lane-split form of a packed tile. A column is 8 codes of one token row, channels 8c .. 8c + 7:
# one element of a bit plane (a uint32 word of 4-bit codes, uint16 of 2-bit, uint8 of 1-bit; 5-bit codes
# a uint32 word and a high byte, their 40-bit column, the high bytes of a thread's 8 rows one uint64 load:
# cache/kvarn.py's record_codes), so each plane's row is D / 8 columns and one code tensor per plane serves
# all widths. The tile's rows are cut
# into SLOTS slots of HALVES * 8 rows (SLOTS = 4, one per warp at num_warps 4, from G = 64 on; HALVES = 2
# from G = 16 on; a tile of more rows is taken 64 at a time); a thread holds one column of 8 rows of its
# slot (row (slot * HALVES + half) * 8 + r). So every per-tile tensor is [SLOTS, HALVES, D / 8, 8], warps
# x (2 x 16 lanes) x registers at head_dim 128: the key dot reduces over the columns (across 16 lanes), the
# value sum over the rows (in registers, the halves' shares merged at the end), and no tile is ever
# rearranged. Each slot keeps its own running max, sum and output, so a tile needs no exchange between
# warps. The last dim indexes a thread's 8 rows in the code and per-row tensors, the 8 codes of its column
# (lane k: channel 8c + k) in per-channel ones; _lanes and _stack go between it and 8 separate tensors.
MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23: or'ing an integer below 2^23 into them adds it


@triton.jit
def _lanes(x, SLOTS: tl.constexpr, HALVES: tl.constexpr, COLS: tl.constexpr):
    """x [SLOTS, HALVES, COLS, 8] as its 8 slices x[..., 0], ..., x[..., 7] (the last dim is in registers:
    splitting it moves no data)."""
    x = tl.reshape(x, [SLOTS, HALVES, COLS, 2, 2, 2])  # lane k = 4 * i + 2 * j + l at [..., i, j, l]
    even, odd = tl.split(x)
    even_0, even_1 = tl.split(even)
    odd_0, odd_1 = tl.split(odd)
    x0, x4 = tl.split(even_0)
    x2, x6 = tl.split(even_1)
    x1, x5 = tl.split(odd_0)
    x3, x7 = tl.split(odd_1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _stack(x0, x1, x2, x3, x4, x5, x6, x7, SLOTS: tl.constexpr, HALVES: tl.constexpr, COLS: tl.constexpr):
    """_lanes' inverse: 8 tensors [SLOTS, HALVES, COLS] as one [SLOTS, HALVES, COLS, 8], x_k at [..., k]."""
    x = tl.join(tl.join(tl.join(x0, x4), tl.join(x2, x6)), tl.join(tl.join(x1, x5), tl.join(x3, x7)))
    return tl.reshape(x, [SLOTS, HALVES, COLS, 8])


@triton.constexpr_function
def lane_shift(k, width):
    """The bit at which _lane_code leaves code k of a column of `width`-bit codes: a code must sit below bit
    23, so from lane high_lane(width) on it is read from the column >> 12 (12 bits lower), and 5-bit codes
    6 and 7 from the column's top part (_top_part: bits 30 up)."""
    return width * k - 12 * (k >= high_lane(width)) - 18 * (k >= top_lane(width))


@triton.constexpr_function
def high_lane(width):
    """The first lane read from the column >> 12: the first whose code starts at bit 16 or above."""
    return -(-16 // width)


@triton.constexpr_function
def top_lane(width):
    """The first lane read from the top part: 6 for 5-bit codes (40-bit columns), none for the others."""
    return 6 if width == 5 else 8


@triton.jit
def _lane_units(WIDTH: tl.constexpr, FACTOR: tl.constexpr):
    """[8] fp32: FACTOR * 2^-lane_shift(k, WIDTH) for lane k, what undoes _lane_code's shift (exact: a power
    of two, built from its bits)."""
    k = tl.arange(0, 8)
    shift = WIDTH * k - 12 * (k >= high_lane(WIDTH)).to(tl.int32) - 18 * (k >= top_lane(WIDTH)).to(tl.int32)
    return ((127 - shift) << 23).to(tl.float32, bitcast=True) * FACTOR


@triton.jit
def _lane_code(column, high_part, top_part, magic, k: tl.constexpr, WIDTH: tl.constexpr):
    """Code k of each column (uint32 holding 8 WIDTH-bit codes, code k at bit WIDTH * k) as fp32, times
    2^lane_shift(k, WIDTH) (_lane_units undoes it): its bits masked in place and or'ed into the mantissa of
    2^23 (magic, the bits of 2^23), minus 2^23. Exact, one LOP3 and one FADD, no int-to-float conversion
    (a quarter-rate instruction on Hopper). A code must sit below bit 23: 4-bit lanes 4..7 are read from
    high_part = column >> 12 (one shift per column), at bits 4 .. 16 (not 0: ptxas would turn that mask
    into a second shift). 5-bit codes (a 40-bit column: column holds its low 32 bits, _top_part the rest):
    lanes 0..3 in place, 4 and 5 from high_part at bits 8 and 13, 6 and 7 from top_part at bits 0 and 5."""
    if k >= top_lane(WIDTH):
        source = top_part
    elif k >= high_lane(WIDTH):
        source = high_part
    else:
        source = column
    bits = source & (((1 << WIDTH) - 1) << lane_shift(k, WIDTH))
    return (bits | magic).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _top_part(low, high):
    """Bits 30 .. 39 of 40-bit columns of 5-bit codes (codes 6 and 7), from their low word and high byte."""
    return (low >> 30) | (high << 2)


@triton.jit
def _column(ptrs, ROW_BYTES: tl.constexpr, FIRST_BYTE: tl.constexpr, WIDTH: tl.constexpr):
    """The columns at ptrs (uint8 pointers to their first bytes) as uint32: one load of a (8 * WIDTH)-bit
    element where the plane's rows hold whole ones, else WIDTH bytes put together (5-bit codes at
    head_dim < 32, whose 4-bit plane rows are not whole words)."""
    if (ROW_BYTES % WIDTH == 0) and (FIRST_BYTE % WIDTH == 0):
        if WIDTH == 4:
            elem = tl.uint32
        elif WIDTH == 2:
            elem = tl.uint16
        else:
            elem = tl.uint8
        column = tl.load(ptrs.to(tl.pointer_type(elem))).to(tl.uint32)
    else:
        column = tl.load(ptrs).to(tl.uint32)
        for byte in tl.static_range(1, WIDTH):
            column |= tl.load(ptrs + byte).to(tl.uint32) << (8 * byte)
    return column


@triton.jit
def _plane_columns(tile_ptr, rows, offs_c, ROW_BYTES: tl.constexpr, FIRST_BYTE: tl.constexpr,
                   WIDTH: tl.constexpr):
    """One bit plane of a tile: the column (8 codes, uint32) of each thread's 8 rows, row by row, 8 tensors
    [SLOTS, HALVES, COLS]. rows [SLOTS, HALVES, 1]: the first of a thread's rows; offs_c [1, 1, COLS]. A
    column is WIDTH bytes of its row's plane."""
    ptrs = tile_ptr + FIRST_BYTE + rows * ROW_BYTES + offs_c * WIDTH
    return (_column(ptrs, ROW_BYTES, FIRST_BYTE, WIDTH),
            _column(ptrs + ROW_BYTES, ROW_BYTES, FIRST_BYTE, WIDTH),
            _column(ptrs + 2 * ROW_BYTES, ROW_BYTES, FIRST_BYTE, WIDTH),
            _column(ptrs + 3 * ROW_BYTES, ROW_BYTES, FIRST_BYTE, WIDTH),
            _column(ptrs + 4 * ROW_BYTES, ROW_BYTES, FIRST_BYTE, WIDTH),
            _column(ptrs + 5 * ROW_BYTES, ROW_BYTES, FIRST_BYTE, WIDTH),
            _column(ptrs + 6 * ROW_BYTES, ROW_BYTES, FIRST_BYTE, WIDTH),
            _column(ptrs + 7 * ROW_BYTES, ROW_BYTES, FIRST_BYTE, WIDTH))


@triton.jit
def _row_score(part, column, top_part, lanes, magic, WIDTH: tl.constexpr):
    """part + sum_k lanes[k] code_k over one row's column: 8 FFMAs on the codes as _lane_code makes them."""
    high_part = column >> 12
    for k in tl.static_range(8):
        part += lanes[k] * _lane_code(column, high_part, top_part, magic, k, WIDTH)
    return part


@triton.jit
def _plane_scores(parts, columns, tops, folded, magic, WIDTH: tl.constexpr, SLOTS: tl.constexpr,
                  HALVES: tl.constexpr, COLS: tl.constexpr):
    """parts (8 rows) + each row's share of sum_j folded_j code_ij over its column. columns: a plane's 8
    rows (_plane_columns); tops: their _top_part (5-bit codes; any 8 tensors otherwise); folded [SLOTS,
    HALVES, COLS, 8]: lanes in the last dim, with _lane_units."""
    lanes = _lanes(folded, SLOTS, HALVES, COLS)
    return (_row_score(parts[0], columns[0], tops[0], lanes, magic, WIDTH),
            _row_score(parts[1], columns[1], tops[1], lanes, magic, WIDTH),
            _row_score(parts[2], columns[2], tops[2], lanes, magic, WIDTH),
            _row_score(parts[3], columns[3], tops[3], lanes, magic, WIDTH),
            _row_score(parts[4], columns[4], tops[4], lanes, magic, WIDTH),
            _row_score(parts[5], columns[5], tops[5], lanes, magic, WIDTH),
            _row_score(parts[6], columns[6], tops[6], lanes, magic, WIDTH),
            _row_score(parts[7], columns[7], tops[7], lanes, magic, WIDTH))


@triton.jit
def _lane_sum(columns, high_parts, tops, weights, magic, k: tl.constexpr, WIDTH: tl.constexpr):
    """sum_r weights[r] code_k of row r's column, lane k over a thread's 8 rows: an FFMA chain."""
    total = weights[0] * _lane_code(columns[0], high_parts[0], tops[0], magic, k, WIDTH)
    for r in tl.static_range(1, 8):
        total += weights[r] * _lane_code(columns[r], high_parts[r], tops[r], magic, k, WIDTH)
    return total


@triton.jit
def _plane_values(columns, tops, weighted, magic, WIDTH: tl.constexpr, SLOTS: tl.constexpr,
                  HALVES: tl.constexpr, COLS: tl.constexpr):
    """sum_i weighted_i code_ij over each thread's 8 rows, per lane: [SLOTS, HALVES, COLS, 8] (lanes in the
    last dim, each times its _lane_code shift). columns: a plane's 8 rows, tops as _plane_scores';
    weighted [.., 8]: rows."""
    weights = _lanes(weighted, SLOTS, HALVES, COLS)
    high_parts = (columns[0] >> 12, columns[1] >> 12, columns[2] >> 12, columns[3] >> 12,
                  columns[4] >> 12, columns[5] >> 12, columns[6] >> 12, columns[7] >> 12)
    return _stack(_lane_sum(columns, high_parts, tops, weights, magic, 0, WIDTH),
                  _lane_sum(columns, high_parts, tops, weights, magic, 1, WIDTH),
                  _lane_sum(columns, high_parts, tops, weights, magic, 2, WIDTH),
                  _lane_sum(columns, high_parts, tops, weights, magic, 3, WIDTH),
                  _lane_sum(columns, high_parts, tops, weights, magic, 4, WIDTH),
                  _lane_sum(columns, high_parts, tops, weights, magic, 5, WIDTH),
                  _lane_sum(columns, high_parts, tops, weights, magic, 6, WIDTH),
                  _lane_sum(columns, high_parts, tops, weights, magic, 7, WIDTH),
                  SLOTS, HALVES, COLS)


@triton.jit
def _high_bytes(tile_ptr, rows, columns_at, G: tl.constexpr, D: tl.constexpr):
    """The high bytes of 5-bit codes' 40-bit columns (kvarn.record_codes: by 8-row groups, column-major in
    a group) of a thread's 8 rows, one 8-byte load: 8 tensors of uint32 [SLOTS, HALVES, COLS]."""
    group = tile_ptr + G * (D // 2) + rows * (D // 8) + columns_at * 8  # rows: a multiple of 8
    word = tl.load(group.to(tl.pointer_type(tl.uint64)))
    low, high = word.to(tl.uint32), (word >> 32).to(tl.uint32)
    return (low & 255, (low >> 8) & 255, (low >> 16) & 255, low >> 24,
            high & 255, (high >> 8) & 255, (high >> 16) & 255, high >> 24)


@triton.jit
def _code_columns(tile_ptr, rows, columns_at, ROW_BYTES: tl.constexpr, LOW_BITS: tl.constexpr,
                  HIGH_BITS: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """A tile's first plane's columns of a thread's 8 rows and, for 5-bit codes, their _top_part (else the
    columns again, unread): (columns, tops), 8 tensors each. 5-bit codes' words are a row's D / 2 bytes."""
    if (LOW_BITS == 4) and (HIGH_BITS == 1):
        low = _plane_columns(tile_ptr, rows, columns_at, D // 2, 0, 4)
        high = _high_bytes(tile_ptr, rows, columns_at, G, D)
        tops = (_top_part(low[0], high[0]), _top_part(low[1], high[1]), _top_part(low[2], high[2]),
                _top_part(low[3], high[3]), _top_part(low[4], high[4]), _top_part(low[5], high[5]),
                _top_part(low[6], high[6]), _top_part(low[7], high[7]))
    else:
        low = _plane_columns(tile_ptr, rows, columns_at, ROW_BYTES, 0, LOW_BITS)
        tops = low
    return low, tops


@triton.jit
def _attend_packed(q, magic, column_step, m_slot, l_slot, acc_slot, t0, end, sink, side_from, block,
                   kv_head, key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr,
                   KV_HEADS: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                   K_LOW_BITS: tl.constexpr, K_HIGH_BITS: tl.constexpr, V_LOW_BITS: tl.constexpr,
                   V_HIGH_BITS: tl.constexpr, SLOTS: tl.constexpr, HALVES: tl.constexpr,
                   MASKED: tl.constexpr):
    """The packed positions of tile t0 .. t0 + G - 1 into each slot's running max [SLOTS, D / 8], sum
    [SLOTS, HALVES, D / 8] (both copies across the columns) and output [SLOTS, HALVES, D / 8, 8] (sum and
    output: each half's share): all of them, or with MASKED those in range and not side rows. q [SLOTS,
    HALVES, D / 8, 8]: the rotated query, lanes in the last dim. A tile of more than SLOTS * HALVES * 8 rows
    is taken that many rows at a time (G = 128: two parts), a slot's rows from each."""
    COLS: tl.constexpr = D // 8
    SHAPE: tl.constexpr = [SLOTS, HALVES, COLS, 8]
    PART_ROWS: tl.constexpr = SLOTS * HALVES * 8
    lane = tl.arange(0, 8)[None, None, None, :]
    offs_c = tl.arange(0, COLS)[None, None, :]
    columns_at = offs_c * column_step  # the plane loads' column offsets, of no contiguity the compiler sees
    channel_of = tl.broadcast_to(offs_c[:, :, :, None] * 8 + lane, SHAPE)  # a column's channels
    slot = block * KV_HEADS + kv_head
    key_scales = key_scales_ptr + slot * (2 * D + G)
    value_scales = value_scales_ptr + slot * (D + 2 * G)
    key_tile = key_codes_ptr + slot * (G * D * (K_LOW_BITS + K_HIGH_BITS) // 8)
    value_tile = value_codes_ptr + slot * (G * D * (V_LOW_BITS + V_HIGH_BITS) // 8)
    K_ROW: tl.constexpr = D * (K_LOW_BITS + K_HIGH_BITS) // 8
    V_ROW: tl.constexpr = D * (V_LOW_BITS + V_HIGH_BITS) // 8

    # score_i = r_i (sum_j (q_j s_j) code_ij + q . z): q . z enters as each column's share in every row.
    channel_scale = tl.load(key_scales + channel_of).to(tl.float32)
    zero_part = tl.sum(q * tl.load(key_scales + D + channel_of).to(tl.float32), 3)
    folded = q * channel_scale  # times each plane's _lane_units, exact (the high plane's 2^K_LOW_BITS too)
    K_FIVE: tl.constexpr = (K_LOW_BITS == 4) and (K_HIGH_BITS == 1)
    V_FIVE: tl.constexpr = (V_LOW_BITS == 4) and (V_HIGH_BITS == 1)
    K_WIDTH: tl.constexpr = 5 if K_FIVE else K_LOW_BITS  # the width the first plane's columns are read at
    V_WIDTH: tl.constexpr = 5 if V_FIVE else V_LOW_BITS
    folded_low = folded * _lane_units(K_WIDTH, 1.0)[None, None, None, :]
    if K_HIGH_BITS > 0 and not K_FIVE:
        folded_high = folded * _lane_units(K_HIGH_BITS, 1 << K_LOW_BITS)[None, None, None, :]
    # out_j = c_j (sum_i (p_i t_i) code_ij + sum_i p_i u_i), each half over its own rows.
    v_channel_scale = tl.load(value_scales + channel_of).to(tl.float32)
    for part in tl.static_range(G // PART_ROWS):
        rows = (part * PART_ROWS
                + (tl.arange(0, SLOTS)[:, None, None] * HALVES + tl.arange(0, HALVES)[None, :, None]) * 8)
        row_of = tl.broadcast_to(rows[:, :, :, None] + lane, SHAPE)  # a thread's rows, copies per column
        token_scale = tl.load(key_scales + 2 * D + row_of).to(tl.float32)
        parts = (zero_part, zero_part, zero_part, zero_part, zero_part, zero_part, zero_part, zero_part)
        columns, tops = _code_columns(key_tile, rows, columns_at, K_ROW, K_LOW_BITS, K_HIGH_BITS, G, D)
        parts = _plane_scores(parts, columns, tops, folded_low, magic, K_WIDTH, SLOTS, HALVES, COLS)
        if K_HIGH_BITS > 0 and not K_FIVE:
            columns = _plane_columns(key_tile, rows, columns_at, K_ROW, D * K_LOW_BITS // 8, K_HIGH_BITS)
            parts = _plane_scores(parts, columns, columns, folded_high, magic, K_HIGH_BITS, SLOTS, HALVES,
                                  COLS)
        scores = _stack(parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6], parts[7], SLOTS,
                        HALVES, COLS)
        s = tl.sum(scores, 2, keep_dims=True) * token_scale  # each row's score, copies across its columns
        if MASKED:
            positions = t0 + row_of
            s = tl.where((positions < end) & (positions >= sink) & (positions < side_from), s, float("-inf"))
        m_new = tl.maximum(m_slot, tl.max(tl.max(s, 3), 1))  # the columns hold copies: no max across them
        if MASKED:  # a slot may have no packed position yet: keep exp2's arguments finite
            m_new_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        else:
            m_new_ref = m_new
        alpha = tl.exp2(m_slot - m_new_ref)[:, None, :]
        p = tl.exp2(s - m_new_ref[:, None, :, None])
        l_slot = l_slot * alpha + tl.sum(p, 3)
        m_slot = m_new

        v_token_scale = tl.load(value_scales + D + row_of).to(tl.float32)
        v_token_zero = tl.load(value_scales + D + G + row_of).to(tl.float32)
        weighted = p * v_token_scale
        zero_term = tl.sum(p * v_token_zero, 3)[:, :, :, None]
        columns, tops = _code_columns(value_tile, rows, columns_at, V_ROW, V_LOW_BITS, V_HIGH_BITS, G, D)
        tile_out = (_plane_values(columns, tops, weighted, magic, V_WIDTH, SLOTS, HALVES, COLS)
                    * _lane_units(V_WIDTH, 1.0)[None, None, None, :] + zero_term)
        if V_HIGH_BITS > 0 and not V_FIVE:
            columns = _plane_columns(value_tile, rows, columns_at, V_ROW, D * V_LOW_BITS // 8, V_HIGH_BITS)
            tile_out += (_plane_values(columns, columns, weighted, magic, V_HIGH_BITS, SLOTS, HALVES, COLS)
                         * _lane_units(V_HIGH_BITS, 1 << V_LOW_BITS)[None, None, None, :])
        acc_slot = acc_slot * alpha[:, :, :, None] + v_channel_scale * tile_out
    return m_slot, l_slot, acc_slot


@triton.jit
def _attend_side(q_side, m_side, l_side, acc_side, c0, lo, hi, side_block, kv_head, side_k_ptr, side_v_ptr,
                 KV_HEADS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr):
    """Positions c0 .. c0 + ROWS - 1 (of one tile, in side block side_block) that lie in [lo, hi), side
    rows, into their own running (max, sum, acc_side), scored with q_side (the query in the side rows'
    basis)."""
    offs_g = c0 % G + tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    positions = c0 + tl.arange(0, ROWS)
    from_side = (positions >= lo) & (positions < hi)
    side_rows = ((side_block * G + offs_g) * KV_HEADS + kv_head) * D
    side_ptrs = side_rows[:, None] + offs_d[None, :]
    k_side = tl.load(side_k_ptr + side_ptrs, mask=from_side[:, None], other=0.0).to(tl.float32)
    s = tl.where(from_side, tl.sum(k_side * q_side[None, :], 1), float("-inf"))
    m_new = tl.maximum(m_side, tl.max(s, 0))
    m_new_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_side - m_new_ref)
    p = tl.exp2(s - m_new_ref)
    v_side = tl.load(side_v_ptr + side_ptrs, mask=from_side[:, None], other=0.0).to(tl.float32)
    acc_side = acc_side * alpha + tl.sum(p[:, None] * v_side, 0)
    l_side = l_side * alpha + tl.sum(p, 0)
    return m_new, l_side, acc_side


# The table strides (the step's longest tables) change per step: one compiled kernel for every value.
@triton.jit(do_not_specialize=["stride_bt", "stride_st"])
def kvarn_decode_split_kernel(
    q_ptr, q_side_ptr, out_ptr, out_side_ptr, partials_ptr, partials_side_ptr,
    key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, side_k_ptr, side_v_ptr,
    block_tables_ptr, side_tables_ptr, context_lens_ptr,
    sink, tail, scale, stride_qn, stride_qh, stride_bt, stride_st,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
    K_LOW_BITS: tl.constexpr, K_HIGH_BITS: tl.constexpr, V_LOW_BITS: tl.constexpr, V_HIGH_BITS: tl.constexpr,
    SPLIT_MIN_KEYS: tl.constexpr, SPLIT_CAP: tl.constexpr, TWO_BASES: tl.constexpr,
):
    """Grid (grid_splits, HEADS, rows). Program (s, h, r) attends query head h of row r over split s of
    its context, whole tiles of TILE positions. A row with one split writes its output; otherwise the
    split leaves its partial state for `decode_merge_kernel`. With TWO_BASES the side rows are unrotated:
    they score with q_side (the unrotated query, of q's strides) and their share of the output goes to
    out_side (partials_side), the packed tiles' to out (partials), still rotated; without it q_side_ptr,
    out_side_ptr and partials_side_ptr are not read, and out holds the whole (rotated) output."""
    split = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + row)
    num_splits = split_count(context_len, SPLIT_MIN_KEYS, SPLIT_CAP)
    if split < num_splits:
        kv_head = head // (HEADS // KV_HEADS)
        start, end = split_bounds(split, num_splits, context_len, TILE)
        side_from = context_len - tl.maximum(tail, context_len % TILE)  # the newest rows, high precision

        HALVES: tl.constexpr = 2 if TILE >= 16 else 1
        SLOTS: tl.constexpr = min(TILE // (8 * HALVES), 4)  # one per warp at num_warps 4 (the default)
        COLS: tl.constexpr = HEAD_DIM // 8
        SIDE_ROWS: tl.constexpr = 16 if TILE >= 16 else TILE
        offs_d = tl.arange(0, HEAD_DIM)
        q_offset = row.to(tl.int64) * stride_qn + head * stride_qh
        channel_of = tl.broadcast_to(tl.arange(0, COLS)[None, None, :, None] * 8
                                     + tl.arange(0, 8)[None, None, None, :], [SLOTS, HALVES, COLS, 8])
        q = tl.load(q_ptr + q_offset + channel_of).to(tl.float32) * (scale * LOG2E)
        if TWO_BASES:
            q_side = tl.load(q_side_ptr + q_offset + offs_d).to(tl.float32) * (scale * LOG2E)
        else:
            q_side = tl.load(q_ptr + q_offset + offs_d).to(tl.float32) * (scale * LOG2E)
        # The bits of 2^23 for _lane_code, in a register: ptxas cannot fold a value that depends on the
        # (never negative) context length, so each LOP3 keeps its immediate for a lane's mask instead of
        # rematerializing eight masks per tile.
        magic = MAGIC + tl.minimum(context_len, 0).to(tl.uint32)
        # 1, as a value the compiler cannot see: the plane loads' column offsets are multiplied by it. Where
        # it sees that a plane row's bytes are contiguous (the 1-bit plane of k5v5, loaded a byte a column) it
        # vectorizes those loads in a layout of their own, and every code and partial score of the plane then
        # crosses to the other layout through shared memory: under Triton 3.6 on sm_90, 119 layout
        # conversions in the k5v5 kernel against 9 in k4v2's, and 276 barriers against 50.
        column_step = 1 + tl.minimum(context_len, 0)
        # An online softmax per slot over its packed positions (_attend_packed) and one over the side rows
        # (_attend_side), each with its own max, merged at the end.
        m_slot = tl.full([SLOTS, COLS], float("-inf"), tl.float32)
        l_slot = tl.zeros([SLOTS, HALVES, COLS], tl.float32)
        acc_slot = tl.zeros([SLOTS, HALVES, COLS, 8], tl.float32)
        m_side = tl.full([], float("-inf"), tl.float32)
        l_side = tl.zeros([], tl.float32)
        acc_side = tl.zeros([HEAD_DIM], tl.float32)
        blocks = block_tables_ptr + row.to(tl.int64) * stride_bt
        side_blocks = side_tables_ptr + row.to(tl.int64) * stride_st
        for t0 in range(start, end, TILE):
            tile = t0 // TILE
            # A missing block (-1) is never dereferenced; clamping keeps even its address in the pool.
            block = tl.maximum(tl.load(blocks + tile), 0).to(tl.int64)
            if (t0 < sink) | (t0 + TILE > side_from):
                # A packed position lies below L - L % G, in a full tile, which has its block; a tile
                # without one (the unfilled tile) may have none, and its packed loads are skipped.
                if tl.maximum(t0, sink) < tl.minimum(tl.minimum(t0 + TILE, end), side_from):
                    m_slot, l_slot, acc_slot = _attend_packed(
                        q, magic, column_step, m_slot, l_slot, acc_slot, t0, end, sink, side_from, block,
                        kv_head, key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, KV_HEADS,
                        HEAD_DIM, TILE, K_LOW_BITS, K_HIGH_BITS, V_LOW_BITS, V_HIGH_BITS, SLOTS, HALVES, True)
            else:
                m_slot, l_slot, acc_slot = _attend_packed(
                    q, magic, column_step, m_slot, l_slot, acc_slot, t0, end, sink, side_from, block, kv_head,
                    key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, KV_HEADS, HEAD_DIM,
                    TILE, K_LOW_BITS, K_HIGH_BITS, V_LOW_BITS, V_HIGH_BITS, SLOTS, HALVES, False)
        # The side rows (the first `sink` positions and those from side_from on) in loops of their own,
        # after the packed tiles, so that nothing of theirs stays live through the packed path; in chunks
        # of SIDE_ROWS aligned positions, each within one tile (a whole tile of side rows at a time would
        # hold more registers than the packed path).
        for window in tl.static_range(2):
            if window == 0:
                lo = start
                hi = tl.minimum(sink, end)
            else:  # from side_from on, but not twice where the two overlap
                lo = tl.maximum(tl.maximum(side_from, sink), start)
                hi = end
            for c0 in range(lo - lo % SIDE_ROWS, hi, SIDE_ROWS):
                side_block = tl.maximum(tl.load(side_blocks + c0 // TILE), 0).to(tl.int64)
                m_side, l_side, acc_side = _attend_side(
                    q_side, m_side, l_side, acc_side, c0, lo, hi, side_block, kv_head, side_k_ptr, side_v_ptr,
                    KV_HEADS, HEAD_DIM, TILE, SIDE_ROWS)

        # The merge: one max over the slots and the side rows (an empty split keeps -inf, and zeros).
        # m_slot's and l_slot's columns hold copies; acc_slot holds each half's share, in lanes.
        m_slot = tl.max(m_slot, 1)
        m_i = tl.maximum(tl.max(m_slot, 0), m_side)
        m_ref = tl.where(m_i > float("-inf"), m_i, 0.0)
        slot_weight = tl.exp2(m_slot - m_ref)
        side_weight = tl.exp2(m_side - m_ref)
        l_i = tl.sum(tl.max(tl.sum(l_slot, 1), 1) * slot_weight, 0) + l_side * side_weight
        acc = tl.sum(tl.sum(acc_slot * slot_weight[:, None, None, None], 1), 0)
        acc = tl.reshape(acc, [HEAD_DIM])  # channel 8c + k from [c, k]
        acc_side = acc_side * side_weight
        if not TWO_BASES:
            acc += acc_side
        if num_splits == 1:
            out_offset = row.to(tl.int64) * (HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d
            norm = tl.where(l_i > 0, l_i, 1.0)
            tl.store(out_ptr + out_offset, (acc / norm).to(out_ptr.dtype.element_ty))
            if TWO_BASES:
                tl.store(out_side_ptr + out_offset, (acc_side / norm).to(out_side_ptr.dtype.element_ty))
        else:
            num_partials = tl.num_programs(0) * HEADS * tl.num_programs(2)
            part = (row * HEADS + head) * tl.num_programs(0) + split
            tl.store(partials_ptr + part * HEAD_DIM + offs_d, acc)
            tl.store(partials_ptr + num_partials * HEAD_DIM + part, m_i)
            tl.store(partials_ptr + num_partials * (HEAD_DIM + 1) + part, l_i)
            if TWO_BASES:  # the same max and sum: decode_merge_kernel merges each part on its own
                tl.store(partials_side_ptr + part * HEAD_DIM + offs_d, acc_side)
                tl.store(partials_side_ptr + num_partials * HEAD_DIM + part, m_i)
                tl.store(partials_side_ptr + num_partials * (HEAD_DIM + 1) + part, l_i)


def kvarn_decode(q_r: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                 key_scales: torch.Tensor, value_scales: torch.Tensor, side_k: torch.Tensor,
                 side_v: torch.Tensor, block_tables: torch.Tensor, side_tables: torch.Tensor,
                 context_lens: torch.Tensor, key_bits: int, value_bits: int, sink: int = 0, tail: int = 0,
                 scale: float | None = None, num_splits: int | None = None, split_min_keys: int = 512,
                 max_context_len: int | None = None, out: torch.Tensor | None = None,
                 num_warps: int = 4, q: torch.Tensor | None = None,
                 rotation: torch.Tensor | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """Attention of one rotated query per row over its packed history; the rotated output [rows, heads, D].
    With q (the unrotated query, q_r = q H, of q_r's shape and strides, but for dims of size 1) the side rows
    are unrotated (the engine's side pool keeps them as the model made them) and the result is the unrotated
    output: the side rows' share plus the packed tiles' share rotated back with `rotation` (H, D x D fp32).

    q_r [rows, heads, D] (any float dtype; last dim contiguous). The pool tensors of one (loop, layer) slot
    are contiguous: key_codes/value_codes uint8 [NB, KVH, G, D * bits / 8], key_scales fp16 [NB, KVH, 2D + G],
    value_scales fp16 [NB, KVH, D + 2G], side_k/side_v [NSB, G, KVH, D] (model dtype). block_tables and
    side_tables int32 [rows, max_blocks] (-1 where a tile has no block). context_lens int32 [rows].
    scale: the softmax scale, D^-0.5 by default. num_splits: the most splits a row is cut into (by default
    2 * SMs / KVH, as the Triton backend); a row of context c gets min(num_splits, ceil(c / split_min_keys))
    (split_min_keys a multiple of G). max_context_len bounds the grid (computed from context_lens, a host
    sync, when not given). out: fp32 [rows, heads, D] by default, or a given tensor of that shape.
    maxnreg: the split kernel's register cap for ptxas (a .maxnreg directive), None for none.
    """
    _check_inputs(q_r, key_codes, value_codes, key_scales, value_scales, side_k, side_v, key_bits, value_bits,
                  split_min_keys, out, q, rotation)
    rows, heads, head_dim = q_r.shape
    kv_heads, group = key_codes.shape[1:3]
    cap = num_splits or split_cap(q_r.device, kv_heads)
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if rows else 0
    grid_splits = host_split_count(max_context_len, split_min_keys, cap)
    if out is None:
        out = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=q_r.device)
    if rows == 0:
        return out

    def partial_state() -> torch.Tensor:
        return torch.empty(rows * heads * grid_splits * (head_dim + 2) if grid_splits > 1 else 1,
                           dtype=torch.float32, device=q_r.device)

    two_bases = q is not None
    partials = partial_state()
    out_side, partials_side = (torch.empty_like(out), partial_state()) if two_bases else (out, partials)
    k_low, k_high = PLANE_WIDTHS[key_bits]
    v_low, v_high = PLANE_WIDTHS[value_bits]
    kvarn_decode_split_kernel[(grid_splits, heads, rows)](
        q_r, q if two_bases else q_r, out, out_side, partials, partials_side,
        key_codes, value_codes, key_scales, value_scales, side_k, side_v,
        block_tables, side_tables, context_lens,
        sink, tail, head_dim ** -0.5 if scale is None else scale, q_r.stride(0), q_r.stride(1),
        block_tables.stride(0), side_tables.stride(0),
        heads, kv_heads, head_dim, group, k_low, k_high, v_low, v_high, split_min_keys, cap, two_bases,
        num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if grid_splits > 1:
        for target, state in ((out, partials), (out_side, partials_side))[:1 + two_bases]:
            decode_merge_kernel[(heads, rows)](target, context_lens, state, grid_splits, heads, head_dim,
                                               head_dim, split_min_keys, cap)
    if not two_bases:
        return out
    return rotate_rows(out, rotation.T, base=out_side)  # H is symmetric; .T says which way it turns


def _check_inputs(q_r: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                  key_scales: torch.Tensor, value_scales: torch.Tensor, side_k: torch.Tensor,
                  side_v: torch.Tensor, key_bits: int, value_bits: int, split_min_keys: int,
                  out: torch.Tensor | None, q: torch.Tensor | None, rotation: torch.Tensor | None) -> None:
    """kvarn_decode's inputs against its docstring, each named where it is off."""
    heads, head_dim = q_r.shape[1:]
    num_blocks, kv_heads, group = key_codes.shape[:3]
    if heads % kv_heads or key_bits not in PLANE_WIDTHS or value_bits not in PLANE_WIDTHS:
        raise ValueError(f"need heads ({heads}) a multiple of kv heads ({kv_heads}) and code widths in "
                         f"{sorted(PLANE_WIDTHS)}, got {key_bits} and {value_bits}")
    shapes = {
        "key_codes": (key_codes, (num_blocks, kv_heads, group, head_dim * key_bits // 8)),
        "value_codes": (value_codes, (num_blocks, kv_heads, group, head_dim * value_bits // 8)),
        "key_scales": (key_scales, (num_blocks, kv_heads, 2 * head_dim + group)),
        "value_scales": (value_scales, (num_blocks, kv_heads, head_dim + 2 * group)),
        "side_k": (side_k, (side_k.shape[0], group, kv_heads, head_dim)),
        "side_v": (side_v, (side_k.shape[0], group, kv_heads, head_dim)),
    }
    for name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous of shape {list(shape)}, got {list(tensor.shape)}")
    if split_min_keys % group or q_r.stride(2) != 1:
        raise ValueError(f"split_min_keys ({split_min_keys}) must be a multiple of the tile ({group}), and "
                         "q_r's last dim contiguous")
    # The kernel reads q at q_r's strides; a dim of size 1 (one row) may have any stride.
    if q is not None and (q.shape != q_r.shape or out is not None
                          or any(a != b for a, b, n in zip(q.stride(), q_r.stride(), q.shape) if n > 1)
                          or rotation is None or rotation.shape != (head_dim, head_dim)):
        raise ValueError(f"q must have q_r's shape {list(q_r.shape)} and strides {q_r.stride()} (got "
                         f"{list(q.shape)}, {q.stride()}), come with the rotation [{head_dim}, {head_dim}], "
                         "and takes no `out`")
