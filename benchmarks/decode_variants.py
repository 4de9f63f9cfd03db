"""Decode attention kernel variants, timed side by side on CUDA against the backend's kernel: what bounds the
split-KV decode below the copy bandwidth (the elementwise loop of db3b2fd read at 0.70 of it in bf16, and an
fp8 pool, half the bytes, took the same time; the tensor-core loop reads bf16 at 1.04 and fp8 at 0.5-0.6).

    python -m benchmarks.decode_variants --out X.json

    current   the backend's decode_split_kernel (graph mode: one launch, the ticket merge in it)
    acc2d     an elementwise fp32 loop with a [BLOCK_N, D] accumulator: no cross-warp reduction of p @ V per
              tile, one reduction at the end (faster than the tensor-core loop for fp8 pools on the H200)

The first run (decode_variants-2026-12-01-db3b2fd) also timed "dot16", scores and p @ V on tensor cores with
the query padded to 16 rows; that loop became the backend's (attention/kernels/decode.py), so "current" now
measures it and the harness no longer carries a copy.

Each variant writes the backend's partial layout and is merged by decode_merge_kernel (the backend's merge
arithmetic, as a launch of its own); it reads every context position from the pool (the new-token store is
left out), so a row needs two or more splits (context > 512) for its output to be checked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from attention.kernels.decode import decode_merge_kernel, split_bounds, split_count
from benchmarks.attention import DecodeStep, copy_bandwidth_gbps, graph_time_us, slots_for, triton_us

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile_rows(table, positions, end, kv_head, BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    page = tl.load(table + positions // BLOCK_SIZE, mask=positions < end, other=0).to(tl.int64)
    return page * (BLOCK_SIZE * KV_HEADS * HEAD_DIM) + ((positions % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM)
                                                       + kv_head * HEAD_DIM)


@triton.jit
def acc2d_kernel(q_ptr, key_cache_ptr, value_cache_ptr, scales_ptr, block_tables_ptr, context_lens_ptr,
                 partials_ptr, scale, stride_bt, stride_qn, stride_qh,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_MIN_KEYS: tl.constexpr,
                 SPLIT_CAP: tl.constexpr,
                 QUANTIZED: tl.constexpr):
    split = tl.program_id(0)
    head = tl.program_id(1)
    r = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + r)
    num_splits = split_count(context_len, SPLIT_MIN_KEYS, SPLIT_CAP)
    if split < num_splits:
        kv_head = head // (HEADS // KV_HEADS)
        start, end = split_bounds(split, num_splits, context_len, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        tile = tl.arange(0, BLOCK_N)
        q = tl.load(q_ptr + r.to(tl.int64) * stride_qn + head * stride_qh + offs_d).to(tl.float32)
        q = q * (scale * LOG2E)
        v_scale = 1.0
        if QUANTIZED:
            q = q * tl.load(scales_ptr + kv_head)
            v_scale = tl.load(scales_ptr + KV_HEADS + kv_head)
        table = block_tables_ptr + r.to(tl.int64) * stride_bt
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            positions = n0 + tile
            mask = positions < end
            rows = _tile_rows(table, positions, end, kv_head, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
            k = tl.load(key_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
            v = tl.load(value_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
            s = tl.where(mask, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            acc = acc * alpha + p[:, None] * v.to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        _store_partial(partials_ptr, tl.sum(acc, 0) * v_scale, m_i, l_i, split, head, r, HEADS, HEAD_DIM)


@triton.jit
def _store_partial(partials_ptr, acc, m_i, l_i, split, head, r, HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    """The backend's partial layout (attention/kernels/decode.py): acc [P, D], then max [P], then sum [P]."""
    grid_splits = tl.num_programs(0)
    num_partials = grid_splits * HEADS * tl.num_programs(2)
    part = (r * HEADS + head) * grid_splits + split
    tl.store(partials_ptr + part * HEAD_DIM + tl.arange(0, HEAD_DIM), acc)
    tl.store(partials_ptr + num_partials * HEAD_DIM + part, m_i)
    tl.store(partials_ptr + num_partials * (HEAD_DIM + 1) + part, l_i)


