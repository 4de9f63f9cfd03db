"""Split-KV flash decoding over a KVarN-packed history (arXiv 2606.03458): one query per row, its context
cut into splits of whole G-token tiles, each position read either from its packed tile or, in high
precision, from the side pool.

Position p of a row of context length L is a side row (side block side_tables[row, p // G], offset p % G)
when p < sink or p >= L - max(tail, L % G), which covers the unfilled tile; otherwise it is read from the
packed tile block_tables[row, p // G]. Every position is read from the pools: the caller stores (and packs)
the new token before attention.

The pool tensors and their layout are those of cache/kvarn_pack_kernel.py (codes of a token row in bit
planes, fp16 scales). Scores and outputs use the folded scale forms of the codec (kvarn.packed_scores and
kvarn.packed_output): per tile, with channel scale s, channel zero z, token scale r of the keys and channel
scale c, token scale t, token zero u of the values,
    score_i = r_i (sum_j (q_j s_j) code_ij + q . z)
    out_j   = c_j (sum_i (p_i t_i) code_ij + sum_i p_i u_i)
so the bit planes are unpacked in registers and no dequantized copy exists. Queries and outputs are in the
rotated basis (q_r = q H; the caller rotates the output back with H^T). With TWO_BASES (`kvarn_decode(...,
q=, rotation=)`, as the engine runs it) the side rows are the model's own, unrotated: they score with q, and
only the packed tiles' share of the output is rotated back.

Partial state for several splits is decode.py's: fp32 acc [P, D], then max [P], then sum [P], merged by its
`decode_merge_kernel`; scores are in base 2 (q is pre-scaled by scale * log2 e).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.decode import (decode_merge_kernel, host_split_count, split_bounds, split_cap,
                                      split_count)

LOG2E = tl.constexpr(1.4426950408889634)
# (low plane width, high plane width or 0) per code width: the codec's bit planes (kvarn.PLANES).
PLANE_WIDTHS = {2: (2, 0), 4: (4, 0), 5: (4, 1), 8: (4, 4)}


@triton.jit
def _unpack_plane(row_ptr, offs_g, ROW_BYTES: tl.constexpr, FIRST_BYTE: tl.constexpr, WIDTH: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr):
    """One bit plane of a tile's code rows as int32 [G, D]: value j of a byte sits at bits j * WIDTH."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    offs_b = tl.arange(0, D // PER_BYTE)
    packed = tl.load(row_ptr + offs_g[:, None] * ROW_BYTES + FIRST_BYTE + offs_b[None, :]).to(tl.int32)
    shifts = tl.arange(0, PER_BYTE) * WIDTH
    part = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << WIDTH) - 1)
    return tl.reshape(part, [G, D])


