"""Split-KV flash-decoding over pages: one query per row, its context cut into splits, in one launch.

`decode_split_kernel` also stores the row's new K/V (the last context position) and merges the splits in
the same launch: the last split of a (row, head) to take its ticket merges all of them (`_merge_splits`) and
puts the ticket back to 0. Eager and CUDA-graph decode run this one kernel; only the grid (in graph mode it
has room for the longest context the block table holds) and the buffers differ, and neither changes a bit of
a row's result. `decode_merge_kernel` is the same merge as a launch of its own, for the KVarN decode kernel
(attention/kernels/kvarn_decode.py).

Partial state, fp32, for P = rows * heads * grid_splits parts: acc [P, D], then max [P], then sum [P]. The
head is tiled as BLOCK_D = next_power_of_2(D) lanes, masked to D where wider (attention/kernels/prefill.py
says how the masks vanish at a power-of-two D).
Scores are kept in base 2 (q is pre-scaled by scale * log2 e).

With SHARED (kv_sharing="last", attention/base.py SharedKVMetadata) a row's positions from its prompt length
on are generated tokens, one K/V per layer in generated pages; they are addressed relative to the call's
own (loop, layer) plane, (group - loop) * num_layers planes away.

Cached keys go through tensor cores (tl.dot), the query padded to 16 rows; DOT_FP32 multiplies in fp32 (fp32
inputs, and bf16 under the interpreter, as the prefill kernels do). With QUANTIZED (an fp8 pool,
attention/fp8.py) the slot's key scale of the kv head folds into the score scale and its value scale into the
output, and the raw fp8 keys and values widen to fp16 for the dots (FP16_DOT; the query is cast to fp16;
values are loaded as 32-bit words and widened by `_widen_e4m3`, so the fp16 tile, not an 8-bit one, is
transposed).

With PDL (triton_runtime/pdl.py) a program reads the step's metadata (context lengths, block tables, row map:
inputs copied before the step's first kernel) and asks L2 for its first key tile's past K/V before it waits
for the previous kernel; q, the new k/v, the cache store, the partials and the ticket all come after the wait.
"""

import torch
import triton
import triton.language as tl

from attention.kernels.kv_store import encode_kv
from attention.kernels.prefill import _dot, dims_mask, head_mask
from triton_runtime.pdl import launch_dependents, wait_for_previous

LOG2E = tl.constexpr(1.4426950408889634)
# SM count assumed off CUDA (the interpreter), an H100/H200's.
CPU_SM_COUNT = 132
# Splits whose partial state the merge loads at once: one trip to L2 per 16 splits instead of one per split.
MERGE_LANES = tl.constexpr(16)


