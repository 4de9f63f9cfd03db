"""Rows times a small square matrix in fp32, plus an optional addend: KVarN's Hadamard rotations of the
decode query (q H) and of the packed share of its output back (out_side + out_r H^T).

Why a kernel of its own: these products are tiny ([rows x heads, 128] x [128, 128]) and come twice per
(loop, layer) call. cuBLAS runs them in fp32 as one thread block (an ffma kernel of 32 x 128 tiles), 53 µs a
call on an H200 at batch 1, more than the KVarN decode kernel itself (a profile of the batch-1 KVarN step,
2026-12-02). Here a program takes BLOCK_R rows against the whole matrix, BLOCK_K of
its rows at a time, for BLOCK_N of its columns: batch 1 (16 rows) is D / BLOCK_N programs (8 at D = 128;
one program for all 128 columns took 8.3 µs a call on an H200, 192 calls a step); the dot is plain fp32
("ieee", no TF32 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # rows per program (tl.dot's smallest M)
BLOCK_K = 16  # the matrix's rows per step
BLOCK_N = 16  # the matrix's columns per program


# The row count changes with the batch: one compiled kernel for every value.
@triton.jit(do_not_specialize=["rows"])
def rotate_rows_kernel(x_ptr, base_ptr, matrix_ptr, out_ptr, rows, stride_mk, stride_mn,
                       D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BASE: tl.constexpr):
    """Grid (cdiv(rows, BLOCK_R), D // BLOCK_N). out[r] = x[r] @ M (+ base[r] with BASE), for contiguous
    [rows, D] x, base and out; M [D, D] at strides (stride_mk, stride_mn)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_r[:, None] < rows
    offsets = offs_r[:, None].to(tl.int64) * D + offs_d[None, :]
    # K in slices of BLOCK_K: the whole [D, D] matrix as one dot operand spilled (9.5 KB a thread on sm_90).
    y = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for k0 in tl.range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * D + offs_k[None, :], mask=mask, other=0.0)
        matrix = tl.load(matrix_ptr + offs_k[:, None] * stride_mk + offs_d[None, :] * stride_mn)
        y += tl.dot(x.to(tl.float32), matrix, input_precision="ieee")
    if BASE:
        y += tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def rotate_rows(x: torch.Tensor, matrix: torch.Tensor, base: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [..., D] @ matrix (fp32 [D, D], any strides), plus base (x's shape) if given, in out_dtype. x and
    base must be contiguous."""
    d = x.shape[-1]
    if matrix.shape != (d, d) or matrix.dtype != torch.float32:
        raise ValueError(f"matrix must be fp32 [{d}, {d}], got {matrix.dtype} {list(matrix.shape)}")
    if not x.is_contiguous() or (base is not None and (base.shape != x.shape or not base.is_contiguous())):
        raise ValueError("x (and base, of x's shape) must be contiguous")
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.numel() // d
    if rows:
        block_n = min(BLOCK_N, d)
        rotate_rows_kernel[(triton.cdiv(rows, BLOCK_R), triton.cdiv(d, block_n))](
            x, base if base is not None else x, matrix, out, rows, matrix.stride(0), matrix.stride(1), d,
            BLOCK_R, BLOCK_K, block_n, base is not None, num_warps=4)
    return out
