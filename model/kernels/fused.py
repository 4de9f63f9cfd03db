"""Fused elementwise kernels for the Ouro layer, with one-launch host wrappers, and the elementwise math they
share with the skinny GEMM's epilogues (model/kernels/gemv_epilogues.py).

Each kernel computes in fp32 and rounds to the model dtype exactly where model/ouro.py's torch code rounds
(after every torch op). No multiply-add contracts into an FMA that the torch ops would round twice: these
kernels launch with fp fusion off, and the shared math multiplies through `mul_rn`
(triton_runtime/rounding.py), which stays uncontracted in the GEMM kernels, whose main loops keep fp fusion
on. Elementwise results (RoPE, SiLU-mul) are then bitwise equal to torch on CUDA. The RMSNorm family sums
squares in another order than torch's reduction, so the fp32 inverse rms may differ in its last bit; bf16/fp16
outputs then differ by one ulp on rare elements.

With PDL (triton_runtime/pdl.py) a kernel loads its norm weights, then waits for the previous kernel;
every activation read and every store comes after the wait.

Tensors are [rows, features] with a contiguous last dimension (any row stride), weights in the
activations' dtype. The kernels have no backward: training stays on the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from triton_runtime.pdl import launch_dependents, wait_for_previous
from triton_runtime.pdl_launch import PdlLaunchCache
from triton_runtime.rounding import mul_rn


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x rounded to dtype, as a torch op in dtype rounds its result; kept in fp32 for the next op."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def rms_normalize(xf, weight, eps, N: tl.constexpr, dtype: tl.constexpr, PRECISE: tl.constexpr):
    """HF RMSNorm of fp32 rows (the last axis, N wide, zero past N): normalise in fp32, round to dtype, then
    scale by the weight (fp32 values of dtype) in dtype. Returns the rounded result, widened to fp32. The mean
    multiplies by 1/N as torch's CUDA mean does."""
    mean_square = mul_rn(tl.sum(mul_rn(xf, xf, PRECISE), axis=-1, keep_dims=True), 1.0 / N, PRECISE)
    if PRECISE:  # torch's rsqrtf; tl.rsqrt's lowering is not pinned to it
        inv_rms = libdevice.rsqrt(mean_square + eps)
    else:
        inv_rms = tl.rsqrt(mean_square + eps)
    normed = round_to(mul_rn(xf, inv_rms, PRECISE), dtype)
    return round_to(mul_rn(weight, normed, PRECISE), dtype)


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr, PRECISE: tl.constexpr):
    """silu(gate) * up of fp32 values of dtype, rounded to dtype (returned in dtype). silu is torch's
    x / (1 + exp(-x)): libdevice expf and a correctly rounded divide, not the fast approximations tl.exp
    and `/` lower to. With fp fusion on, expf's last step (ex2(r) times 2^k) fuses with the `1 +` into an
    FMA; that product is exact (a power of two, or below half an ulp of 1), so the sum rounds the same."""
    if PRECISE:
        exp_neg = libdevice.exp(-gate)
    else:
        exp_neg = tl.exp(-gate)
    silu = round_to(tl.div_rn(gate, 1.0 + exp_neg), dtype)
    return mul_rn(silu, up, PRECISE).to(dtype)


