"""Weight-streaming skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M small (1..64).

At decode every projection reads its whole weight for a handful of rows, so the time is the weight's
bytes over memory bandwidth, and cuBLAS reaches only 21-55% of it at Ouro's shapes (docs/h200.md).
Design, per program (pid_n, pid_k):
- it streams a [BLOCK_N, BLOCK_K] tile of W rows per step along its K range, with 16-byte loads along
  K, pipelined NUM_STAGES deep (the loop's loads go through shared memory with async copies);
- x's BLOCK_M rows (M padded; padding rows masked, so they cost no traffic) come from L2 with it;
- the dot path computes y^T = W x^T with tl.dot ("swap AB": W tile is the MMA's M side, so M = 1..16
  pads only the MMA's narrow N side to 16); the FMA path (BLOCK_M = 1 or 2 rows) multiplies and adds
  in fp32 registers and reduces over K once, at the end;
- split-K: the grid is (N tiles, splits). Each split stores its fp32 partial [M, BLOCK_N]; the last
  split of a tile to take the tile's ticket (an atomic counter) sums the partials in split order
  0, 1, .. and writes y, then puts the ticket back to 0. The sum order is fixed, so results are
  bitwise reproducible (eager or CUDA graph, any arrival order).
Accumulation is fp32; y is rounded once to x's dtype. The main loop and the split-K sum are jit helpers
(tile_product, split_k_total) that model/kernels/gemv_epilogues.py's variants share.

PDL (triton_runtime/pdl.py), where pdl_supported(device): a program asks L2 for its split's first NUM_STAGES
weight tiles, waits for the previous kernel, lets the next one launch, and only then reads x and writes
anything. With `preload` (the FMA path) it instead loads its whole weight slice into registers before
the wait: a program launched early, while the kernel before it runs, then has its bytes in hand when that
kernel ends.

Batch invariance within an M bucket: the config depends on (bucket(M), N, K, dtype) only, buckets
being powers of two, and each row's arithmetic does not depend on the other rows, so a row gives the
same bits at any M of its bucket (a batch of 3 and the same rows padded to 4 agree). At every M:
invariant_config's one config per weight, with tiled_gemm_kernel past MAX_SKINNY_M rows (invariant_linear;
deterministic mode).

Workspace: one per device, shared by every launch (launches on one stream never overlap; with PDL a
kernel touches it only after waiting for the one before): an int32 ticket array that the kernels keep at
zero (per N tile, and ROW_TICKET for the norm epilogue), and a grow-only fp32 partials buffer. The tickets
must be created outside CUDA-graph capture: any eager call with a split config does that, or call
`reserve_workspace(device)` before capturing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton_runtime.launch import INTERPRETED, CompiledLaunch
from triton_runtime.pdl import launch_dependents, pdl_supported, wait_for_previous
from triton_runtime.stream import current_stream

# Rows up to which `linear` uses the skinny kernel on CUDA (a power of two: a graph bucket boundary).
MAX_SKINNY_M = 64
CPU_SM_COUNT = 132  # H100/H200, assumed off CUDA (the interpreter)
TICKET_CAPACITY = 1 << 16
ROW_TICKET = TICKET_CAPACITY - 1  # the tickets before it are per N tile, this one counts finished tiles
# The most rows the FMA path takes (BLOCK_M = the bucket): each row's products over the same weight registers.
MAX_FMA_M = 2
# A preloaded weight slice lives in registers: 64 of them a thread, 8 KB a warp.
PRELOAD_BYTES_PER_WARP = 8192


# --------------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def prefetch_l2(ptrs):
    """Asks L2 for the lines at `ptrs` and moves on: nothing is read into registers, so weights can be
    fetched this way before a PDL wait, and the loads that use them after it hit L2."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                              [ptrs.to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def tile_product(x_ptr, w_ptr, w_rows, M, K, stride_xm, stride_wn, k_iters,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
                 PRELOAD_K: tl.constexpr):
    """split_product over this program's split of K, program_id(1)."""
    return split_product(x_ptr, w_ptr, w_rows, M, K, stride_xm, stride_wn, k_iters, tl.program_id(1),
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, DOT_FP32, NUM_STAGES, PDL, PRELOAD_K)


@triton.jit
def prefetch_stages(w_row_ptrs, k0, end, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Asks L2 for the first NUM_STAGES weight tiles from column k0 (columns past `end` clamped onto it): one
    pointer per 128-byte line, or per BLOCK_K run if shorter. Issued before a PDL wait."""
    LINE: tl.constexpr = 1024 // w_row_ptrs.dtype.element_ty.primitive_bitwidth
    STEP: tl.constexpr = LINE if LINE < BLOCK_K else BLOCK_K
    for stage in tl.static_range(NUM_STAGES):
        offs_line = k0 + stage * BLOCK_K + tl.arange(0, BLOCK_K // STEP) * STEP
        prefetch_l2(w_row_ptrs + tl.minimum(offs_line, end)[None, :])


@triton.jit
def load_tiles(w_ptrs, x_ptrs, mask_m, k_start, K, offs_k, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile and [BLOCK_M, BLOCK_K] x tile at column k_start (masked past K)."""
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0, eviction_policy="evict_last")
    else:
        mask_k = (k_start + offs_k) < K
        w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_last")
    return w, x


