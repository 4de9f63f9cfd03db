"""Prefill attention: many queries per row, causal.

`prefill_paged_kernel` (the default) reads a row's whole context, cached prefix and new chunk, from its
pages; the chunk's K/V must already be stored. `prefill_packed_kernel` (opt-in) handles rows without a
cached prefix: it packs their new tokens together, so one query tile can hold several short rows, and
reads K/V straight from the k/v inputs.

With QUANTIZED (an fp8 pool, attention/fp8.py) the paged kernel widens the stored fp8 K/V to q's dtype (exact:
every e4m3 value is a bf16 and an fp16 value), folds the slot's key scale into the score scale and applies
the value scale to the output.

Head dims (HEAD_DIM, any multiple of 16 up to 256) are tiled as BLOCK_D = next_power_of_2(HEAD_DIM) lanes,
as tl.arange needs: where BLOCK_D > HEAD_DIM loads and stores are masked to the real dims (padding lanes read
zeros, which add nothing to a dot); where they are equal the masks are not emitted at all (`head_mask`,
`dims_mask`), so a power-of-two head_dim compiles to the code it had before padding existed.

With PDL (triton_runtime/pdl.py) a program reads its work item and the step's metadata (copied before the
step's first kernel) before it waits for the previous kernel, and everything else after: the chunk's K/V,
stored by the kv_store kernel just before, and q.
"""

import triton
import triton.language as tl

from triton_runtime.launch import INTERPRETED
from triton_runtime.pdl import launch_dependents, wait_for_previous
from triton_runtime.rounding import mul_rn

LOG2E = tl.constexpr(1.4426950408889634)
# Scores are scaled through mul_rn (PTX mul.rn), so the exp2(s - max) that follows never contracts the
# multiply into an FMA. Without it the unmasked loop's scores contract and the masked loop's (a select
# between) do not, so a query's bits would depend on which loop a key tile falls in, that is on how its
# prompt was chunked. The interpreter has no inline PTX, and never contracts a multiply into an add.
_MUL_RN = tl.constexpr(not INTERPRETED)


@triton.jit
def head_mask(rows_mask, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The [rows, BLOCK_D] mask of a tile of head rows: rows_mask, and the real dims where the head is padded
    (BLOCK_D > HEAD_DIM); rows_mask alone otherwise, so an unpadded tile's code has no dim mask."""
    if BLOCK_D == HEAD_DIM:
        return rows_mask[:, None]
    else:
        return rows_mask[:, None] & (offs_d < HEAD_DIM)[None, :]


@triton.jit
def dims_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The [BLOCK_D] mask of one head row: the real dims where the head is padded (BLOCK_D > HEAD_DIM), and a
    constant true otherwise (a load or store given only this mask then needs no `other`)."""
    if BLOCK_D == HEAD_DIM:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return offs_d < HEAD_DIM


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b with fp32 accumulation. DOT_FP32 multiplies in full fp32: for fp32 inputs (no TF32), and
    under the interpreter for bf16, whose bf16 dot is wrong (Triton 3.9); operands rounded to bf16 and
    then widened give the same products as a bf16 dot."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32: tl.constexpr):
    """One key tile into the running (max, sum, acc) of a query tile. s: [M, N] base-2 scores, -inf
    where masked. A query row with every key masked so far keeps m = -inf; shifting it by 0 instead
    avoids exp2(-inf - -inf) = NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)


@triton.jit
def chunk_of_work_item(work_ptr, query_start_loc_ptr, context_lens_ptr):
    """Work item program_id(0) of a prefill grid, (row, m0): the row, m0, the row's first token in the step,
    its chunk length and its context length (the chunk's queries sit at context positions
    context_len - query_len + m0 ...)."""
    item = tl.program_id(0)
    row = tl.load(work_ptr + 2 * item)
    m0 = tl.load(work_ptr + 2 * item + 1)
    token0 = tl.load(query_start_loc_ptr + row)
    query_len = tl.load(query_start_loc_ptr + row + 1) - token0
    return row, m0, token0, query_len, tl.load(context_lens_ptr + row)