@triton.jit
def rotate_half(x1, x2, cos1, cos2, sin1, sin2, dtype: tl.constexpr, PRECISE: tl.constexpr):
    """RoPE's x * cos + cat(-x2, x1) * sin on a head's two halves (fp32 values of dtype), rounded after each
    product and after the sum, as the torch ops round. Returns the two halves in dtype."""
    out1 = round_to(mul_rn(x1, cos1, PRECISE), dtype) + round_to(mul_rn(-x2, sin1, PRECISE), dtype)
    out2 = round_to(mul_rn(x2, cos2, PRECISE), dtype) + round_to(mul_rn(x1, sin2, PRECISE), dtype)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, next_weight_ptr, out_ptr, normed_ptr,
    stride_x, stride_residual, stride_out, stride_normed, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NEXT_NORM: tl.constexpr,
    PRECISE: tl.constexpr, NORM_AFTER_ADD: tl.constexpr, PDL: tl.constexpr,
):
    """One program per row. out = [residual +] rmsnorm(x) * weight, or with NORM_AFTER_ADD
    rmsnorm(residual + x) * weight (Huginn's sandwich); with NEXT_NORM also normed = rmsnorm(out) *
    next_weight, from the rounded out still in registers."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NEXT_NORM:
        next_weight = tl.load(next_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    launch_dependents(PDL)
    xf = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM_AFTER_ADD:
            y = rms_normalize(round_to(residual + xf, dtype), weight, eps, N, dtype, PRECISE)
        else:
            y = round_to(residual + rms_normalize(xf, weight, eps, N, dtype, PRECISE), dtype)
    else:
        y = rms_normalize(xf, weight, eps, N, dtype, PRECISE)
    tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)
    if NEXT_NORM:
        z = rms_normalize(y, next_weight, eps, N, dtype, PRECISE)
        tl.store(normed_ptr + row * stride_normed + offs, z.to(dtype), mask=mask)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, SIZE: tl.constexpr, BLOCK: tl.constexpr,
                    PRECISE: tl.constexpr, PDL: tl.constexpr):
    """Program (row, block of SIZE): out = silu(gate) * up, gate and up the two halves of the gate_up row."""
    wait_for_previous(PDL)
    launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    gate_ptr = gate_up_ptr + row * stride_in + offs
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + SIZE, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, silu_times(gate, up, out_ptr.dtype.element_ty, PRECISE),
             mask=mask)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, heads, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
          PRECISE: tl.constexpr):
    """rotate_half on the first `heads` heads at x_ptr, as two half tiles [BLOCK_H, D / 2] (contiguous loads,
    no gather). Returns the two halves' pointer offsets, mask and values."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HALF)[None, :]
    offs = tl.arange(0, BLOCK_H)[:, None] * HEAD_DIM + offs_d
    mask = tl.arange(0, BLOCK_H)[:, None] < heads
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1, cos2 = tl.load(cos_ptr + offs_d).to(tl.float32), tl.load(cos_ptr + HALF + offs_d).to(tl.float32)
    sin1, sin2 = tl.load(sin_ptr + offs_d).to(tl.float32), tl.load(sin_ptr + HALF + offs_d).to(tl.float32)
    out1, out2 = rotate_half(x1, x2, cos1, cos2, sin1, sin2, x_ptr.dtype.element_ty, PRECISE)
    return offs, mask, out1, out2


@triton.jit
def rope_qkv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_qkv, stride_cos, stride_sin, stride_q, stride_k,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    STORE_KV: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, part): part 0 rotates the token's q heads, part 1 its k heads and, with STORE_KV,
    writes rotated k and v into the token's cache slot ([blocks, block_size, kv_heads, D] contiguous,
    64-bit offsets: a large pool exceeds 2^31 elements). cos and sin are made in the step: read after the
    wait."""
    wait_for_previous(PDL)
    launch_dependents(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + token * stride_qkv
    cos, sin = cos_ptr + token * stride_cos, sin_ptr + token * stride_sin
    if tl.program_id(1) == 0:
        offs, mask, q1, q2 = _rope(row, cos, sin, HEADS, BLOCK_H, HEAD_DIM, PRECISE)
        dst = q_ptr + token * stride_q + offs
        tl.store(dst, q1, mask=mask)
        tl.store(dst + HALF, q2, mask=mask)
    else:
        offs, mask, k1, k2 = _rope(row + HEADS * HEAD_DIM, cos, sin, KV_HEADS, BLOCK_H, HEAD_DIM, PRECISE)
        dst = k_ptr + token * stride_k + offs
        tl.store(dst, k1, mask=mask)
        tl.store(dst + HALF, k2, mask=mask)
        if STORE_KV:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64) * (KV_HEADS * HEAD_DIM) + offs
            cache_dtype = key_cache_ptr.dtype.element_ty
            tl.store(key_cache_ptr + slot, k1.to(cache_dtype), mask=mask)
            tl.store(key_cache_ptr + slot + HALF, k2.to(cache_dtype), mask=mask)
            v_ptr = row + (HEADS + KV_HEADS) * HEAD_DIM + offs
            v1, v2 = tl.load(v_ptr, mask=mask), tl.load(v_ptr + HALF, mask=mask)
            tl.store(value_cache_ptr + slot, v1.to(cache_dtype), mask=mask)
            tl.store(value_cache_ptr + slot + HALF, v2.to(cache_dtype), mask=mask)


# TRITON_INTERPRET=1 has no libdevice; there tl.exp / tl.rsqrt stand in (numpy's exp and 1 / sqrt).
PRECISE = isinstance(rmsnorm_kernel, triton.runtime.JITFunction)
SILU_BLOCK = 1024


def _rows(x: torch.Tensor, width: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, {width}] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 256))


# Each launches its compiled variant directly after the first call of a shape (triton_runtime/launch.py).
_NORM = PdlLaunchCache(rmsnorm_kernel, enable_fp_fusion=False)
_SILU_MUL = PdlLaunchCache(silu_mul_kernel, enable_fp_fusion=False)
_ROPE_QKV = PdlLaunchCache(rope_qkv_kernel, enable_fp_fusion=False)


def _launch_norm(x, residual, weight, next_weight, out, normed, eps, norm_after_add: bool = False) -> None:
    rows, hidden = x.shape
    _rows(x, hidden, "x")
    block = triton.next_power_of_2(hidden)
    args = (x, residual, weight, next_weight, out, normed,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
            0 if normed is None else normed.stride(0), eps,
            hidden, block, residual is not None, next_weight is not None, PRECISE, norm_after_add)
    _NORM((rows,), args, _norm_warps(block), x.device)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(x) * weight: the pre-norms and the loop's final norm."""
    out = torch.empty_like(x) if out is None else out
    _launch_norm(x, None, weight, None, out, None, eps)
    return out


