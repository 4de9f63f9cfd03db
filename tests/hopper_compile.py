"""Compiles every Triton kernel variant the backend launches for Hopper (sm_90), without a GPU, and checks
in the PTX of each Programmatic Dependent Launch variant that a program reads only step inputs before
`griddepcontrol.wait`, writes nothing to global memory before it, and reaches it on every path
(tests/pdl_ptx.py). Prints each variant's registers and stack bytes a thread (ptxas spills to the stack),
the GEMMs compiled as a launch at Ouro's and Huginn-0125's shapes specializes them (SHAPE_INTS).

The interpreter accepts code that the compiler rejects (a non-constexpr global, a type that changes
across a branch), so CPU-only CI runs this as a script in a process without TRITON_INTERPRET:

    TRITON_INTERPRET=0 python -m tests.hopper_compile
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attention.kernels.decode import decode_merge_kernel, decode_split_kernel
from attention.kernels.kv_store import kv_store_kernel
from attention.kernels.kvarn_decode import PLANE_WIDTHS, kvarn_decode_split_kernel
from attention.kernels.kvarn_prefill import kvarn_prefill_kernel
from attention.kernels.prefill import prefill_packed_kernel, prefill_paged_kernel
from attention.kernels.rotate import rotate_rows_kernel
from attention.triton_kvarn import decode_maxnreg
from cache.copy_forward_kernel import copy_forward_kernel
from model.kernels.fused import rmsnorm_kernel, rope_qkv_kernel, silu_mul_kernel
from model.kernels.gemv import skinny_gemm_kernel, skippable_gemm_kernel
from runner.chain_step_kernels import chain_step_kernel, pipelined_step_kernel
from model.kernels.gemv_epilogues import (skinny_gemm_add_norms_kernel, skinny_gemm_rope_kernel,
                                          skinny_gemm_silu_mul_kernel)
from tests.pdl_ptx import pre_wait_violations

OURO = {"HEADS": 16, "KV_HEADS": 16, "HEAD_DIM": 128}
DENSE = {**OURO, "BLOCK_D": 128}  # the dense attention kernels' head tile: HEAD_DIM's, a power of two
INDEX_POINTERS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "rows_ptr": "*i32",
                  "query_start_loc_ptr": "*i32", "work_ptr": "*i32", "packed_ptr": "*i32",
                  "tickets_ptr": "*i32", "slot_mapping_ptr": "*i64", "partials_ptr": "*fp32",
                  "gen_tables_ptr": "*i32", "prompt_lens_ptr": "*i32", "slots_ptr": "*i64",
                  "slot_offsets_ptr": "*i32",
                  "mask_ptr": "*i1", "scales_ptr": "*fp32"}
CACHE_POINTERS = ("key_cache_ptr", "value_cache_ptr")
WIDE_INTS = {"plane_elems"}  # a pool plane can exceed 2^31 elements: the launcher passes it as i64
# What each PDL kernel may read before the wait: step inputs that no kernel of the step writes.
PDL_EARLY_READS = {
    "decode_split_kernel": {"block_tables_ptr", "context_lens_ptr", "rows_ptr", "gen_tables_ptr",
                            "prompt_lens_ptr", "slot_offsets_ptr"},
    "kv_store_kernel": {"slot_mapping_ptr", "scales_ptr"},
    "prefill_paged_kernel": {"work_ptr", "query_start_loc_ptr", "context_lens_ptr", "scales_ptr"},
    "prefill_packed_kernel": {"packed_ptr"},
}
# The model's kernels read only weights before the wait: no kernel of a step writes them.
WEIGHTS = {"w_ptr", "weight_ptr", "next_weight_ptr"}
PDL_EARLY_READS.update({kernel.__name__: WEIGHTS for kernel in (
    skinny_gemm_kernel, skinny_gemm_rope_kernel, skinny_gemm_silu_mul_kernel, skinny_gemm_add_norms_kernel,
    rmsnorm_kernel, silu_mul_kernel, rope_qkv_kernel)})
FLOATS = {"scale", "eps"}
# The GEMMs' shapes and strides (three of the names are also rmsnorm_kernel's row strides): Ouro's and
# Huginn-0125's are multiples of 16, which a launch passes as such (Triton specializes an int divisible by
# 16); compiled without it, their loads are not vectorized and the registers printed are not a launch's.
SHAPE_INTS = {"N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_normed", "stride_residual",
              "stride_out"}


# The KVarN kernels' pointers (attention/triton_kvarn.py launches them with fp32 queries and outputs).
KVARN_POINTERS = {"key_codes_ptr": "*u8", "value_codes_ptr": "*u8", "key_scales_ptr": "*fp16",
                  "value_scales_ptr": "*fp16", "side_tables_ptr": "*i32", "partials_side_ptr": "*fp32",
                  "q_ptr": "*fp32", "q_rot_ptr": "*fp32", "q_side_ptr": "*fp32", "out_ptr": "*fp32",
                  "out_rot_ptr": "*fp32", "out_side_ptr": "*fp32"}


def compile_for_hopper(fn, dtype: str, constexprs: dict, num_warps: int,
                       cache_dtype: str | None = None, pointers: dict[str, str] | None = None,
                       maxnreg: int | None = None) -> tuple:
    """cache_dtype: the KV pool's element type where it is not `dtype` (fp8e4nv: an fp8 pool). pointers:
    pointee types by argument name, over the defaults. maxnreg: a register cap, as a launch passes it.
    Returns the compiled kernel and what is wrong with a PDL variant's order."""
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            pointee = cache_dtype if cache_dtype and name in CACHE_POINTERS else dtype
            signature[name] = {**INDEX_POINTERS, **(pointers or {})}.get(name, "*" + pointee)
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOATS else "i64" if name in WIDE_INTS else "i32"
            if name in SHAPE_INTS:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": 2, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    if not constexprs.get("PDL"):
        return kernel, []
    params = [name for name in fn.arg_names if name not in constexprs]
    problems = pre_wait_violations(kernel.asm["ptx"], params, PDL_EARLY_READS[fn.__name__])
    return kernel, [f"{fn.__name__} {constexprs}: {problem}" for problem in problems]


