"""The skinny GEMM (model/kernels/gemv.py) with a decode layer's elementwise work in its epilogue, so that a
layer at batch 1 is 4 model launches plus attention (past MAX_NORM_EPILOGUE_M rows, 6: the norms below are
faster as launches of their own):
- qkv_rope: the qkv projection, with RoPE on the q and k heads;
- linear_add_norms: the o or down projection, then the post-norm, its residual add and the next pre-norm
  (fused.add_rmsnorm_rmsnorm's work), done by the tile that finishes last, since a norm needs the whole row;
- gate_up_silu: the gate_up projection, with SiLU(gate) * up.
Huginn's blocks (model/huginn_fused.py) take them with options: a q/k bias and an fp32 rotation in qkv_rope;
the norm after the residual add, and no next norm after a stack's last block, in linear_add_norms.

Paired rows. RoPE pairs each head's element j with j + D/2; SiLU-mul pairs gate row j with up row I + j. A
program loads its tile's W rows interleaved by pair, [a0, b0, a1, b1, ..], so one dot of the plain kernel's
shape yields both members of every pair, which the epilogue splits apart. Each output element is computed as
the plain kernel computes it (same config, K order and splits), then rounded to the model dtype before the
elementwise math, as the unfused path rounds the GEMM's output. The elementwise math is fused.py's.

Row ticket. In linear_add_norms each N tile's final program (its last split) stores the tile's rounded output
into `normed`, which stages it, and takes the row ticket (gemv.ROW_TICKET). The program that takes it last
reads the rows back and writes h and normed, one row after another as rmsnorm_kernel computes a row, then
puts the ticket back to 0. Every row is summed in one fixed order, whichever program finishes last, so
results are bitwise reproducible (eager or CUDA graph) and a row's bits do not depend on the other rows.
That tail is one program's work over all M rows: MAX_NORM_EPILOGUE_M bounds the rows that take this path
in a layer.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import triton
import triton.language as tl

from model.kernels.fused import PRECISE, rms_normalize, rotate_half, round_to, silu_times
from model.kernels.gemv import (ROW_TICKET, GemvConfig, Plan, build_plan, check_operands, prefetch_l2,
                                skinny_ok, split_k_total, tile_product)
from triton_runtime.stream import current_stream

# The rows the epilogue variants take (a graph bucket boundary).
MAX_EPILOGUE_M = 16
# The rows the norm epilogue takes. Its tail is one program's work over all M rows, while the norm kernel
# spreads rows over SMs: on the H200 (benchmarks/epilogue_rows.py, in graph chains with PDL) the GEMM then the
# norm kernel took 6.4-6.6 µs (o) and 9.8-10.2 µs (down) at 2-16 rows against 7.9-17.8 and 11.9-22.7 for the
# epilogue; at one row 5.6 against 5.9 and 9.2 against 9.8. Layers (model/ouro_fused.py) launch the norm
# kernel past this many rows; at one row the saved launches keep a layer application at 5 kernels. Two rows
# on the one-row FMA configs (GEMV TUNED's bucket 2) change nothing: on one H100, down took 11.3 µs with the
# norm kernel against 14.2 in the epilogue, and pipelined self-speculation at batch 1 (two rows a pass) ran
# the same 3.17-3.20 ms a token either way (2026-12-07).
MAX_NORM_EPILOGUE_M = 1
_ROW_TICKET = tl.constexpr(ROW_TICKET)


# --------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def paired_rows(span, pairs, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Tile program_id(0)'s W rows in pair order [a(p0), b(p0), a(p1), ..] and its pairs p. Pair p is rows
    a = (p // span) * 2 span + p % span and b = a + span: a head's rotate-half halves (span = D / 2), or
    gate row p and up row p (span = I). Pairs past the last are clamped onto it (loads in bounds, stores
    masked)."""
    BLOCK_P: tl.constexpr = BLOCK_N // 2
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    lane = tl.arange(0, BLOCK_N)
    pair = tl.program_id(0) * BLOCK_P + lane // 2
    if not EVEN_N:
        pair = tl.minimum(pair, pairs - 1)
    return (pair // span) * (2 * span) + pair % span + (lane % 2) * span, offs_p


@triton.jit
def _unpair(tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile of pair-ordered columns as its two members, [BLOCK_M, BLOCK_N / 2] each."""
    return tl.split(tl.reshape(tile, [BLOCK_M, BLOCK_N // 2, 2]))


@triton.jit
def _store_rotated(tile, y_ptr, cos_ptr, sin_ptr, bias_ptr, offs_p, M, pairs, rotated_pairs, stride_ym,
                   stride_cos, stride_sin, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
                   PRECISE: tl.constexpr, HAS_BIAS: tl.constexpr, ROPE_FP32: tl.constexpr):
    """Rounds the tile to y's dtype, rotates the pairs of q and k heads (p < rotated_pairs) and stores every
    pair at its two columns of y. HAS_BIAS: the q and k heads' bias (bias_ptr: one per rotated column) is
    added in y's dtype before the rotation. ROPE_FP32: the rotation rounds once, to y's dtype, at its end
    (Huginn's apply_rope, in fp32) instead of after every product and the sum (Ouro's, in the model dtype)."""
    dtype = y_ptr.dtype.element_ty
    x1, x2 = _unpair(tile, BLOCK_M, BLOCK_N)
    x1, x2 = round_to(x1, dtype), round_to(x2, dtype)
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)[:, None]
    j = (offs_p % HALF)[None, :]
    columns = ((offs_p // HALF) * (2 * HALF) + offs_p % HALF)[None, :]  # each pair's first column
    rotated = (offs_p < rotated_pairs)[None, :]
    mask = (offs_m < M) & (offs_p < pairs)[None, :]
    cos, sin = cos_ptr + offs_m * stride_cos + j, sin_ptr + offs_m * stride_sin + j
    tables = mask & rotated
    cos1 = tl.load(cos, mask=tables, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + HALF, mask=tables, other=0.0).to(tl.float32)
    sin1 = tl.load(sin, mask=tables, other=0.0).to(tl.float32)
    sin2 = tl.load(sin + HALF, mask=tables, other=0.0).to(tl.float32)
    r1, r2 = x1, x2
    if HAS_BIAS:
        r1 = round_to(r1 + tl.load(bias_ptr + columns, mask=tables, other=0.0).to(tl.float32), dtype)
        r2 = round_to(r2 + tl.load(bias_ptr + columns + HALF, mask=tables, other=0.0).to(tl.float32), dtype)
    if ROPE_FP32:
        out1, out2 = rotate_half(r1, r2, cos1, cos2, sin1, sin2, tl.float32, PRECISE)
    else:
        out1, out2 = rotate_half(r1, r2, cos1, cos2, sin1, sin2, dtype, PRECISE)
    y = y_ptr + offs_m * stride_ym + columns
    tl.store(y, tl.where(rotated, out1.to(dtype), x1.to(dtype)), mask=mask)
    tl.store(y + HALF, tl.where(rotated, out2.to(dtype), x2.to(dtype)), mask=mask)


# M and k_iters unspecialized, as in skinny_gemm_kernel.
@triton.jit(do_not_specialize=["M", "k_iters"])
def skinny_gemm_rope_kernel(
    x_ptr, w_ptr, y_ptr, partials_ptr, tickets_ptr, cos_ptr, sin_ptr, bias_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, k_iters,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr,
    stride_cos, stride_sin, rotated_pairs, HALF: tl.constexpr, PRECISE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROPE_FP32: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), splits): y = x @ W^T laid out as the qkv projection's output [M, N], RoPE
    applied to its first `rotated_pairs` pairs (the q and k heads), after their bias with HAS_BIAS; cos and
    sin rows [D] per token."""
    rows, offs_p = paired_rows(HALF, N // 2, BLOCK_N, EVEN_N)
    out = tile_product(x_ptr, w_ptr, rows, M, K, stride_xm, stride_wn, k_iters, BLOCK_M, BLOCK_N, BLOCK_K,
                       EVEN_K, USE_DOT, DOT_FP32, NUM_STAGES, PDL, PRELOAD_K)
    if SPLIT:
        last, total = split_k_total(out, partials_ptr, tickets_ptr, M, BLOCK_M, BLOCK_N)
        if last:
            _store_rotated(total, y_ptr, cos_ptr, sin_ptr, bias_ptr, offs_p, M, N // 2, rotated_pairs,
                           stride_ym, stride_cos, stride_sin, BLOCK_M, BLOCK_N, HALF, PRECISE, HAS_BIAS,
                           ROPE_FP32)
    else:
        _store_rotated(out, y_ptr, cos_ptr, sin_ptr, bias_ptr, offs_p, M, N // 2, rotated_pairs, stride_ym,
                       stride_cos, stride_sin, BLOCK_M, BLOCK_N, HALF, PRECISE, HAS_BIAS, ROPE_FP32)


@triton.jit
def _store_silu_mul(tile, y_ptr, offs_p, M, pairs, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISE: tl.constexpr):
    dtype = y_ptr.dtype.element_ty
    gate, up = _unpair(tile, BLOCK_M, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)[:, None]
    tl.store(y_ptr + offs_m * stride_ym + offs_p[None, :],
             silu_times(round_to(gate, dtype), round_to(up, dtype), dtype, PRECISE),
             mask=(offs_m < M) & (offs_p < pairs)[None, :])


@triton.jit(do_not_specialize=["M", "k_iters"])
def skinny_gemm_silu_mul_kernel(
    x_ptr, w_ptr, y_ptr, partials_ptr, tickets_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, k_iters,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr, PRECISE: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), splits): y [M, N / 2] = silu(gate) * up with [gate, up] = x @ W^T, W's first
    N / 2 rows the gate's and the rest the up's."""
    rows, offs_p = paired_rows(N // 2, N // 2, BLOCK_N, EVEN_N)
    out = tile_product(x_ptr, w_ptr, rows, M, K, stride_xm, stride_wn, k_iters, BLOCK_M, BLOCK_N, BLOCK_K,
                       EVEN_K, USE_DOT, DOT_FP32, NUM_STAGES, PDL, PRELOAD_K)
    if SPLIT:
        last, total = split_k_total(out, partials_ptr, tickets_ptr, M, BLOCK_M, BLOCK_N)
        if last:
            _store_silu_mul(total, y_ptr, offs_p, M, N // 2, stride_ym, BLOCK_M, BLOCK_N, PRECISE)
    else:
        _store_silu_mul(out, y_ptr, offs_p, M, N // 2, stride_ym, BLOCK_M, BLOCK_N, PRECISE)


@triton.jit
def _add_norms_rows(normed_ptr, residual_ptr, weight_ptr, next_weight_ptr, out_ptr, M, stride_normed,
                    stride_residual, stride_out, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                    PRECISE: tl.constexpr, NORM_AFTER_ADD: tl.constexpr, NEXT_NORM: tl.constexpr):
    """For every row, as rmsnorm_kernel computes one: out = residual + RMSNorm(y) * weight (NORM_AFTER_ADD:
    RMSNorm(residual + y) * weight), with y staged in normed, then with NEXT_NORM normed = RMSNorm(out) *
    next_weight over it. A row's loads are issued a row ahead."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NEXT_NORM:
        next_weight = tl.load(next_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y_ptrs, residual_ptrs, out_ptrs = normed_ptr + offs, residual_ptr + offs, out_ptr + offs
    # Loads bypass L1 (.cg): other programs staged these rows during this launch.
    y = tl.load(y_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    residual = tl.load(residual_ptrs, mask=mask, other=0.0)
    for m in range(M):
        ahead = mask & (m + 1 < M)
        y_next = tl.load(y_ptrs + stride_normed, mask=ahead, other=0.0, cache_modifier=".cg")
        residual_next = tl.load(residual_ptrs + stride_residual, mask=ahead, other=0.0)
        if NORM_AFTER_ADD:
            h = round_to(residual.to(tl.float32) + y.to(tl.float32), dtype)
            h = rms_normalize(h, weight, eps, HIDDEN, dtype, PRECISE)
        else:
            h = rms_normalize(y.to(tl.float32), weight, eps, HIDDEN, dtype, PRECISE)
            h = round_to(residual.to(tl.float32) + h, dtype)
        tl.store(out_ptrs, h.to(dtype), mask=mask)
        if NEXT_NORM:
            tl.store(y_ptrs, rms_normalize(h, next_weight, eps, HIDDEN, dtype, PRECISE).to(dtype), mask=mask)
        y, residual = y_next, residual_next
        y_ptrs += stride_normed
        residual_ptrs += stride_residual
        out_ptrs += stride_out


@triton.jit
def _finish_tile(tile, normed_ptr, tickets_ptr, residual_ptr, weight_ptr, next_weight_ptr, out_ptr, offs_n,
                 M, N, stride_normed, stride_residual, stride_out, eps, BLOCK_M: tl.constexpr,
                 HIDDEN: tl.constexpr, NORM_BLOCK: tl.constexpr, PRECISE: tl.constexpr,
                 NORM_AFTER_ADD: tl.constexpr, NEXT_NORM: tl.constexpr):
    """Stages the tile, rounded, in normed and takes the row ticket; the tile finishing last does the rows."""
    offs_m = tl.arange(0, BLOCK_M)
    staged = normed_ptr + offs_m.to(tl.int64)[:, None] * stride_normed + offs_n[None, :]
    tl.store(staged, tile.to(normed_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    # All threads' stores are done before one thread releases them with the ticket.
    tl.debug_barrier()
    if tl.atomic_add(tickets_ptr + _ROW_TICKET, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        _add_norms_rows(normed_ptr, residual_ptr, weight_ptr, next_weight_ptr, out_ptr, M, stride_normed,
                        stride_residual, stride_out, eps, HIDDEN, NORM_BLOCK, PRECISE, NORM_AFTER_ADD,
                        NEXT_NORM)
        tl.store(tickets_ptr + _ROW_TICKET, 0)


@triton.jit(do_not_specialize=["M", "k_iters"])
def skinny_gemm_add_norms_kernel(
    x_ptr, w_ptr, normed_ptr, partials_ptr, tickets_ptr, residual_ptr, weight_ptr, next_weight_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_normed, k_iters,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr,
    stride_residual, stride_out, eps, HIDDEN: tl.constexpr, NORM_BLOCK: tl.constexpr, PRECISE: tl.constexpr,
    NORM_AFTER_ADD: tl.constexpr, NEXT_NORM: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), splits), N == HIDDEN: y = x @ W^T, then out = residual + RMSNorm(y) * weight
    (NORM_AFTER_ADD: RMSNorm(residual + y) * weight) and, with NEXT_NORM, normed = RMSNorm(out) *
    next_weight."""
    if PDL:
        # The norm weights are read by whichever tile finishes last: one program puts them in L2 early.
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            LINE: tl.constexpr = 1024 // weight_ptr.dtype.element_ty.primitive_bitwidth
            STEP: tl.constexpr = LINE if LINE < NORM_BLOCK else NORM_BLOCK
            offs = tl.minimum(tl.arange(0, NORM_BLOCK // STEP) * STEP, HIDDEN - 1)
            prefetch_l2(weight_ptr + offs)
            if NEXT_NORM:
                prefetch_l2(next_weight_ptr + offs)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    out = tile_product(x_ptr, w_ptr, w_rows, M, K, stride_xm, stride_wn, k_iters, BLOCK_M, BLOCK_N, BLOCK_K,
                       EVEN_K, USE_DOT, DOT_FP32, NUM_STAGES, PDL, PRELOAD_K)
    if SPLIT:
        last, total = split_k_total(out, partials_ptr, tickets_ptr, M, BLOCK_M, BLOCK_N)
        if last:
            _finish_tile(total, normed_ptr, tickets_ptr, residual_ptr, weight_ptr, next_weight_ptr, out_ptr,
                         offs_n, M, N, stride_normed, stride_residual, stride_out, eps, BLOCK_M, HIDDEN,
                         NORM_BLOCK, PRECISE, NORM_AFTER_ADD, NEXT_NORM)
    else:
        _finish_tile(out, normed_ptr, tickets_ptr, residual_ptr, weight_ptr, next_weight_ptr, out_ptr, offs_n,
                     M, N, stride_normed, stride_residual, stride_out, eps, BLOCK_M, HIDDEN, NORM_BLOCK,
                     PRECISE, NORM_AFTER_ADD, NEXT_NORM)


# --------------------------------------------------------------------------------------------------
# Host side


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the epilogue variants take these operands: a decode-sized batch (at most MAX_EPILOGUE_M)."""
    return skinny_ok(x, weight, MAX_EPILOGUE_M)


def _pointer_key(tensor: torch.Tensor) -> tuple:
    """What Triton specializes on of a pointer operand: dtype, device, 16-byte alignment (as
    triton_runtime/launch.py's specialization reads them)."""
    return (tensor.dtype, tensor.device, tensor.data_ptr() & 15)


def weight_key(weight: torch.Tensor) -> tuple:
    """What a plan keys on of a weight operand (a projection's [N, K], a norm's [N]): its _pointer_key, shape
    and row stride."""
    return _pointer_key(weight) + (weight.shape, weight.stride(0))


class WeightKeys:
    """weight_key of each of a layer's weights, read once: reading a tensor's dtype, device, address, shape
    and stride costs about 0.5 µs of host time, some 3.5 µs for a decode layer application's 7 weights, and
    a layer's weights stay put between its calls. `still_hold(weights)` says whether the keys still hold.

    They hold while `weights` are the same tensor objects, each at the address it had when read. That sees
    every way PyTorch replaces a weight: a new Parameter (assigned, or load_state_dict(assign=True)) is
    another object (these are held, so no other tensor can take their place); .to(), .half() or .cuda()
    replace a parameter's data in place (`param.data = ..` or swap_tensors) with data allocated while the
    old is still held, so at another address. load_state_dict copying into the weights changes nothing a
    plan keys on. Not seen: a weight's dtype, shape or strides changed at the same address (t_(), set_(),
    `.data =` a view of itself, or its data replaced twice between two calls, the second time where it
    first was), which nothing here does to a model's weights."""

    __slots__ = ("keys", "pointers", "weights")

    def __init__(self, weights: tuple[torch.Tensor, ...]) -> None:
        self.weights = weights
        self.pointers = tuple(map(torch.Tensor.data_ptr, weights))
        self.keys = tuple(map(weight_key, weights))

    def still_hold(self, weights: tuple[torch.Tensor, ...]) -> bool:
        return (all(map(operator.is_, weights, self.weights))
                and tuple(map(torch.Tensor.data_ptr, weights)) == self.pointers)


class _Plans:
    """One kernel's plans, by a key its caller builds of everything a plan depends on: each operand's
    _pointer_key or weight_key, shapes and strides, and the ints Triton specializes on. A dict per kernel
    keeps the kernel out of the key (hashing a JITFunction is a Python call, 0.35 µs on the CI CPU).
    `check` validates the operands once, when a plan is built."""

    def __init__(self, kernel, row_ticket: bool = False) -> None:
        self.kernel, self.row_ticket = kernel, row_ticket
        self.plans: dict[tuple, Plan] = {}

    def get(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, stride_ym: int,
            config: GemvConfig | None, check: Callable[[], None]) -> Plan:
        plan = self.plans.get(key)
        if plan is None:
            check_operands(x, weight)
            check()
            plan = build_plan(self.kernel, x, weight, stride_ym, config, self.row_ticket)
            if len(self.plans) > 4096:
                self.plans.clear()
            self.plans[key] = plan
        return plan


_ROPE_PLANS = _Plans(skinny_gemm_rope_kernel)
_SILU_MUL_PLANS = _Plans(skinny_gemm_silu_mul_kernel)
_ADD_NORMS_PLANS = _Plans(skinny_gemm_add_norms_kernel, row_ticket=True)


def _check_rows(name: str, tensor: torch.Tensor, rows: int, width: int, dtype: torch.dtype) -> None:
    if tensor.dim() != 2 or tensor.shape != (rows, width) or tensor.stride(1) != 1 or tensor.dtype != dtype:
        raise ValueError(f"{name} must be [{rows}, {width}] in {dtype} with a contiguous last dim, got "
                         f"{tuple(tensor.shape)} in {tensor.dtype}, strides {tensor.stride()}")


def _output(out: torch.Tensor | None, like: torch.Tensor, rows: int, width: int, name: str) -> torch.Tensor:
    """A new [rows, width] buffer in like's dtype on its device, or `out` where the caller passes one (a layer
    stack reuses a few through its layers): checked to be what a new one would be, since a plan keys on a new
    buffer's alignment only."""
    if out is None:
        return like.new_empty(rows, width)
    if (out.shape != (rows, width) or out.stride(0) != width or out.stride(1) != 1 or out.dtype != like.dtype
            or out.device != like.device):
        raise ValueError(f"{name} must be a contiguous [{rows}, {width}] in {like.dtype} on {like.device}, "
                         f"got {tuple(out.shape)} in {out.dtype} on {out.device}, strides {out.stride()}")
    return out


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
             num_kv_heads: int, head_dim: int, config: GemvConfig | None = None,
             weight_keys: tuple | None = None, out: torch.Tensor | None = None,
             bias: torch.Tensor | None = None,
             rope_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The qkv projection of x [M, K] by weight [(H + 2 Hkv) D, K] with RoPE on q and k, as
    fused.rope_qkv(linear(x, weight), ..) gives it; cos, sin [M, 1, D] or [M, D] (a layer stack passes the
    2-D views, made once for all its layers). Returns q [M, H, D], k and v [M, Hkv, D]: views into one
    [M, (H + 2 Hkv) D] buffer (row stride (H + 2 Hkv) D): `out` where given, else a new one. weight_keys:
    (weight_key(weight),) where the caller keeps it (WeightKeys), with bias's after it where there is one;
    None reads them.
    Huginn's attention (model/huginn.py: CausalSelfAttention) takes the two options: `bias`, (H + Hkv) D
    contiguous elements in x's dtype (any shape: Huginn's [2, H, D]), q's then k's, added to q and k in x's
    dtype before RoPE; `rope_fp32`, the rotation computed in fp32 and rounded once, at its end (else rounded
    after every op, as model/ouro.py's apply_rope in the model dtype)."""
    m, n = x.shape[0], weight.shape[0]
    if n != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:  # every call: the split below needs it
        raise ValueError(f"weight has {n} rows, not (heads {num_heads} + 2 x kv heads {num_kv_heads}) x "
                         f"head_dim {head_dim} with an even head_dim")
    y = _output(out, x, m, n, "out")
    if m:
        if cos.dim() != 2:
            cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
        rotated = (num_heads + num_kv_heads) * head_dim

        def check() -> None:
            _check_rows("cos", cos, m, head_dim, cos.dtype)
            _check_rows("sin", sin, m, head_dim, cos.dtype)
            if bias is not None and (bias.numel() != rotated or bias.dtype != x.dtype
                                     or not bias.is_contiguous()):
                raise ValueError(f"bias must be {rotated} contiguous elements (q's and k's heads) in "
                                 f"{x.dtype}, got {tuple(bias.shape)} in {bias.dtype}")

        scalars = (cos.stride(0), sin.stride(0), rotated // 2, head_dim // 2, PRECISE, bias is not None,
                   rope_fp32)
        if weight_keys is None:
            weight_keys = tuple(map(weight_key, (weight,) if bias is None else (weight, bias)))
        # y is [M, N] contiguous in x's dtype on x's device (new, or checked by _output): of it only the
        # alignment is not known.
        key = (config, weight_keys, x.shape, x.stride(0), _pointer_key(x), y.data_ptr() & 15,
               _pointer_key(cos), _pointer_key(sin), scalars)
        plan = _ROPE_PLANS.get(key, x, weight, n, config, check)
        # Without a bias the weight stands in for its pointer (HAS_BIAS off: never read).
        plan.launch(current_stream(x.device), (x, weight, y, plan.partials, plan.tickets, cos, sin,
                                               weight if bias is None else bias) + plan.tail + scalars)
    # One split of a [M, H + 2 Hkv, D] view: the host cost of this runs 96 times a decode step.
    return torch.split_with_sizes(y.view(m, num_heads + 2 * num_kv_heads, head_dim),
                                  [num_heads, num_kv_heads, num_kv_heads], 1)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
                 weight_keys: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up with [gate, up] = x @ weight^T, weight [2 I, K] (gate rows, then up rows): returns
    [M, I] (in `out` where given), as fused.silu_mul(linear(x, weight)) gives it. weight_keys: as
    qkv_rope's."""
    m, n = x.shape[0], weight.shape[0]
    y = _output(out, x, m, n // 2, "out")
    if m:
        def check() -> None:
            if n % 2:
                raise ValueError(f"gate_up weight must have an even number of rows, got {n}")

        # y is [M, N / 2] contiguous, as in qkv_rope.
        key = (config, weight_keys or (weight_key(weight),), x.shape, x.stride(0), _pointer_key(x),
               y.data_ptr() & 15)
        plan = _SILU_MUL_PLANS.get(key, x, weight, n // 2, config, check)
        plan.launch(current_stream(x.device),
                    (x, weight, y, plan.partials, plan.tickets) + plan.tail + (PRECISE,))
    return y


Pair = tuple[torch.Tensor, torch.Tensor]


def linear_add_norms(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     next_weight: torch.Tensor | None, eps: float, config: GemvConfig | None = None,
                     weight_keys: tuple | None = None, outputs: Pair | None = None,
                     norm_after_add: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h, RMSNorm(h) * next_weight) with h = residual + RMSNorm(x @ weight^T) * norm_weight: a projection,
    its post-norm, the residual add and the next sublayer's pre-norm, as fused.add_rmsnorm_rmsnorm(residual,
    linear(x, weight), ..) gives them. weight [N, K], residual [M, N] with contiguous rows. weight_keys:
    weight_key of weight, norm_weight and next_weight (if any), where the caller keeps them (WeightKeys);
    None reads them. outputs: the (h, normed) buffers to write, where the caller reuses them (neither may be x
    or residual; normed stages the projection even without a next norm); else new ones.
    Huginn's sandwich blocks (model/huginn.py: SandwichBlock) take the two options: `norm_after_add`,
    h = RMSNorm(residual + x @ weight^T) * norm_weight; next_weight None, h alone (the block stack's last
    output feeds no norm): returns (h, None)."""
    m, n = x.shape[0], weight.shape[0]
    given_out, given_normed = outputs or (None, None)
    out = _output(given_out, residual, m, n, "outputs[0]")
    normed = _output(given_normed, residual, m, n, "outputs[1]")
    vectors = (norm_weight,) if next_weight is None else (norm_weight, next_weight)
    if m:
        def check() -> None:
            _check_rows("residual", residual, m, n, x.dtype)
            for name, vector in zip(("norm_weight", "next_weight"), vectors):
                if vector.shape != (n,) or vector.dtype != x.dtype or vector.stride(0) != 1:
                    raise ValueError(f"{name} must be a contiguous [{n}] in {x.dtype}, got "
                                     f"{tuple(vector.shape)} in {vector.dtype}")

        # Without a next norm, norm_weight stands in for next_weight's pointer (NEXT_NORM off: never read).
        pointers = (x, weight, normed, residual, norm_weight, vectors[-1], out)
        stride_out = out.stride(0)  # normed's too: both are contiguous [M, N]
        scalars = (residual.stride(0), stride_out, eps, n, 1 << (n - 1).bit_length(), PRECISE,  # pow2 >= n
                   norm_after_add, next_weight is not None)
        # out and normed are contiguous [M, N] in residual's dtype on its device (new, or checked by
        # _output): of them only the alignments are not known.
        key = (config, weight_keys or tuple(map(weight_key, (weight,) + vectors)), x.shape,
               x.stride(0), _pointer_key(x), _pointer_key(residual), out.data_ptr() & 15,
               normed.data_ptr() & 15, scalars)
        plan = _ADD_NORMS_PLANS.get(key, x, weight, stride_out, config, check)
        plan.launch(current_stream(x.device), pointers[:3] + (plan.partials, plan.tickets) + pointers[3:]
                    + plan.tail + scalars)
    return out, (None if next_weight is None else normed)