@triton.jit
def _unpack_codes(tile_ptr, offs_g, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, G: tl.constexpr,
                  D: tl.constexpr):
    """A packed tile's codes [G, D], fp32: the low plane, or'ed with the high plane (if any) shifted up."""
    ROW_BYTES: tl.constexpr = D * (LOW_BITS + HIGH_BITS) // 8
    codes = _unpack_plane(tile_ptr, offs_g, ROW_BYTES, 0, LOW_BITS, G, D)
    if HIGH_BITS > 0:
        high = _unpack_plane(tile_ptr, offs_g, ROW_BYTES, D * LOW_BITS // 8, HIGH_BITS, G, D)
        codes = codes | (high << LOW_BITS)
    return codes.to(tl.float32)


@triton.jit
def _attend_tile(q, q_side, m_i, l_i, acc, acc_side, t0, end, sink, side_from, block, side_block, kv_head,
                 key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, side_k_ptr, side_v_ptr,
                 KV_HEADS: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                 K_LOW_BITS: tl.constexpr, K_HIGH_BITS: tl.constexpr, V_LOW_BITS: tl.constexpr,
                 V_HIGH_BITS: tl.constexpr, MIXED: tl.constexpr):
    """Tile t0 .. t0 + G - 1 into the running (max, sum, acc, acc_side): packed positions score with q (the
    rotated query) into acc, side rows with q_side (the query in the side rows' basis) into acc_side. Without
    MIXED every position of the tile is in range and packed (no masks, no side pool); with MIXED some are
    side rows or out of range."""
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, D)
    positions = t0 + offs_g
    slot = block * KV_HEADS + kv_head
    key_scales = key_scales_ptr + slot * (2 * D + G)
    value_scales = value_scales_ptr + slot * (D + 2 * G)
    key_tile = key_codes_ptr + slot * (G * D * (K_LOW_BITS + K_HIGH_BITS) // 8)
    value_tile = value_codes_ptr + slot * (G * D * (V_LOW_BITS + V_HIGH_BITS) // 8)
    if MIXED:
        inside = positions < end
        high_precision = (positions < sink) | (positions >= side_from)
        packed = inside & ~high_precision
        from_side = inside & high_precision
        # A packed position lies below L - L % G, in a full tile, which has its block; a tile without one
        # (the unfilled tile) may have none, and its packed loads are skipped.
        any_packed = tl.maximum(t0, sink) < tl.minimum(tl.minimum(t0 + G, end), side_from)
        s = tl.full([G], float("-inf"), tl.float32)
        if any_packed:
            channel_scale = tl.load(key_scales + offs_d).to(tl.float32)
            channel_zero = tl.load(key_scales + D + offs_d).to(tl.float32)
            token_scale = tl.load(key_scales + 2 * D + offs_g).to(tl.float32)
            codes = _unpack_codes(key_tile, offs_g, K_LOW_BITS, K_HIGH_BITS, G, D)
            folded = q * channel_scale
            scores = token_scale * (tl.sum(codes * folded[None, :], 1) + tl.sum(q * channel_zero, 0))
            s = tl.where(packed, scores, s)
        side_rows = ((side_block * G + offs_g) * KV_HEADS + kv_head) * D
        side_ptrs = side_rows[:, None] + offs_d[None, :]
        k_side = tl.load(side_k_ptr + side_ptrs, mask=from_side[:, None], other=0.0).to(tl.float32)
        s = tl.where(from_side, tl.sum(k_side * q_side[None, :], 1), s)
        # Every tile in a split's range holds a position below the context length: m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v_side = tl.load(side_v_ptr + side_ptrs, mask=from_side[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha
        acc_side = acc_side * alpha + tl.sum(p[:, None] * v_side, 0)
        if any_packed:
            p_packed = tl.where(packed, p, 0.0)
            channel_scale = tl.load(value_scales + offs_d).to(tl.float32)
            token_scale = tl.load(value_scales + D + offs_g).to(tl.float32)
            token_zero = tl.load(value_scales + D + G + offs_g).to(tl.float32)
            codes = _unpack_codes(value_tile, offs_g, V_LOW_BITS, V_HIGH_BITS, G, D)
            weighted = p_packed * token_scale
            acc += channel_scale * (tl.sum(weighted[:, None] * codes, 0) + tl.sum(p_packed * token_zero, 0))
    else:
        channel_scale = tl.load(key_scales + offs_d).to(tl.float32)
        channel_zero = tl.load(key_scales + D + offs_d).to(tl.float32)
        token_scale = tl.load(key_scales + 2 * D + offs_g).to(tl.float32)
        key_codes = _unpack_codes(key_tile, offs_g, K_LOW_BITS, K_HIGH_BITS, G, D)
        v_channel_scale = tl.load(value_scales + offs_d).to(tl.float32)
        v_token_scale = tl.load(value_scales + D + offs_g).to(tl.float32)
        v_token_zero = tl.load(value_scales + D + G + offs_g).to(tl.float32)
        value_codes = _unpack_codes(value_tile, offs_g, V_LOW_BITS, V_HIGH_BITS, G, D)
        folded = q * channel_scale
        s = token_scale * (tl.sum(key_codes * folded[None, :], 1) + tl.sum(q * channel_zero, 0))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        weighted = p * v_token_scale
        tile_out = tl.sum(weighted[:, None] * value_codes, 0) + tl.sum(p * v_token_zero, 0)
        acc = acc * alpha + v_channel_scale * tile_out
        acc_side = acc_side * alpha
    l_i = l_i * alpha + tl.sum(p, 0)
    return m_new, l_i, acc, acc_side


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

        offs_d = tl.arange(0, HEAD_DIM)
        q_offset = row.to(tl.int64) * stride_qn + head * stride_qh + offs_d
        q = tl.load(q_ptr + q_offset).to(tl.float32) * (scale * LOG2E)
        if TWO_BASES:
            q_side = tl.load(q_side_ptr + q_offset).to(tl.float32) * (scale * LOG2E)
        else:
            q_side = q
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.zeros([], tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        acc_side = tl.zeros([HEAD_DIM], tl.float32)
        blocks = block_tables_ptr + row.to(tl.int64) * stride_bt
        side_blocks = side_tables_ptr + row.to(tl.int64) * stride_st
        for t0 in range(start, end, TILE):
            tile = t0 // TILE
            # A missing block (-1) is never dereferenced; clamping keeps even its address in the pool.
            block = tl.maximum(tl.load(blocks + tile), 0).to(tl.int64)
            if (t0 < sink) | (t0 + TILE > side_from):
                side_block = tl.maximum(tl.load(side_blocks + tile), 0).to(tl.int64)
                m_i, l_i, acc, acc_side = _attend_tile(
                    q, q_side, m_i, l_i, acc, acc_side, t0, end, sink, side_from, block, side_block, kv_head,
                    key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, side_k_ptr, side_v_ptr,
                    KV_HEADS, HEAD_DIM, TILE, K_LOW_BITS, K_HIGH_BITS, V_LOW_BITS, V_HIGH_BITS, True)
            else:
                m_i, l_i, acc, acc_side = _attend_tile(
                    q, q_side, m_i, l_i, acc, acc_side, t0, end, sink, side_from, block, block, kv_head,
                    key_codes_ptr, value_codes_ptr, key_scales_ptr, value_scales_ptr, side_k_ptr, side_v_ptr,
                    KV_HEADS, HEAD_DIM, TILE, K_LOW_BITS, K_HIGH_BITS, V_LOW_BITS, V_HIGH_BITS, False)

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
                 rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one rotated query per row over its packed history; the rotated output [rows, heads, D].
    With q (the unrotated query, q_r = q H, of q_r's shape and strides) the side rows are unrotated (the
    engine's side pool keeps them as the model made them) and the result is the unrotated output: the side
    rows' share plus the packed tiles' share rotated back with `rotation` (H, D x D fp32).

    q_r [rows, heads, D] (any float dtype; last dim contiguous). The pool tensors of one (loop, layer) slot
    are contiguous: key_codes/value_codes uint8 [NB, KVH, G, D * bits / 8], key_scales fp16 [NB, KVH, 2D + G],
    value_scales fp16 [NB, KVH, D + 2G], side_k/side_v [NSB, G, KVH, D] (model dtype). block_tables and
    side_tables int32 [rows, max_blocks] (-1 where a tile has no block). context_lens int32 [rows].
    scale: the softmax scale, D^-0.5 by default. num_splits: the most splits a row is cut into (by default
    2 * SMs / KVH, as the Triton backend); a row of context c gets min(num_splits, ceil(c / split_min_keys))
    (split_min_keys a multiple of G). max_context_len bounds the grid (computed from context_lens, a host
    sync, when not given). out: fp32 [rows, heads, D] by default, or a given tensor of that shape.
    """
    rows, heads, head_dim = q_r.shape
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
    if q is not None and (q.shape != q_r.shape or q.stride() != q_r.stride() or out is not None
                          or rotation is None or rotation.shape != (head_dim, head_dim)):
        raise ValueError(f"q must have q_r's shape {list(q_r.shape)} and strides {q_r.stride()} (got "
                         f"{list(q.shape)}, {q.stride()}), come with the rotation [{head_dim}, {head_dim}], "
                         "and takes no `out`")
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
        num_warps=num_warps,
    )
    if grid_splits > 1:
        for target, state in ((out, partials), (out_side, partials_side))[:1 + two_bases]:
            decode_merge_kernel[(heads, rows)](target, context_lens, state, grid_splits, heads, head_dim,
                                               split_min_keys, cap)
    if not two_bases:
        return out
    return out_side + out @ rotation.T  # H is symmetric; .T says which way it turns