def registers_and_stack(compiled) -> tuple[int, int]:
    """Registers and stack bytes a thread of a compiled kernel takes, read from its cubin by the cuobjdump
    that Triton ships (CompiledKernel.n_regs and n_spills load the kernel, which needs a GPU)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


GEMV_POINTERS = {"partials_ptr": "*fp32", "tickets_ptr": "*i32"}


def gemv_variants() -> list[tuple]:
    """The model's kernels, PDL on: the skinny GEMM and its epilogue variants at Ouro-1.4B's tuned bf16
    configs (one and two rows: the FMA path, streamed and preloaded; 4-16 rows: the dot path, split and not)
    and one fp32 config, and the fused elementwise kernels; one PDL-off variant; then Huginn-0125's
    (huginn_variants)."""
    fma = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "SPLIT": False, "USE_DOT": False, "DOT_FP32": False,
           "NUM_STAGES": 3, "PRELOAD_K": 0}
    dot = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": True, "USE_DOT": True, "DOT_FP32": False,
           "NUM_STAGES": 4, "PRELOAD_K": 0}
    fp32 = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT": True, "USE_DOT": True, "DOT_FP32": True,
            "NUM_STAGES": 3, "PRELOAD_K": 0}
    preload = {**fma, "BLOCK_N": 8, "PRELOAD_K": 2048}  # one row, the whole weight slice before the wait
    out = []
    two_rows = [{**fma, "BLOCK_M": 2, "BLOCK_N": 8}, {**preload, "BLOCK_M": 2}]  # MAX_FMA_M rows
    for dtype, config in (("bf16", fma), ("bf16", preload), *(("bf16", c) for c in two_rows), ("bf16", dot),
                          ("bf16", {**dot, "SPLIT": False}), ("fp32", fp32)):
        gemm = {**config, "EVEN_K": True, "EVEN_N": True, "PDL": True}
        norms = {**gemm, "HIDDEN": 2048, "NORM_BLOCK": 2048, "PRECISE": True, "NORM_AFTER_ADD": False,
                 "NEXT_NORM": True}
        rope = {**gemm, "HALF": 64, "PRECISE": True, "HAS_BIAS": False, "ROPE_FP32": False}
        out += [(skinny_gemm_kernel, dtype, gemm, 4, None, GEMV_POINTERS),
                (skinny_gemm_rope_kernel, dtype, rope, 4, None, GEMV_POINTERS),
                (skinny_gemm_silu_mul_kernel, dtype, {**gemm, "PRECISE": True}, 4, None, GEMV_POINTERS),
                (skinny_gemm_add_norms_kernel, dtype, norms, 4, None, GEMV_POINTERS)]
    uneven = {**dot, "EVEN_K": False, "EVEN_N": False, "PDL": False}
    out.append((skinny_gemm_kernel, "bf16", uneven, 4, None, GEMV_POINTERS))
    # the head of a chained pass (lm_head: one or two rows, the FMA path), launched without PDL
    out.append((skippable_gemm_kernel, "bf16", {**fma, "BLOCK_N": 16, "EVEN_K": True, "EVEN_N": True,
                                                "PDL": False}, 4, None, {**GEMV_POINTERS, "skip_ptr": "*i1"}))
    for add_residual, next_norm in ((False, False), (True, True)):
        norm = {"N": 2048, "BLOCK": 2048, "ADD_RESIDUAL": add_residual, "NEXT_NORM": next_norm,
                "PRECISE": True, "NORM_AFTER_ADD": False, "PDL": True}
        out.append((rmsnorm_kernel, "bf16", norm, 8, None, None))
    out.append((silu_mul_kernel, "bf16", {"SIZE": 5632, "BLOCK": 1024, "PRECISE": True, "PDL": True}, 4, None,
                None))
    out.append((rope_qkv_kernel, "bf16", {**OURO, "BLOCK_H": 16, "STORE_KV": False, "PRECISE": True,
                                          "PDL": True}, 4, None, None))
    return out + huginn_variants(fma, dot)


def huginn_variants(fma: dict, dot: dict) -> list[tuple]:
    """Huginn-0125's blocks (model/huginn_fused.py; width 5280, head_dim 96, fp32 RoPE tables), bf16, at
    default_config's tiles, whose K blocks do not divide 5280: qkv_rope with the q/k bias and the fp32
    rotation at one row and at 16; the norm epilogue (one row) with the norm after the add, with and without
    the next norm; the norm kernel in that order (2-16 rows)."""
    rope = {"HALF": 48, "PRECISE": True, "HAS_BIAS": True, "ROPE_FP32": True}
    tables = {**GEMV_POINTERS, "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    out = []
    for config in (fma, {**dot, "BLOCK_N": 32, "BLOCK_K": 256}):
        gemm = {**config, "EVEN_K": False, "EVEN_N": True, "PDL": True}
        out.append((skinny_gemm_rope_kernel, "bf16", {**gemm, **rope}, 4, None, tables))
    for next_norm in (True, False):
        norms = {**fma, "EVEN_K": False, "EVEN_N": True, "PDL": True, "HIDDEN": 5280, "NORM_BLOCK": 8192,
                 "PRECISE": True, "NORM_AFTER_ADD": True, "NEXT_NORM": next_norm}
        out.append((skinny_gemm_add_norms_kernel, "bf16", norms, 4, None, GEMV_POINTERS))
        norm = {"N": 5280, "BLOCK": 8192, "ADD_RESIDUAL": True, "NEXT_NORM": next_norm, "PRECISE": True,
                "NORM_AFTER_ADD": True, "PDL": True}
        out.append((rmsnorm_kernel, "bf16", norm, 16, None, None))
    return out


def variants() -> list[tuple]:
    """(kernel, dtype, constexprs, num_warps, cache dtype, pointer types) of every variant. On Hopper the
    backend launches its kernels with PDL, so those are the variants compiled (and their order checked)."""
    out = gemv_variants()
    for dtype, tile in (("bf16", 64), ("fp32", 32)):
        for quantized in (False, True) if dtype == "bf16" else (False,):  # True: an fp8 pool
            cache = "fp8e4nv" if quantized else None
            decode_tile = 128 if dtype == "bf16" and not quantized else tile  # the backend's decode_block_n
            for row_map in (False, True):
                for shared in (False, True):
                    out.append((decode_split_kernel, dtype, {
                        **DENSE, "BLOCK_SIZE": 16, "BLOCK_N": decode_tile, "SHORT_CONTEXT": 1024,
                        "SHORT_SPLIT_KEYS": 64, "SPLIT_MIN_KEYS": 512, "SPLIT_CAP": 16, "ROW_MAP": row_map,
                        "SHARED": shared, "LOOPS": 4 if shared else 1, "NUM_LAYERS": 24 if shared else 1,
                        "ROW_SLOTS": False, "QUANTIZED": quantized, "DOT_FP32": dtype == "fp32",
                        "FP16_DOT": quantized, "PDL": True}, 4, cache, None))
            if quantized:  # a depth pass (every row a decode row at its own loop): planes, scales per row
                for shared in (False, True):
                    out.append((decode_split_kernel, dtype, {
                        **DENSE, "BLOCK_SIZE": 16, "BLOCK_N": decode_tile, "SHORT_CONTEXT": 1024,
                        "SHORT_SPLIT_KEYS": 64, "SPLIT_MIN_KEYS": 512, "SPLIT_CAP": 16, "ROW_MAP": False,
                        "SHARED": shared, "LOOPS": 4 if shared else 1, "NUM_LAYERS": 24 if shared else 1,
                        "ROW_SLOTS": True, "QUANTIZED": True, "DOT_FP32": False, "FP16_DOT": True,
                        "PDL": True}, 4, cache, None))
            prefill = {**DENSE, "BLOCK_M": tile, "BLOCK_N": tile, "DOT_FP32": dtype == "fp32", "PDL": True}
            out.append((prefill_paged_kernel, dtype, {**prefill, "BLOCK_SIZE": 16, "QUANTIZED": quantized}, 8,
                        cache, None))
            store = {"KV_HEADS": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 16, "QUANTIZED": quantized,
                     "PDL": True}
            out.append((kv_store_kernel, dtype, store, 4, cache, None))
        out.append((decode_merge_kernel, dtype, {"HEADS": 16, "HEAD_DIM": 128, "BLOCK_D": 128,
                                                 "SPLIT_MIN_KEYS": 512, "SPLIT_CAP": 16}, 4, None, None))
        out.append((prefill_packed_kernel, dtype, {**DENSE, "BLOCK_M": tile, "BLOCK_N": tile,
                                                   "DOT_FP32": dtype == "fp32", "PDL": True}, 8, None, None))
    # Huginn-0125's head (55 x 96, no GQA): a head_dim that is no power of two, tiled as 128 masked lanes;
    # bf16, and an fp8 pool for the decode kernel's 32-bit value words.
    huginn = {"HEADS": 55, "KV_HEADS": 55, "HEAD_DIM": 96, "BLOCK_D": 128}
    for quantized in (False, True):
        cache = "fp8e4nv" if quantized else None
        out.append((decode_split_kernel, "bf16", {
            **huginn, "BLOCK_SIZE": 16, "BLOCK_N": 64 if quantized else 128, "SHORT_CONTEXT": 1024,
            "SHORT_SPLIT_KEYS": 64, "SPLIT_MIN_KEYS": 512, "SPLIT_CAP": 4, "ROW_MAP": True, "SHARED": False,
            "LOOPS": 1, "NUM_LAYERS": 1, "ROW_SLOTS": False, "QUANTIZED": quantized, "DOT_FP32": False,
            "FP16_DOT": quantized, "PDL": True}, 4, cache, None))
    out.append((prefill_paged_kernel, "bf16", {**huginn, "BLOCK_SIZE": 16, "BLOCK_M": 128, "BLOCK_N": 64,
                                               "DOT_FP32": False, "QUANTIZED": False, "PDL": True}, 4, None,
                None))
    out.append((prefill_packed_kernel, "bf16", {**huginn, "BLOCK_M": 128, "BLOCK_N": 64, "DOT_FP32": False,
                                                "PDL": True}, 4, None, None))
    out.append((kv_store_kernel, "bf16", {"KV_HEADS": 55, "HEAD_DIM": 96, "BLOCK_D": 128, "BLOCK_H": 64,
                                          "QUANTIZED": False, "PDL": True}, 4, None, None))
    out.append((decode_merge_kernel, "bf16", {"HEADS": 55, "HEAD_DIM": 96, "BLOCK_D": 128,
                                              "SPLIT_MIN_KEYS": 512, "SPLIT_CAP": 4}, 4, None, None))
    # The KVarN kernels: decode at k4v2 and k5v5 (one plane, and a 4-bit plus a 1-bit plane, which the
    # decode kernel takes apart differently); prefill in the engine's 128-query programs over a bf16 model at
    # k4v2 and k5v5 (the two ways of taking planes apart) and at g128, and over an fp32 model: the slowest
    # variants to compile (5-18 s each), so not every preset (k4v4's planes are k4v2's widths) nor the
    # benchmark's 64-query programs.
    for key_bits, value_bits, tile in ((4, 2, 64), (5, 5, 64), (4, 2, 128)):
        (k_low, k_high), (v_low, v_high) = PLANE_WIDTHS[key_bits], PLANE_WIDTHS[value_bits]
        planes = {"K_LOW_BITS": k_low, "K_HIGH_BITS": k_high, "V_LOW_BITS": v_low, "V_HIGH_BITS": v_high}
        kvarn = {**OURO, "TILE": tile, **planes}
        if (key_bits, value_bits, tile) in ((4, 2, 64), (5, 5, 64)):  # the engine's launch
            out.append((kvarn_decode_split_kernel, "bf16", {**kvarn, "SPLIT_MIN_KEYS": 512, "SPLIT_CAP": 16,
                                                            "TWO_BASES": True}, 2, None, KVARN_POINTERS,
                        decode_maxnreg(key_bits, value_bits)))
        prefills = [(128, 8, "bf16")]
        if (key_bits, value_bits, tile) == (4, 2, 64):
            prefills.append((128, 8, "fp32"))
        for block_m, num_warps, dtype in prefills:  # q and out in the model's dtype
            pointers = {**KVARN_POINTERS, "q_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
            constexprs = {**kvarn, "BLOCK_M": block_m, "EXACT_FP32": dtype == "fp32"}
            out.append((kvarn_prefill_kernel, dtype, constexprs, num_warps, None, pointers))
    out += between_loops_variants()
    for base in (False, True):  # KVarN's rotations of the decode query and of its output back
        out.append((rotate_rows_kernel, "fp32", {"D": 128, "BLOCK_R": 16, "BLOCK_K": 16, "BLOCK_N": 16,
                                                 "BASE": base}, 4, None, {"matrix_ptr": "*fp32"}))
    return out


def between_loops_variants() -> list[tuple]:
    """Copy-forward (from one loop, masked or not, and from each row's), and the steps between chained
    passes: plain chains', pipelined speculation's (d = 2 and 1 of 4 loops)."""
    out = []
    step_pointers = {name: "*i64" for name in (
        "position_ptr", "loop_ptr", "finished_ptr", "given_ptr", "token_ptr", "first_ptr", "reserved_ptr",
        "end_ptr", "table_ptr", "force_ptr", "count_ptr", "record_ptr", "served_ptr", "slot_ptr")}
    step_pointers.update(active_ptr="*i1", done_ptr="*i1", lengths_ptr="*i32", offsets_ptr="*i32",
                         offset_of_ptr="*i32")
    for dtype in ("bf16", "fp32"):
        for masked, row_loops in ((False, False), (True, False), (True, True)):
            out.append((copy_forward_kernel, dtype, {"LOOPS": 4, "LAYERS": 24, "ROW": 2048, "BLOCK": 2048,
                                                     "MASKED": masked, "ROW_LOOPS": row_loops}, 4, None,
                        {"loops_ptr": "*i64"}))
        out.append((chain_step_kernel, dtype, {"BLOCK_R": 4, "LOOPS": 4, "H": 2048, "BLOCK_H": 512}, 4,
                    None, step_pointers))
        for m, d in ((2, 2), (4, 1)):
            out.append((pipelined_step_kernel, dtype, {"M": m, "BLOCK_M": m, "LOOPS": 4, "D": d, "H": 2048,
                                                       "BLOCK_H": 1024}, 4, None, step_pointers))
    return out


def compile_variant(index: int) -> tuple[str, list[str]]:
    """Variant `index` of variants() (kernels do not pickle: each worker process builds the list): a line with
    the kernel, its constexprs that differ between variants, num_warps, registers and stack bytes, and what is
    wrong with its PDL order."""
    variant = variants()[index]
    fn, dtype, constexprs, num_warps, cache_dtype = variant[:5]
    kernel, problems = compile_for_hopper(*variant)
    registers, stack = registers_and_stack(kernel)
    shown = {name: value for name, value in constexprs.items() if name not in DENSE or name == "HEAD_DIM"}
    cap = f" maxnreg {variant[6]}" if len(variant) > 6 and variant[6] else ""
    pool = "/" + cache_dtype if cache_dtype else ""
    return (f"{fn.__name__} {dtype}{pool} {shown} warps {num_warps}{cap}: "
            f"{registers} registers, {stack} stack bytes"), problems


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    # Each compile is one CPU thread's work: two processes halve the wall time on CI's two cores.
    # The KVarN variants first: each takes 5-18 s of the ~110 s, and one left to the end would run alone.
    every = variants()
    order = sorted(range(len(every)), key=lambda index: not every[index][0].__name__.startswith("kvarn"))
    problems = []
    with ProcessPoolExecutor(max_workers=2) as pool:
        for line, found in pool.map(compile_variant, order):
            print(line)
            problems += found
    if problems:
        raise SystemExit("PDL order:\n" + "\n".join(problems))
    checked = sum(1 for variant in every if variant[2].get("PDL"))
    print(f"all kernel variants compile for sm_90; {checked} PDL variants wait before reading activations "
          "or writing")


if __name__ == "__main__":
    main()