@triton.jit
def dot_into(acc, w, x, DOT_FP32: tl.constexpr):
    """acc + W x^T on the tensor cores ([BLOCK_N, BLOCK_M])."""
    if DOT_FP32:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def split_product(x_ptr, w_ptr, w_rows, M, K, stride_xm, stride_wn, k_iters, split,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
                  PRELOAD_K: tl.constexpr):
    """x[:BLOCK_M] @ W[w_rows]^T over split `split` of K (K blocks [split * k_iters, +k_iters)), from a zero
    accumulator: [BLOCK_M, BLOCK_N] fp32, column j from W row w_rows[j]. With PDL the split's first
    NUM_STAGES weight tiles go to L2 before the wait for the previous kernel, x is read after it.
    PRELOAD_K (the FMA path only: a power of two >= the split's k_iters * BLOCK_K columns): the program's
    whole [BLOCK_N, split] weight slice is loaded into registers up front (with PDL, before the wait); after
    the wait only x is read."""
    first = split * k_iters
    k0 = first * BLOCK_K
    if PRELOAD_K:
        offs_all = tl.arange(0, PRELOAD_K)
        in_k = (offs_all < k_iters * BLOCK_K) & (k0 + offs_all < K)
        w_all = tl.load(w_ptr + w_rows.to(tl.int64)[:, None] * stride_wn + (k0 + offs_all)[None, :],
                        mask=in_k[None, :], other=0.0, eviction_policy="evict_first")
        wait_for_previous(PDL)
        launch_dependents(PDL)
        if BLOCK_M == 1:
            x_all = tl.load(x_ptr + (k0 + offs_all)[None, :], mask=in_k[None, :], other=0.0,
                            eviction_policy="evict_last")
            return tl.sum(w_all.to(tl.float32) * x_all.to(tl.float32), axis=1)[None, :]
        # A few rows (MAX_FMA_M): each row's sum is the one-row sum, on the same registers of weight.
        offs_m = tl.arange(0, BLOCK_M)
        rows = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r in tl.static_range(BLOCK_M):
            x_r = tl.load(x_ptr + r * stride_xm + (k0 + offs_all)[None, :], mask=in_k[None, :] & (r < M),
                          other=0.0, eviction_policy="evict_last")
            row = tl.sum(w_all.to(tl.float32) * x_r.to(tl.float32), axis=1)
            rows = tl.where(offs_m[:, None] == r, row[None, :], rows)
        return rows
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    iters = tl.minimum(k_iters, tl.cdiv(K, BLOCK_K) - first)
    w_row_ptrs = w_ptr + w_rows.to(tl.int64)[:, None] * stride_wn
    if PDL:
        prefetch_stages(w_row_ptrs, k0, tl.minimum(k0 + iters * BLOCK_K, K) - 1, BLOCK_K, NUM_STAGES)
    wait_for_previous(PDL)
    launch_dependents(PDL)
    mask_m = offs_m < M
    w_ptrs = w_row_ptrs + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, iters, num_stages=NUM_STAGES):
        w, x = load_tiles(w_ptrs, x_ptrs, mask_m, k0 + i * BLOCK_K, K, offs_k, EVEN_K)
        if USE_DOT:
            acc = dot_into(acc, w, x, DOT_FP32)
        elif BLOCK_M == 1:  # x is [1, BLOCK_K]
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:  # a few rows (MAX_FMA_M), each on the same weight tile
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:
        return tl.trans(acc)
    elif BLOCK_M == 1:
        return tl.sum(acc, axis=1)[None, :]
    else:
        return tl.sum(acc, axis=2)