VARIANTS = {"acc2d": acc2d_kernel}


def variant_call(step: DecodeStep, kernel, slot: int, block_n: int, num_warps: int, num_stages: int,
                 out: torch.Tensor, partials: torch.Tensor, grid_splits: int):
    meta, heads = step.meta, step.q.shape[1]
    head_dim = step.q.shape[2]
    scales = step.kv_scales[slot] if step.kv_scales is not None else partials
    rows = step.rows

    def call():
        kernel[(grid_splits, heads, rows)](
            step.q, step.key_cache[slot], step.value_cache[slot], scales, meta.block_tables,
            meta.context_lens, partials, head_dim ** -0.5, meta.block_tables.stride(0), step.q.stride(0),
            step.q.stride(1),
            HEADS=heads, KV_HEADS=step.key_cache.shape[3], HEAD_DIM=head_dim,
            BLOCK_SIZE=step.key_cache.shape[2],
            BLOCK_N=block_n, SPLIT_MIN_KEYS=512, SPLIT_CAP=16, QUANTIZED=step.kv_scales is not None,
            num_warps=num_warps, num_stages=num_stages)
        decode_merge_kernel[(heads, rows)](out, meta.context_lens, partials, grid_splits, HEADS=heads,
                                          HEAD_DIM=head_dim, SPLIT_MIN_KEYS=512, SPLIT_CAP=16)
    return call


def reference_out(step: DecodeStep, slot: int) -> torch.Tensor:
    """The backend's eager answer (its kernel stores the new token first: the same value is already there)."""
    backend = step.backend()
    backend.prepare(step.meta)
    return backend.forward(step.q, step.k, step.v, slot).float().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["64x2048", "16x8192", "1x512"])
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    results = []
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        element = 1 if kv_cache_dtype == "fp8_e4m3" else 2
        for shape in args.shapes:
            rows, context = (int(x) for x in shape.split("x"))
            step = DecodeStep(rows, context, slots_for(rows, context, element), kv_cache_dtype)
            base = triton_us(step, graph_mode=True)
            row = {"kv_cache_dtype": kv_cache_dtype, "rows": rows, "context": context, "bytes": step.bytes,
                   "current_us": base, "current_of_copy_bw": step.bytes / base / 1e3 / copy_gbps}
            want = reference_out(step, 0)
            grid_splits = split_count_host(context)
            heads, head_dim = step.q.shape[1], step.q.shape[2]
            partials = torch.empty(rows * heads * grid_splits * (head_dim + 2), device="cuda")
            out = torch.empty_like(step.q)
            for name, kernel in VARIANTS.items():
                best = None
                for block_n, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (32, 4, 3)):
                    try:
                        calls = [variant_call(step, kernel, s % step.slots, block_n, warps, stages, out,
                                              partials, grid_splits) for s in range(24)]
                        calls[0]()
                        torch.cuda.synchronize()
                        error = (float((out.float() - want).abs().max() / want.abs().max())
                                 if grid_splits > 1 else None)
                        us = graph_time_us(calls)
                    except Exception as err:  # a config may not fit
                        row[f"{name}_{block_n}_{warps}_{stages}"] = repr(err)[:120]
                        continue
                    if best is None or us < best[0]:
                        best = (us, block_n, warps, stages, error)
                if best is not None:
                    us, block_n, warps, stages, error = best
                    row[name] = {"us": us, "of_copy_bw": step.bytes / us / 1e3 / copy_gbps,
                                 "block_n": block_n, "num_warps": warps, "num_stages": stages,
                                 "max_rel_error": error}
            results.append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "copy_gbps": copy_gbps,
                                    "rows": results}, indent=2) + "\n")


def split_count_host(context: int) -> int:
    return min(16, max(1, -(-context // 512)))


if __name__ == "__main__":
    main()