def host_split_count(context_len: int, split_min_keys: int, split_cap: int) -> int:
    """The host twin of split_count below."""
    return min(split_cap, max(1, -(-context_len // split_min_keys)))


def split_cap(device: torch.device, kv_heads: int) -> int:
    """The most splits a row gets: 2 * SMs / kv_heads rounded down to a power of two, so one long row alone
    gives about two programs per SM."""
    sm_count = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                else CPU_SM_COUNT)
    cap = max(1, 2 * sm_count // kv_heads)
    return 1 << (cap.bit_length() - 1)


@triton.jit
def split_count(context_len, keys_per_split, SPLIT_CAP: tl.constexpr):
    """Splits for one row: one per keys_per_split keys, at least 1, at most SPLIT_CAP. A function of
    the row's own length only, so a row's result never depends on its batch or on eager vs graph."""
    return tl.minimum(tl.maximum(tl.cdiv(context_len, keys_per_split), 1), SPLIT_CAP)


@triton.jit
def row_split_count(context_len, SHORT_CONTEXT: tl.constexpr, SHORT_SPLIT_KEYS: tl.constexpr,
                    SPLIT_MIN_KEYS: tl.constexpr, SPLIT_CAP: tl.constexpr):
    """split_count with two length classes (the host twin is attention/triton_backend.py's SplitRule): a
    row of at most SHORT_CONTEXT keys is cut every SHORT_SPLIT_KEYS keys, a longer one every
    SPLIT_MIN_KEYS."""
    keys_per_split = tl.where(context_len <= SHORT_CONTEXT, SHORT_SPLIT_KEYS, SPLIT_MIN_KEYS)
    return split_count(context_len, keys_per_split, SPLIT_CAP)


@triton.jit
def split_bounds(split, num_splits, context_len, TILE: tl.constexpr):
    """Keys [start, end) of split `split` of a row's context: equal shares, each a whole number of TILE-key
    tiles (the last one shorter)."""
    keys_per_split = tl.cdiv(tl.cdiv(context_len, num_splits), TILE) * TILE
    start = split * keys_per_split
    return start, tl.minimum(start + keys_per_split, context_len)


@triton.jit
def _key_rows(table, gen_table, positions, end, prompt_len, loop, plane_elems, kv_head,
              BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
              SHARED: tl.constexpr, LOOPS: tl.constexpr, NUM_LAYERS: tl.constexpr):
    """Offsets of the K/V of `positions` (those below end; a vector, or one position), from the start of the
    call's slot plane, 64-bit: a pool plane can exceed 2^31 elements. With SHARED every tile takes the
    addressing that covers both tables (each load masked to its own positions; for prompt positions the same
    rows as the paged addressing). A uniform branch that sent prompt-only tiles the paged way made the loop
    spill on sm_90: 4.9 KB of stack a thread in bf16 under Triton 3.6, 488 bytes under 3.8; without it none
    under 3.6 (167 registers) and 48 bytes under 3.8 (tests/hopper_compile.py prints them)."""
    PAGE: tl.constexpr = BLOCK_SIZE * KV_HEADS * HEAD_DIM
    inside = positions < end
    if SHARED:
        PAGE_TOKENS: tl.constexpr = LOOPS * BLOCK_SIZE
        in_prompt = positions < prompt_len
        g = tl.maximum(positions - prompt_len, 0)
        prompt_page = tl.load(table + positions // BLOCK_SIZE, mask=inside & in_prompt, other=0)
        generated_page = tl.load(gen_table + g // PAGE_TOKENS, mask=inside & ~in_prompt, other=0)
        page = tl.where(in_prompt, prompt_page, generated_page).to(tl.int64)
        offset = tl.where(in_prompt, positions % BLOCK_SIZE, g % BLOCK_SIZE)
        planes_away = tl.where(in_prompt, 0, (g % PAGE_TOKENS // BLOCK_SIZE - loop) * NUM_LAYERS)
        rows = planes_away.to(tl.int64) * plane_elems + page * PAGE + (offset * (KV_HEADS * HEAD_DIM)
                                                                          + kv_head * HEAD_DIM)
    else:
        page = tl.load(table + positions // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        rows = page * PAGE + ((positions % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM)
    return rows


@triton.jit
def _prefetch_l2(key_cache_ptr, value_cache_ptr, rows, mask_n, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Asks L2 for the 128-byte lines of the K and V rows at `rows` where mask_n (PTX prefetch.global.L2: a
    hint that loads nothing into registers, so it costs none while the program waits): one a line's worth of
    elements from the row's start, LINES of them (LANES, a power of two, with the padded head)."""
    LINE: tl.constexpr = 1024 // key_cache_ptr.dtype.element_ty.primitive_bitwidth  # elements per line
    LINES: tl.constexpr = (HEAD_DIM + LINE - 1) // LINE
    LANES: tl.constexpr = max(BLOCK_D // LINE, 1)
    lines = rows[:, None] + (tl.arange(0, LANES) * LINE)[None, :]
    wanted = (mask_n[:, None] & (tl.arange(0, LANES) < LINES)[None, :]).to(tl.int32)
    _prefetch_lines(key_cache_ptr + lines, wanted)
    _prefetch_lines(value_cache_ptr + lines, wanted)


@triton.jit
def _prefetch_lines(ptrs, wanted):
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; }", "=r,l,r",
                              [ptrs, wanted], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _widen_e4m3(words, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp8 e4m3 values loaded as int32 words (four a word, little-endian) to a [ROWS, COLS] fp16 tile,
    exactly, two values per PTX cvt. A plain .to() on the fp8 tile lets Triton fold the conversion into the
    dot's operand load, which reads a transposed 8-bit V tile from shared memory one byte at a time (there is
    no 8-bit ldmatrix.trans); widened here, the fp16 tile is what goes through shared memory (ldmatrix.trans).
    On an H200 that took an fp8 decode call at 16 x 8K from 255 to 238 µs
    (benchmarks/results/attention-fp8-2026-12-03-69b050d.md)."""
    a, b, c, d = tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 x, lo; "
        "cvt.rn.f16x2.e4m3x2 y, hi; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
        pack=1)
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (ROWS, COLS))


@triton.jit
def _merge_splits(partials_ptr, out_ptr, first, num_splits, num_partials, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Combines splits first .. first + num_splits - 1 into out_ptr[:HEAD_DIM], MERGE_LANES of them a round,
    each round's states loaded at once and reduced in a fixed order: the bits depend on num_splits and the
    parts only, never on the grid or on which split arrived last. Loads bypass L1 (.cg): other programs wrote
    these parts during this launch."""
    lanes = tl.arange(0, MERGE_LANES)
    offs_d = tl.arange(0, BLOCK_D)
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, MERGE_LANES):
        present = s0 + lanes < num_splits
        part = first + s0 + lanes
        m = tl.load(partials_ptr + num_partials * HEAD_DIM + part, mask=present, other=float("-inf"),
                    cache_modifier=".cg")
        l_part = tl.load(partials_ptr + num_partials * (HEAD_DIM + 1) + part, mask=present, other=0.0,
                         cache_modifier=".cg")
        acc_part = tl.load(partials_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                           mask=head_mask(present, offs_d, HEAD_DIM, BLOCK_D), other=0.0,
                           cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 0))
        # An all-empty row keeps m = -inf; shifting by 0 instead avoids exp2(-inf - -inf) = NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m - m_ref)
        l_run = l_run * alpha + tl.sum(l_part * w, 0)
        acc = acc * alpha + tl.sum(acc_part * w[:, None], 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(out_ptr + offs_d, out.to(out_ptr.dtype.element_ty), mask=dims_mask(offs_d, HEAD_DIM, BLOCK_D))


@triton.jit
def _finish_split(acc, m_i, l_i, out_row, partials_ptr, tickets_ptr, split, num_splits, r, head,
                  HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A split's state out: the row's output where it is the only split, else its partial state, then its
    ticket; the last split to take the (row, head)'s ticket merges every split and puts the ticket back to
    0."""
    offs_d = tl.arange(0, BLOCK_D)
    dims = dims_mask(offs_d, HEAD_DIM, BLOCK_D)
    if num_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_row + offs_d, out.to(out_row.dtype.element_ty), mask=dims)
    else:
        grid_splits = tl.num_programs(0)
        num_partials = grid_splits * HEADS * tl.num_programs(2)
        first = (r * HEADS + head) * grid_splits
        part = first + split
        tl.store(partials_ptr + part * HEAD_DIM + offs_d, acc, mask=dims)
        tl.store(partials_ptr + num_partials * HEAD_DIM + part, m_i)
        tl.store(partials_ptr + num_partials * (HEAD_DIM + 1) + part, l_i)
        # All threads' stores are done before one thread releases them with the ticket.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + r * HEADS + head, 1, sem="acq_rel")
        if ticket == num_splits - 1:
            _merge_splits(partials_ptr, out_row, first, num_splits, num_partials, HEAD_DIM, BLOCK_D)
            tl.store(tickets_ptr + r * HEADS + head, 0)


# One compiled kernel serves every loop's calls and every step: the loop and the block tables' row strides
# (the longest table of the step) change from call to call, and Triton would compile a variant for each
# value of 1 and each multiple of 16.
@triton.jit(do_not_specialize=["loop", "stride_bt", "stride_gt"])
def decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, key_cache_ptr, value_cache_ptr, scales_ptr,
    block_tables_ptr, context_lens_ptr, slot_mapping_ptr, rows_ptr, partials_ptr, tickets_ptr,
    gen_tables_ptr, prompt_lens_ptr, slot_offsets_ptr, loop, plane_elems,
    scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, stride_gt,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SHORT_CONTEXT: tl.constexpr,
    SHORT_SPLIT_KEYS: tl.constexpr, SPLIT_MIN_KEYS: tl.constexpr, SPLIT_CAP: tl.constexpr,
    ROW_MAP: tl.constexpr, SHARED: tl.constexpr, LOOPS: tl.constexpr, NUM_LAYERS: tl.constexpr,
    ROW_SLOTS: tl.constexpr, QUANTIZED: tl.constexpr, DOT_FP32: tl.constexpr, FP16_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (grid_splits, HEADS, decode rows). Program (s, h, r) attends query head h of decode row r
    over split s of its context. With ROW_MAP, rows_ptr holds (batch row, token) pairs; without it
    decode row r is batch row r and token r. The new token goes where the slot mapping says; with SHARED a
    generated token (slot -1) goes to its generated page. gen_tables_ptr, prompt_lens_ptr, loop and
    plane_elems are read only with SHARED; scales_ptr (the slot's key then value scales) only with
    QUANTIZED; tickets_ptr (one per (row, head), zero between launches) only with several splits. With
    ROW_SLOTS (depth batching: each row at its own loop) batch row `row` stores and reads slot_offsets[row]
    planes (plane_elems elements each) past the call's slot, with that slot's scales (with SHARED, a whole
    number of loops: its generated pages are addressed from its own loop)."""
    split = tl.program_id(0)
    head = tl.program_id(1)
    r = tl.program_id(2)
    if ROW_MAP:
        row = tl.load(rows_ptr + 2 * r)
        token = tl.load(rows_ptr + 2 * r + 1).to(tl.int64)
    else:
        row = r
        token = r.to(tl.int64)
    context_len = tl.load(context_lens_ptr + row)
    if ROW_SLOTS:  # the row's own loop: whole planes past the call's slot (its scales likewise)
        planes = tl.load(slot_offsets_ptr + row).to(tl.int64)
        key_cache_ptr += planes * plane_elems
        value_cache_ptr += planes * plane_elems
        scales_ptr += planes * (2 * KV_HEADS)
        if SHARED:  # generated pages are addressed from the row's own loop's plane
            loop += (planes // NUM_LAYERS).to(tl.int32)
    num_splits = row_split_count(context_len, SHORT_CONTEXT, SHORT_SPLIT_KEYS, SPLIT_MIN_KEYS, SPLIT_CAP)
    GROUP: tl.constexpr = HEADS // KV_HEADS
    kv_head = head // GROUP
    # A program past its row's splits gets an empty range here: it prefetches nothing.
    start, end = split_bounds(split, num_splits, context_len, BLOCK_N)
    last = context_len - 1  # the new token: read from k/v, not from the cache
    cached_end = tl.minimum(end, last)
    table = block_tables_ptr + row.to(tl.int64) * stride_bt
    gen_table = gen_tables_ptr
    prompt_len = 0
    if SHARED:
        gen_table = gen_tables_ptr + row.to(tl.int64) * stride_gt
        prompt_len = tl.load(prompt_lens_ptr + row)
    tile = tl.arange(0, BLOCK_N)
    if PDL:  # past K/V only (positions below the new token's): no kernel of this step writes them
        first_tile = start + tile
        _prefetch_l2(key_cache_ptr, value_cache_ptr,
                     _key_rows(table, gen_table, first_tile, cached_end, prompt_len, loop, plane_elems,
                               kv_head, BLOCK_SIZE, KV_HEADS, HEAD_DIM, SHARED, LOOPS, NUM_LAYERS),
                     first_tile < cached_end, HEAD_DIM, BLOCK_D)
    wait_for_previous(PDL)
    launch_dependents(PDL)
    if split < num_splits:
        offs_d = tl.arange(0, BLOCK_D)
        dims = dims_mask(offs_d, HEAD_DIM, BLOCK_D)
        q_raw = tl.load(q_ptr + token * stride_qn + head * stride_qh + offs_d, mask=dims, other=0.0)
        qk_scale = scale * LOG2E
        k_scale, v_scale = 1.0, 1.0
        if QUANTIZED:
            k_scale = tl.load(scales_ptr + kv_head)
            v_scale = tl.load(scales_ptr + KV_HEADS + kv_head)
            qk_scale = qk_scale * k_scale
        q = q_raw.to(tl.float32) * qk_scale  # for the new token's score, in fp32
        # The cached keys on tensor cores: the query is row 0 of a 16-row tile (tl.dot's least M; the other
        # rows are zero and their state is dropped after the loop), its scores scaled in fp32 after the dot,
        # and P rounded to the dot's dtype before P @ V, as the prefill kernels do. That keeps the loop at
        # the memory's pace where per-element fp32 math and a cross-warp reduction per tile did not.
        query_row = tl.arange(0, 16) == 0
        q_tile = tl.where(query_row[:, None], q_raw[None, :], 0.0).to(q_raw.dtype)
        if FP16_DOT:  # an fp8 pool: its values widen to fp16 natively and exactly
            q_tile = q_tile.to(tl.float16)
        m_i = tl.full([16], float("-inf"), tl.float32)
        l_i = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, BLOCK_D], tl.float32)
        for n0 in range(start, cached_end, BLOCK_N):
            positions = n0 + tile
            mask_n = positions < cached_end
            rows = _key_rows(table, gen_table, positions, cached_end, prompt_len, loop, plane_elems, kv_head,
                             BLOCK_SIZE, KV_HEADS, HEAD_DIM, SHARED, LOOPS, NUM_LAYERS)
            kv_mask = head_mask(mask_n, offs_d, HEAD_DIM, BLOCK_D)
            k = tl.load(key_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            k = k.to(q_tile.dtype)
            if FP16_DOT and not DOT_FP32:  # an fp8 pool: rows are whole head_dim rows, so 4-byte aligned
                offs_w = tl.arange(0, BLOCK_D // 4)
                words = tl.load(value_cache_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] // 4
                                + offs_w[None, :],
                                mask=head_mask(mask_n, offs_w, HEAD_DIM // 4, BLOCK_D // 4), other=0)
                v = _widen_e4m3(words, BLOCK_N, BLOCK_D)
            else:
                v = tl.load(value_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask,
                            other=0.0).to(q_tile.dtype)
            s = _dot(q_tile, tl.trans(k), DOT_FP32) * qk_scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            # Every tile holds at least one key, so m_new is finite here.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
            m_i = m_new
        m_i = tl.max(tl.where(query_row, m_i, float("-inf")), 0)
        l_i = tl.sum(tl.where(query_row, l_i, 0.0), 0)
        acc = tl.sum(tl.where(query_row[:, None], acc, 0.0), 0)
        if (start <= last) & (last < end):
            kv_new = kv_head * stride_kh + offs_d
            k_new = encode_kv(tl.load(k_ptr + token * stride_kn + kv_new, mask=dims, other=0.0), k_scale,
                              QUANTIZED, key_cache_ptr.dtype.element_ty)
            v_new = encode_kv(tl.load(v_ptr + token * stride_vn + kv_head * stride_vh + offs_d, mask=dims,
                                      other=0.0), v_scale, QUANTIZED, value_cache_ptr.dtype.element_ty)
            if head % GROUP == 0:
                dst = tl.load(slot_mapping_ptr + token).to(tl.int64) * (KV_HEADS * HEAD_DIM)
                if SHARED:  # a generated token's slot is -1: it goes to its generated page
                    generated = _key_rows(table, gen_table, last, context_len, prompt_len, loop, plane_elems,
                                          0, BLOCK_SIZE, KV_HEADS, HEAD_DIM, SHARED, LOOPS, NUM_LAYERS)
                    dst = tl.where(dst >= 0, dst, generated)
                dst += kv_head * HEAD_DIM + offs_d
                tl.store(key_cache_ptr + dst, k_new, mask=dims)
                tl.store(value_cache_ptr + dst, v_new, mask=dims)
            s_new = tl.sum(k_new.to(tl.float32) * q, 0)
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            acc = acc * alpha + p_new * v_new.to(tl.float32)
            l_i = l_i * alpha + p_new
            m_i = m_new

        if QUANTIZED:
            acc = acc * v_scale
        out_row = out_ptr + token * (HEADS * HEAD_DIM) + head * HEAD_DIM
        _finish_split(acc, m_i, l_i, out_row, partials_ptr, tickets_ptr, split, num_splits, r, head, HEADS,
                      HEAD_DIM, BLOCK_D)


@triton.jit
def decode_merge_kernel(
    out_ptr, context_lens_ptr, partials_ptr, grid_splits,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_MIN_KEYS: tl.constexpr,
    SPLIT_CAP: tl.constexpr,
):
    """Grid (HEADS, rows): the merge of partial states that a split kernel left without merging them (the
    KVarN decode kernel). Pure decode only (row r is token r). Rows with one split were finished by the
    split kernel."""
    head = tl.program_id(0)
    r = tl.program_id(1)
    num_splits = split_count(tl.load(context_lens_ptr + r), SPLIT_MIN_KEYS, SPLIT_CAP)
    if num_splits > 1:
        num_partials = grid_splits * HEADS * tl.num_programs(1)
        out_row = out_ptr + r.to(tl.int64) * (HEADS * HEAD_DIM) + head * HEAD_DIM
        _merge_splits(partials_ptr, out_row, (r * HEADS + head) * grid_splits, num_splits, num_partials,
                      HEAD_DIM, BLOCK_D)