@triton.jit
def split_k_total(out, partials_ptr, tickets_ptr, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores this split's partial tile; returns whether this program is the last split of its N tile to
    finish (it took the tile's ticket last and put it back to 0), and then the tile's sum over the splits in
    split order 0, 1, ..: a fixed order, so bits do not depend on which split finishes last."""
    pid_n = tl.program_id(0)
    splits = tl.num_programs(1)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = (offs_m < M)[:, None]
    tile = BLOCK_M * BLOCK_N
    part = (pid_n.to(tl.int64) * splits) * tile + offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(partials_ptr + part + tl.program_id(1) * tile, out, mask=mask_m)
    # All threads' stores are done before one thread releases them with the ticket.
    tl.debug_barrier()
    last = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel") == splits - 1
    total = out
    if last:
        # Loads bypass L1 (.cg): other programs wrote these partials during this launch.
        total = tl.load(partials_ptr + part, mask=mask_m, other=0.0, cache_modifier=".cg")
        for s in range(1, splits):
            total += tl.load(partials_ptr + part + s * tile, mask=mask_m, other=0.0, cache_modifier=".cg")
        tl.store(tickets_ptr + pid_n, 0)
    return last, total


# M and k_iters unspecialized: one compiled variant serves every M of a bucket and any split length.
@triton.jit(do_not_specialize=["M", "k_iters"])
def skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr, partials_ptr, tickets_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, k_iters,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), splits): y = x @ W^T, tile pid_n holding W rows [pid_n * BLOCK_N, +BLOCK_N)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N are clamped onto row N - 1: the loads stay in bounds without a mask, and the stores
    # below drop those rows.
    w_rows = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    out = tile_product(x_ptr, w_ptr, w_rows, M, K, stride_xm, stride_wn, k_iters, BLOCK_M, BLOCK_N, BLOCK_K,
                       EVEN_K, USE_DOT, DOT_FP32, NUM_STAGES, PDL, PRELOAD_K)
    offs_m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        last, total = split_k_total(out, partials_ptr, tickets_ptr, M, BLOCK_M, BLOCK_N)
        if last:
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit(do_not_specialize=["M", "k_iters"])
def skippable_gemm_kernel(
    skip_ptr, x_ptr, w_ptr, y_ptr, partials_ptr, tickets_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, k_iters,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr,
):
    """skinny_gemm_kernel unless the flag at skip_ptr is set, in which case no program reads a weight or
    writes y. Launched without PDL: the flag is the previous kernel's output, read before anything else."""
    if tl.load(skip_ptr) == 0:
        skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, partials_ptr, tickets_ptr, M, N, K, stride_xm, stride_wn,
                           stride_ym, k_iters, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, EVEN_K, EVEN_N, USE_DOT,
                           DOT_FP32, NUM_STAGES, PDL, PRELOAD_K)


# M unspecialized: one compiled variant serves every row count.
@triton.jit(do_not_specialize=["M"])
def tiled_gemm_kernel(
    x_ptr, w_ptr, y_ptr, partials_ptr, tickets_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_iters, splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_FP32: tl.constexpr, NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits or 1): y = x @ W^T for any number of rows, one
    [BLOCK_M, BLOCK_N] tile a program (or, SPLIT_PROGRAMS, a split of one: the grid's second dimension),
    tiles walked GROUP_M row tiles at a time (the W tiles stay in L2 across them). Without SPLIT_PROGRAMS the
    program runs the splits of K one after the other; with it, each split is a program and the tile's last
    one sums them (split_k_total). Either way each split starts from a zero accumulator and the splits are
    added in order 0, 1, ..: exactly skinny_gemm_kernel's sum, so a row's bits are the same through either
    kernel and at any M, given the same splits and the same MMA per element. (One pipelined loop over all of
    K, adding at each split's end, measured slower at prompt sizes on the H100: the branch in the loop.)"""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = pid // group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + pid % group % rows_in_group
    pid_n = pid % group // rows_in_group
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    m0 = pid_m * BLOCK_M
    x_tile = x_ptr + m0.to(tl.int64) * stride_xm
    rows = M - m0
    offs_m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + (m0 + offs_m).to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y_mask = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
    if SPLIT_PROGRAMS:
        part = split_product(x_tile, w_ptr, w_rows, rows, K, stride_xm, stride_wn, k_iters, tl.program_id(1),
                             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, True, DOT_FP32, NUM_STAGES, PDL, 0)
        last, total = split_k_total(part, partials_ptr, tickets_ptr, rows, BLOCK_M, BLOCK_N)
        if last:
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        total = split_product(x_tile, w_ptr, w_rows, rows, K, stride_xm, stride_wn, k_iters, 0, BLOCK_M,
                              BLOCK_N, BLOCK_K, EVEN_K, True, DOT_FP32, NUM_STAGES, PDL, 0)
        for split in range(1, splits):
            total += split_product(x_tile, w_ptr, w_rows, rows, K, stride_xm, stride_wn, k_iters, split,
                                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, True, DOT_FP32, NUM_STAGES, False, 0)
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


# --------------------------------------------------------------------------------------------------
# Configs


@dataclasses.dataclass(frozen=True, slots=True)
class GemvConfig:
    """block_n W rows per program, block_k columns per step, split_k splits of K asked for (the launch
    uses fewer when K has fewer blocks), use_dot: tl.dot (M padded to >= 16) or fp32 FMAs (M <= MAX_FMA_M),
    preload: the FMA path loads each program's whole weight slice before reading x (with PDL, before waiting
    for the previous kernel); its block_n x split slice must fit 64 registers a thread. block_m: the rows of
    x a program takes on the tensor cores, whatever M (at least MAX_SKINNY_M for skinny_linear); None pads M
    to its bucket (and tiled_linear takes its TiledTile's)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    preload: bool = False
    block_m: int | None = None


def m_bucket(m: int) -> int:
    """Configs are chosen per power-of-two bucket of rows, the bucket's top being its padded size."""
    return 1 << max(0, m - 1).bit_length()


def auto_split(tiles: int, k_blocks: int, sm_count: int, min_blocks: int = 2) -> int:
    """Powers of two until the grid has about two programs per SM, keeping min_blocks K blocks each."""
    split = 1
    while tiles * split < 2 * sm_count and k_blocks >= 2 * split * min_blocks:
        split *= 2
    return split


def default_config(m: int, n: int, k: int, dtype: torch.dtype, sm_count: int = CPU_SM_COUNT) -> GemvConfig:
    """Guesses for Hopper before tuning: 16-32 KB W tiles per step, 3 stages, about two programs per SM."""
    bucket = m_bucket(m)
    if dtype == torch.float32:
        if bucket == 1:
            block_n, block_k, use_dot = 16, 128, False
        else:
            block_n, block_k, use_dot = 32, 32, True
    elif bucket == 1:
        block_n, block_k, use_dot = 16, 512, False
    elif bucket <= 16:
        block_n, block_k, use_dot = 32, 256, True
    else:
        block_n, block_k, use_dot = 64, 128, True
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    split = auto_split(triton.cdiv(n, block_n), triton.cdiv(k, block_k), sm_count)
    return GemvConfig(block_n, block_k, split, 4, 3, use_dot)


# Measured on the H200 by benchmarks/gemv.py (bf16, 2026-11-30; the run is in git history), which prints
# this table: (N, K) -> {M bucket: config}. A bucket without an entry takes the nearest measured bucket above
# it (dot configs pad M to at least 16, so buckets 2..16 run the same tile), else the nearest below;
# unlisted shapes and fp32 take default_config. The fractions in the comments are of a graph-captured
# memcpy's rate (2.76 TB/s); against the 4.22 TB/s event-timed copy multiply them by 0.65.
# The one-row preload configs were chosen by decode TPOT instead (benchmarks/decode_ab.py; docs/h200.md,
# "One row"): what preloading buys is overlap with the kernel before, which a chain of one
# projection's calls does not show. qkv, o and gate_up preloaded took batch-1 TPOT from 4.73 to 4.06 ms at
# 512 tokens of context and from 5.63 to 4.76 at 2K; down preloaded in 3 splits cost 1.6-3.4% more.
# Two rows take the FMA path too (MAX_FMA_M, each row its one-row sum) with the one-row configs at bucket 2,
# chosen by decode TPOT on an H100 (2026-12-07, 512 tokens of context, against bucket 4's tensor-core
# configs): plain decode of two rows 5.79 -> 5.64 ms, pipelined self-speculation at batch 1 (a pass of two
# rows) 3.52 -> 3.39 ms a token with every draft accepted and 6.80 -> 6.53 with none; one row unchanged.
TUNED: dict[tuple[int, int], dict[int, GemvConfig]] = {
    (6144, 2048): {  # qkv
        1: GemvConfig(8, 512, 1, 4, 3, False, preload=True),  # by engine TPOT (above)
        2: GemvConfig(8, 512, 1, 4, 3, False, preload=True),  # by engine TPOT (above)
        4: GemvConfig(64, 128, 2, 4, 4, True),  # 9.4 us, 0.97 of copy
        16: GemvConfig(32, 256, 1, 4, 3, True),  # 9.6 us, 0.96 of copy
        64: GemvConfig(64, 64, 2, 4, 4, True),  # 11.8 us, 0.80 of copy
    },
    (2048, 2048): {  # o
        1: GemvConfig(8, 512, 1, 4, 4, False, preload=True),  # by engine TPOT
        2: GemvConfig(8, 512, 1, 4, 4, False, preload=True),  # by engine TPOT
        4: GemvConfig(64, 128, 4, 4, 4, True),  # 5.5 us, 0.55 of copy
        16: GemvConfig(64, 128, 4, 4, 4, True),  # 5.7 us, 0.54 of copy
        64: GemvConfig(64, 128, 4, 4, 3, True),  # 7.7 us, 0.42 of copy
    },
    (11264, 2048): {  # gate_up
        1: GemvConfig(8, 512, 1, 4, 3, False, preload=True),  # by engine TPOT
        2: GemvConfig(8, 512, 1, 4, 3, False, preload=True),  # by engine TPOT
        4: GemvConfig(64, 128, 1, 4, 4, True),  # 13.4 us, 1.25 of copy
        16: GemvConfig(64, 128, 1, 4, 4, True),  # 13.8 us, 1.22 of copy
        64: GemvConfig(64, 128, 1, 4, 3, True),  # 15.8 us, 1.09 of copy
    },
    (2048, 5632): {  # down
        1: GemvConfig(8, 512, 1, 4, 4, False),  # 7.8 us, 1.07 of copy; preloading in 3 splits lost
        2: GemvConfig(8, 512, 1, 4, 4, False),  # by engine TPOT
        4: GemvConfig(64, 128, 4, 4, 4, True),  # 9.1 us, 0.92 of copy
        16: GemvConfig(64, 128, 4, 4, 4, True),  # 9.3 us, 0.91 of copy
        64: GemvConfig(64, 128, 4, 4, 3, True),  # 11.6 us, 0.75 of copy
    },
    (49152, 2048): {  # lm_head
        1: GemvConfig(16, 512, 1, 4, 3, False),  # 47.9 us, 1.52 of copy
        4: GemvConfig(64, 128, 1, 4, 4, True),  # 48.5 us, 1.50 of copy
        16: GemvConfig(64, 128, 1, 4, 4, True),  # 49.9 us, 1.47 of copy
        64: GemvConfig(64, 64, 1, 4, 4, True),  # 53.6 us, 1.40 of copy
    },
}


def select_config(m: int, n: int, k: int, dtype: torch.dtype, sm_count: int = CPU_SM_COUNT) -> GemvConfig:
    bucket = m_bucket(m)
    table = TUNED.get((n, k)) if dtype in (torch.bfloat16, torch.float16) else None
    if table:
        above = [b for b in table if b >= bucket]
        config = table[min(above)] if above else table[max(table)]
        if config.use_dot or bucket <= MAX_FMA_M:
            return config
    return default_config(m, n, k, dtype, sm_count)


# Batch-invariant configs (Engine(deterministic=True)): one config per weight shape for every row count, so
# that a row's bits do not depend on how many rows share the call. Every output element is then the same
# chain of tensor-core products over the same K splits, summed in split order, through skinny_gemm_kernel up
# to MAX_SKINNY_M rows and tiled_gemm_kernel beyond (which runs the splits inside one program). The FMA path
# is out: its one-row reduction orders the products otherwise. The Ouro-1.4B shapes take TUNED's tensor-core
# entries for 4 to 16 rows, except that qkv runs K unsplit (as TUNED's 16-row entry does): by engine TPOT on
# one H100 (benchmarks/results/2026-12-06.md, session 38) batch 1 took 1.122x / 1.102x of the default at 512 /
# 2K of context against 1.127x / 1.112x in 2 splits (another H100: 1.113x / 1.125x against 1.145x / 1.159x),
# and prefill at 1 x 8K 1.172x against 1.189x (past 256 rows an unsplit weight takes 256 x 128 tiles). down in
# 8 splits ran 0.6-1.2% faster at batch 1 in one probe and 1.3% at 8K, but in three engines side by side (the
# default, this table, down in 8; session 40) batch 1 took 1.127x / 1.131x at 512 / 2K against this table's
# 1.130x / 1.131x, and at 16 / 64 x 512 1.005x / 0.973x (this table: 1.02x / 0.975x, the next run): not
# kept. o in 2 or 8 splits and gate_up in 2 were slower. Other shapes take invariant_config's rule.
INVARIANT_TUNED: dict[tuple[int, int], GemvConfig] = {
    (6144, 2048): GemvConfig(64, 128, 1, 4, 4, True),  # qkv
    (2048, 2048): GemvConfig(64, 128, 4, 4, 4, True),  # o
    (11264, 2048): GemvConfig(64, 128, 1, 4, 4, True),  # gate_up
    (2048, 5632): GemvConfig(64, 128, 4, 4, 4, True),  # down
    (49152, 2048): GemvConfig(64, 128, 1, 4, 4, True),  # lm_head
}


@dataclasses.dataclass(frozen=True, slots=True)
class TiledTile:
    """How tiled_gemm_kernel runs a config: its tile (block_m rows x block_n W rows), warps, stages, row
    tiles a group walks (the W tiles stay in L2 across them), whether each split of K is a program of its
    own (split_programs) or the tile's program runs them all, and block_k: the columns a step takes, a divisor
    of the config's block_k (None, or not below the config's, as for fp32 configs' 32: the config's). The
    splits are the config's. None of these changes a bit of the result on a GPU, where tl.dot adds its k16
    MMAs (or FMAs) into the accumulator one after the other whatever the K block; the interpreter's numpy
    product sums a block apart, so there the config's block_k is taken."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_programs: bool = False
    block_k: int | None = None


# Measured on one H100 by benchmarks/invariant_gemm.py (cold L2; benchmarks/results/2026-12-06.md, its
# 2026-12-06 and 2026-12-07 sections): at 128 rows a weight split in K (qkv, o, down) took 128 x 64 tiles with
# a program a split in 25.7-37.2 µs, against 37.1-67.5 for 128 x 128 tiles that run the splits in one
# program (o and down have only 16 such tiles on 132 SMs). Past 256 rows a K block of 64 (the config's is
# 128) lets the tiles grow and the pipeline deepen in the same shared memory: split weights took 128 x 128
# tiles with 4 stages (at 2K rows: o 58 against 83 µs, down 110 against 131), unsplit ones (gate_up,
# lm_head) 256 x 128 tiles (gate_up at 8K rows: 654 against 862 µs; cuBLAS 518). Bigger tiles lose on split
# weights: a tile's program restarts its pipeline at each split. Unsplit weights up to 256 rows keep
# 128 x 128 tiles of the config's K block. cuBLAS stays 1.0-1.6x faster.
SPLIT_TILE_ROWS = 256
SPLIT_TILE = TiledTile(128, 64, 4, 3, split_programs=True)
ROWS_TILE = TiledTile(128, 128, 8, 3)
SPLIT_PROMPT_TILE = TiledTile(128, 128, 8, 4, block_k=64)
PROMPT_TILE = TiledTile(256, 128, 8, 3, block_k=64)


def tiled_tile(m: int, splits: int) -> TiledTile:
    """tiled_linear's tile for m rows of a config with `splits` splits of K."""
    if m <= SPLIT_TILE_ROWS:
        return SPLIT_TILE if splits > 1 else ROWS_TILE
    return SPLIT_PROMPT_TILE if splits > 1 else PROMPT_TILE


def invariant_config(n: int, k: int, dtype: torch.dtype, sm_count: int = CPU_SM_COUNT) -> GemvConfig:
    """The one config of an [N, K] weight for every row count (INVARIANT_TUNED, else 64 W rows a program,
    16-32 KB weight tiles, and splits for about two programs per SM at one row)."""
    if dtype in (torch.bfloat16, torch.float16) and (n, k) in INVARIANT_TUNED:
        config = INVARIANT_TUNED[n, k]
    else:
        block_n, block_k = 64, min(128 if dtype.itemsize == 2 else 32, max(16, triton.next_power_of_2(k)))
        split = auto_split(triton.cdiv(n, block_n), triton.cdiv(k, block_k), sm_count)
        config = GemvConfig(block_n, block_k, split, 4, 3, True)
    if INTERPRETED:  # numpy's product of a transposed operand orders its sums by that operand's width
        config = dataclasses.replace(config, block_m=MAX_SKINNY_M)
    return config


def block_m_for(m: int, config: GemvConfig) -> int:
    bucket = m_bucket(m)
    if not config.use_dot:
        if bucket > MAX_FMA_M:
            raise ValueError(f"the FMA path (use_dot=False) takes at most {MAX_FMA_M} rows, got {m}")
        return bucket
    if config.block_m is not None:
        if config.block_m < m:
            raise ValueError(f"{config} takes at most {config.block_m} rows a program, got {m}")
        return config.block_m
    return max(16, bucket)


# --------------------------------------------------------------------------------------------------
# Workspace


class _Workspace:
    """Per device: int32 tickets (zero between launches) and grow-only fp32 partials. Buffers that are
    outgrown are kept: plans and captured graphs may still point at them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tickets: torch.Tensor | None = None
        self.partials: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []
        # Typed stand-ins for launches without a split (never read or written).
        self.dummy_partials = torch.empty(1, dtype=torch.float32, device=device)
        self.dummy_tickets = torch.empty(1, dtype=torch.int32, device=device)

    def get(self, partials_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tickets is None:
            if _capturing(self.device):
                raise RuntimeError("skinny_linear's split-K tickets must be created outside CUDA-graph "
                                   "capture: run the shapes once eagerly first, or call reserve_workspace()")
            self.tickets = torch.zeros(TICKET_CAPACITY, dtype=torch.int32, device=self.device)
        if self.partials is None or self.partials.numel() < partials_numel:
            if self.partials is not None:
                self.retired.append(self.partials)
            # Inside a capture this comes from the graph's pool; being kept, it stays valid after.
            self.partials = torch.empty(max(partials_numel, 1 << 16), dtype=torch.float32, device=self.device)
        return self.partials, self.tickets


_WORKSPACES: dict[torch.device, _Workspace] = {}


def _workspace(device: torch.device) -> _Workspace:
    workspace = _WORKSPACES.get(device)
    if workspace is None:
        workspace = _WORKSPACES[device] = _Workspace(device)
    return workspace


def reserve_workspace(device: torch.device | str, partials_numel: int = 1 << 20) -> None:
    """Creates the device's workspace now (outside graph capture): tickets and 4 MB of partials."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _workspace(device).get(partials_numel)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass(slots=True)
class Plan:
    """One call shape of a skinny GEMM kernel: its launch, workspace and the arguments after the pointers."""

    launch: CompiledLaunch
    partials: torch.Tensor
    tickets: torch.Tensor
    tail: tuple  # M, N, K, strides, k_iters, the constexprs and PDL


_PLANS: dict[tuple, Plan] = {}


def k_splits(k: int, config: GemvConfig) -> tuple[int, int, int]:
    """How a config cuts K: (block_k, k_iters: the K blocks a split runs, splits: how many splits run), the
    last split shorter where the blocks do not divide evenly."""
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    k_blocks = triton.cdiv(k, block_k)
    k_iters = triton.cdiv(k_blocks, max(1, min(config.split_k, k_blocks)))
    return block_k, k_iters, triton.cdiv(k_blocks, k_iters)


def kernel_args(m: int, n: int, k: int, stride_xm: int, stride_wn: int, stride_ym: int, dtype: torch.dtype,
                config: GemvConfig, pdl: bool = False) -> tuple[tuple[int, int, int], tuple]:
    """The grid and the arguments after the pointers, for one call shape and config."""
    block_m = block_m_for(m, config)
    block_n = config.block_n
    block_k, k_iters, splits = k_splits(k, config)
    tiles = triton.cdiv(n, block_n)
    if splits > 1 and tiles > ROW_TICKET:
        raise ValueError(f"{tiles} N tiles exceed the {ROW_TICKET} split-K tickets; use split_k=1")
    dot_fp32 = dtype == torch.float32 or INTERPRETED
    preload_k = 0
    if config.preload:
        preload_k = triton.next_power_of_2(k_iters * block_k)  # one split's columns
        slice_bytes = block_n * preload_k * dtype.itemsize
        if config.use_dot or slice_bytes > PRELOAD_BYTES_PER_WARP * config.num_warps:
            raise ValueError(f"preload takes the FMA path and at most {PRELOAD_BYTES_PER_WARP} weight bytes "
                             f"a warp (block_n x a split's columns, padded to a power of 2); got {config} at "
                             f"K = {k} in {dtype}")
    tail = (m, n, k, stride_xm, stride_wn, stride_ym, k_iters, block_m, block_n, block_k, splits > 1,
            k % block_k == 0, n % block_n == 0, config.use_dot, dot_fp32, config.num_stages, pdl, preload_k)
    return (tiles, splits, 1), tail


def check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    """x [M, K] and weight [N, K]: one supported dtype, contiguous rows, a device the kernels run on."""
    if weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
                         "x[M, K] @ W[N, K]^T")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dimension")
    if x.device.type == "cpu" and not INTERPRETED:
        raise ValueError("the skinny GEMM kernels run on CPU only under TRITON_INTERPRET=1")


def build_plan(kernel, x: torch.Tensor, weight: torch.Tensor, stride_ym: int, config: GemvConfig | None,
               row_ticket: bool = False, pdl: bool = True) -> Plan:
    """A plan for `kernel` (skinny_gemm_kernel or a variant: its pointers, with a variant's own before or
    after them, then the same tail) on operands that check_operands accepted. row_ticket: the kernel takes
    the row ticket, so it needs the tickets even without a split. pdl: False launches without PDL even where
    the device has it."""
    m, k = x.shape
    n = weight.shape[0]
    device = x.device
    if config is None:
        sm_count = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                    else CPU_SM_COUNT)
        config = select_config(m, n, k, x.dtype, sm_count)
    pdl = pdl and pdl_supported(device)
    grid, tail = kernel_args(m, n, k, x.stride(0), weight.stride(0), stride_ym, x.dtype, config, pdl)
    workspace = _workspace(device)
    partials, tickets = workspace.dummy_partials, workspace.dummy_tickets
    if grid[1] > 1 or row_ticket:
        partials, tickets = workspace.get(grid[0] * grid[1] * tail[7] * tail[8])
    options = {"launch_pdl": True} if pdl else {}
    launch = CompiledLaunch(kernel, grid, config.num_warps, config.num_stages, **options)
    return Plan(launch, partials, tickets, tail)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  config: GemvConfig | None = None, skip: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T for x [..., K] (few rows) and weight [N, K], fp32 accumulation, y in x's dtype.
    `config` overrides the tuned/default choice (benchmarks and tests). skip: a one-element bool flag on the
    device; where it is set when the kernel runs, y is left as it was (skippable_gemm_kernel)."""
    shape = x.shape
    if x.dim() != 2:
        x = x.reshape(-1, shape[-1])
    m = x.shape[0]
    n = weight.shape[0]
    if out is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        y = out if out.dim() == 2 else out.view(-1, n)
    if m == 0:
        return y.view(*shape[:-1], n)
    # Everything Triton specializes on: exact ints, and each pointer's 16-byte alignment.
    key = (m, n, shape[-1], x.dtype, weight.dtype, y.dtype, x.device, x.stride(0), weight.stride(0),
           y.stride(0), x.data_ptr() & 15, weight.data_ptr() & 15, y.data_ptr() & 15, config,
           None if skip is None else skip.data_ptr() & 15)
    plan = _PLANS.get(key)
    if plan is None:
        check_operands(x, weight)
        if y.dtype != x.dtype or y.shape != (m, n) or y.stride(1) != 1:
            raise ValueError(f"out must be [{m}, {n}] in {x.dtype} with a contiguous last dimension, got "
                             f"{tuple(y.shape)} in {y.dtype}")
        if skip is not None and (skip.dtype != torch.bool or skip.numel() != 1 or skip.device != x.device):
            raise ValueError(f"skip must be one bool on {x.device}, got {tuple(skip.shape)} {skip.dtype} on "
                             f"{skip.device}")
        kernel = skinny_gemm_kernel if skip is None else skippable_gemm_kernel
        plan = build_plan(kernel, x, weight, y.stride(0), config, pdl=skip is None)
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = plan
    pointers = (x, weight, y, plan.partials, plan.tickets)
    if skip is not None:
        pointers = (skip,) + pointers
    plan.launch(current_stream(x.device), pointers + plan.tail)
    if out is not None:
        return out
    return y if len(shape) == 2 else y.view(*shape[:-1], n)


_TILED_PLANS: dict[tuple, tuple[CompiledLaunch, tuple]] = {}


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig,
                 out: torch.Tensor | None = None, tile: TiledTile | None = None) -> torch.Tensor:
    """y = x @ weight^T for x [M, K] with any M, by tiled_gemm_kernel: the bits skinny_linear gives with the
    same (tensor-core) config. y in x's dtype (in `out` where given, [M, N] with a contiguous last
    dimension). `tile`: overrides tiled_tile's choice (benchmarks); config.block_m, where set, its block_m."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    key = (m, n, k, x.dtype, weight.dtype, y.dtype, x.device, x.stride(0), weight.stride(0), y.stride(0),
           x.data_ptr() & 15, weight.data_ptr() & 15, y.data_ptr() & 15, config, tile)
    plan = _TILED_PLANS.get(key)
    if plan is None:
        check_operands(x, weight)
        if not config.use_dot:
            raise ValueError(f"tiled_linear takes tensor-core configs (use_dot=True), got {config}")
        if y.dtype != x.dtype or y.shape != (m, n) or y.stride(1) != 1:
            raise ValueError(f"out must be [{m}, {n}] in {x.dtype} with a contiguous last dimension, got "
                             f"{tuple(y.shape)} in {y.dtype}")
        plan = _tiled_plan(x, weight, y, config, tile)
        if len(_TILED_PLANS) > 4096:
            _TILED_PLANS.clear()
        _TILED_PLANS[key] = plan
    launch, partials, tickets, tail = plan
    launch(current_stream(x.device), (x, weight, y, partials, tickets) + tail)
    return y