@triton.jit
def _paged_kv_tile(key_cache_ptr, value_cache_ptr, table, offs_n, offs_d, kv_head, mask_n,
                   KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """K and V [len(offs_n), BLOCK_D] of context positions offs_n, through the row's block table, zeros in the
    padding dims; with MASKED, positions outside mask_n read zeros (and their table entries are not read)."""
    PAGE: tl.constexpr = BLOCK_SIZE * KV_HEADS * HEAD_DIM
    if MASKED:
        page = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    else:
        page = tl.load(table + offs_n // BLOCK_SIZE).to(tl.int64)
    kv = page * PAGE + (offs_n % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
    kv = kv[:, None] + offs_d[None, :]
    if MASKED or BLOCK_D != HEAD_DIM:  # mask_n is all true where not MASKED
        mask = head_mask(mask_n, offs_d, HEAD_DIM, BLOCK_D)
        k = tl.load(key_cache_ptr + kv, mask=mask, other=0.0)
        v = tl.load(value_cache_ptr + kv, mask=mask, other=0.0)
    else:
        k = tl.load(key_cache_ptr + kv)
        v = tl.load(value_cache_ptr + kv)
    return k, v


# stride_bt (the step's longest block table) changes per step: one compiled kernel for every value.
@triton.jit(do_not_specialize=["stride_bt"])
def prefill_paged_kernel(
    q_ptr, out_ptr, key_cache_ptr, value_cache_ptr, scales_ptr, block_tables_ptr, query_start_loc_ptr,
    context_lens_ptr, work_ptr,
    scale, stride_qn, stride_qh, stride_bt,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    QUANTIZED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (work items, HEADS). Work item i = (row, m0): queries m0 .. m0 + BLOCK_M - 1 of the row's
    chunk, which sit at context positions prefix + m0 ... (prefix = context_len - query_len)."""
    head = tl.program_id(1)
    row, m0, token0, query_len, context_len = chunk_of_work_item(work_ptr, query_start_loc_ptr,
                                                                 context_lens_ptr)
    prefix = context_len - query_len
    kv_head = head // (HEADS // KV_HEADS)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < query_len
    tokens = (token0 + offs_m).to(tl.int64)
    query_pos = prefix + offs_m
    qk_scale = scale * LOG2E
    if QUANTIZED:
        qk_scale = qk_scale * tl.load(scales_ptr + kv_head)
    wait_for_previous(PDL)
    launch_dependents(PDL)
    q = tl.load(q_ptr + tokens[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                mask=head_mask(mask_m, offs_d, HEAD_DIM, BLOCK_D), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + row.to(tl.int64) * stride_bt
    # Keys before the tile's first query position are visible to every query of the tile: those whole key
    # tiles need no mask. The rest (the diagonal, at most cdiv(BLOCK_M, BLOCK_N) + 1 tiles) are masked.
    visible_end = (prefix + m0) // BLOCK_N * BLOCK_N
    key_end = tl.minimum(context_len, prefix + m0 + BLOCK_M)
    for n0 in range(0, visible_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k, v = _paged_kv_tile(key_cache_ptr, value_cache_ptr, table, offs_n, offs_d, kv_head, offs_n >= 0,
                              KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE, False)
        if QUANTIZED:
            k, v = k.to(q.dtype), v.to(q.dtype)
        s = mul_rn(_dot(q.to(k.dtype), tl.trans(k), DOT_FP32), qk_scale, _MUL_RN)
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32)
    for n0 in range(visible_end, key_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < key_end
        k, v = _paged_kv_tile(key_cache_ptr, value_cache_ptr, table, offs_n, offs_d, kv_head, mask_n,
                              KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_SIZE, True)
        if QUANTIZED:
            k, v = k.to(q.dtype), v.to(q.dtype)
        s = _dot(q.to(k.dtype), tl.trans(k), DOT_FP32)
        visible = (offs_n[None, :] <= query_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, mul_rn(s, qk_scale, _MUL_RN), float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if QUANTIZED:
        out = out * tl.load(scales_ptr + KV_HEADS + kv_head)
    tl.store(out_ptr + tokens[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask(mask_m, offs_d, HEAD_DIM, BLOCK_D))


@triton.jit(do_not_specialize=["num_packed"])  # the step's packed token count
def prefill_packed_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, packed_ptr,
    num_packed, scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (cdiv(num_packed, BLOCK_M), HEADS). packed_ptr holds, for packed index p, the pair
    (token index into q/k/v, packed index where p's row starts). Rows have no cached prefix, so key j
    is visible to query i when both belong to one row and j <= i. K/V are taken in q's dtype (the
    model's, which is the cache's), as the paged kernel would read them."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (HEADS // KV_HEADS)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < num_packed
    tokens = tl.load(packed_ptr + 2 * offs_m, mask=mask_m, other=0).to(tl.int64)
    row_start = tl.load(packed_ptr + 2 * offs_m + 1, mask=mask_m, other=-1)
    key_start = tl.load(packed_ptr + 2 * tile * BLOCK_M + 1)
    wait_for_previous(PDL)
    launch_dependents(PDL)
    q = tl.load(q_ptr + tokens[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                mask=head_mask(mask_m, offs_d, HEAD_DIM, BLOCK_D), other=0.0)
    qk_scale = scale * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = tl.minimum(num_packed, (tile + 1) * BLOCK_M)
    for n0 in range(key_start, key_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < key_end
        key_tokens = tl.load(packed_ptr + 2 * offs_n, mask=mask_n, other=0).to(tl.int64)
        key_row_start = tl.load(packed_ptr + 2 * offs_n + 1, mask=mask_n, other=-2)
        kv_mask = head_mask(mask_n, offs_d, HEAD_DIM, BLOCK_D)
        k = tl.load(k_ptr + key_tokens[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptr + key_tokens[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), DOT_FP32)
        visible = (key_row_start[None, :] == row_start[:, None]) & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible & mask_n[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask(mask_m, offs_d, HEAD_DIM, BLOCK_D))