def rmsnorm_rmsnorm(x: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h) * next_weight) with h = RMSNorm(x) * weight: two norms in a row (Huginn's coda opens
    with the final norm, then its first block's pre-norm)."""
    out, normed = torch.empty_like(x), torch.empty_like(x)
    _launch_norm(x, None, weight, next_weight, out, normed, eps)
    return out, normed


def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None, norm_after_add: bool = False) -> torch.Tensor:
    """residual + RMSNorm(x) * weight: a post-norm and its residual add. out=residual updates in place.
    norm_after_add: RMSNorm(residual + x) * weight instead, Huginn's order (its sandwich re-norms the
    residual stream after the add)."""
    out = torch.empty_like(residual) if out is None else out
    _launch_norm(x, residual, weight, None, out, None, eps, norm_after_add)
    return out


def add_rmsnorm_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        next_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                        normed_out: torch.Tensor | None = None,
                        norm_after_add: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h) * next_weight) with h = residual + RMSNorm(x) * weight: a post-norm, its residual add
    and the next sublayer's pre-norm in one launch. norm_after_add: h = RMSNorm(residual + x) * weight, as
    add_rmsnorm's."""
    out = torch.empty_like(residual) if out is None else out
    normed_out = torch.empty_like(residual) if normed_out is None else normed_out
    _launch_norm(x, residual, weight, next_weight, out, normed_out, eps, norm_after_add)
    return out, normed_out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up from the fused [rows, 2 * I] gate_up output; returns [rows, I]."""
    rows, width = gate_up.shape
    size = width // 2
    _rows(gate_up, 2 * size, "gate_up")
    out = gate_up.new_empty(rows, size) if out is None else out
    block = min(SILU_BLOCK, triton.next_power_of_2(size))
    _SILU_MUL((rows, triton.cdiv(size, block)),
              (gate_up, out, gate_up.stride(0), out.stride(0), size, block, PRECISE), 4, gate_up.device)
    return out


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, key_cache: torch.Tensor | None = None, value_cache: torch.Tensor | None = None,
             slot_mapping: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on q and k straight from the fused qkv output [N, (H + 2 Hkv) * D]; cos, sin are [N, 1, D].
    Returns q [N, H, D] and k [N, Hkv, D] (new, or the `out` pair) and v, a view into qkv. With key_cache,
    value_cache (one slot's [blocks, block_size, Hkv, D] planes) and slot_mapping (int64 [N]), also
    stores rotated k and v at each token's slot."""
    rows = qkv.shape[0]
    _rows(qkv, (num_heads + 2 * num_kv_heads) * head_dim, "qkv")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if out is None:
        out = (qkv.new_empty(rows, num_heads, head_dim), qkv.new_empty(rows, num_kv_heads, head_dim))
    q, k = out
    store = key_cache is not None
    args = (qkv, cos, sin, q, k, key_cache, value_cache, slot_mapping,
            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k.stride(0),
            num_heads, num_kv_heads, head_dim, triton.next_power_of_2(max(num_heads, num_kv_heads)), store,
            PRECISE)
    _ROPE_QKV((rows, 2), args, 4, qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(rows, num_kv_heads, head_dim)
    return q, k, v