def _tiled_plan(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, config: GemvConfig,
                tile: TiledTile | None) -> tuple[CompiledLaunch, torch.Tensor, torch.Tensor, tuple]:
    m, k = x.shape
    n = weight.shape[0]
    _, tail = kernel_args(1, n, k, x.stride(0), weight.stride(0), y.stride(0), x.dtype, config)
    block_k, k_iters, splits = k_splits(k, config)
    tile = tile or tiled_tile(m, splits)
    if tile.block_k and tile.block_k < block_k and not INTERPRETED:
        if block_k % tile.block_k:
            raise ValueError(f"the tile's block_k {tile.block_k} does not divide the config's {block_k}")
        k_iters *= block_k // tile.block_k
        block_k = tile.block_k
    block_m = config.block_m or tile.block_m
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, tile.block_n)
    split_programs = tile.split_programs and splits > 1
    workspace = _workspace(x.device)
    partials, tickets = workspace.dummy_partials, workspace.dummy_tickets
    if split_programs:
        if tiles > ROW_TICKET:
            raise ValueError(f"{tiles} tiles exceed the {ROW_TICKET} split-K tickets; use a tile of "
                             "split_programs=False")
        partials, tickets = workspace.get(tiles * splits * block_m * tile.block_n)
    pdl = pdl_supported(x.device)
    options = {"launch_pdl": True} if pdl else {}
    grid = (tiles, splits if split_programs else 1, 1)
    launch = CompiledLaunch(tiled_gemm_kernel, grid, tile.num_warps, tile.num_stages, **options)
    return launch, partials, tickets, (m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_iters, splits,
                                       block_m, tile.block_n, block_k, k % block_k == 0,
                                       n % tile.block_n == 0, tail[14], tile.num_stages, tile.group_m, pdl,
                                       split_programs)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig,
                     out: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T with every row's bits independent of the other rows and of their number: `config`
    (invariant_config's) through skinny_linear up to MAX_SKINNY_M rows and tiled_linear beyond. x [..., K].
    skip: skinny_linear's (tiled_linear computes y anyway)."""
    shape = x.shape
    if x.dim() != 2:
        x = x.reshape(-1, shape[-1])
    if x.shape[0] <= MAX_SKINNY_M:
        y = skinny_linear(x, weight, out, config, skip)
    else:
        y = tiled_linear(x, weight, config, out)
    return y if len(shape) == 2 else y.view(*shape[:-1], weight.shape[0])


def skinny_ok(x: torch.Tensor, weight: torch.Tensor, max_m: int = MAX_SKINNY_M) -> bool:
    """Whether `linear` takes the skinny kernel for these operands."""
    if not (x.is_cuda or INTERPRETED) or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    return 0 < m <= max_m and x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.dim() == 2


ENABLED = True  # benchmarks flip this for cuBLAS A/B runs


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           skip: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear without bias, through the skinny kernel for up to MAX_SKINNY_M rows on CUDA (off CUDA,
    always F.linear: tests call skinny_linear directly under the interpreter). skip: skinny_linear's (a flag
    that may leave y unwritten; F.linear computes it anyway)."""
    if ENABLED and x.is_cuda and skinny_ok(x, weight):
        return skinny_linear(x, weight, out, skip=skip)
    if out is None:
        return F.linear(x, weight)
    return torch.matmul(x, weight.t(), out=out)
