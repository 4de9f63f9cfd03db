"""Compiles every Triton kernel variant the backend launches for Hopper (sm_90), without a GPU, and prints
each one's registers and stack bytes a thread (ptxas spills to the stack).

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
from cache.copy_forward_kernel import copy_forward_kernel

OURO = {"HEADS": 16, "KV_HEADS": 16, "HEAD_DIM": 128}
INDEX_POINTERS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "rows_ptr": "*i32",
                  "query_start_loc_ptr": "*i32", "work_ptr": "*i32", "packed_ptr": "*i32",
                  "tickets_ptr": "*i32", "slot_mapping_ptr": "*i64", "partials_ptr": "*fp32",
                  "gen_tables_ptr": "*i32", "prompt_lens_ptr": "*i32", "slots_ptr": "*i64",
                  "mask_ptr": "*i1", "scales_ptr": "*fp32"}
CACHE_POINTERS = ("key_cache_ptr", "value_cache_ptr")
WIDE_INTS = {"plane_elems"}  # a pool plane can exceed 2^31 elements: the launcher passes it as i64


# The KVarN kernels' pointers (attention/triton_kvarn.py launches them with fp32 queries and outputs).
KVARN_POINTERS = {"key_codes_ptr": "*u8", "value_codes_ptr": "*u8", "key_scales_ptr": "*fp16",
                  "value_scales_ptr": "*fp16", "side_tables_ptr": "*i32", "partials_side_ptr": "*fp32",
                  "q_ptr": "*fp32", "q_side_ptr": "*fp32", "out_ptr": "*fp32",
                  "out_side_ptr": "*fp32", "rotation_ptr": "*fp32"}


def compile_for_hopper(fn, dtype: str, constexprs: dict, num_warps: int,
                       cache_dtype: str | None = None, pointers: dict[str, str] | None = None):
    """The compiled kernel. cache_dtype: the KV pool's element type where it is not `dtype` (fp8e4nv: an fp8
    pool). pointers: pointee types by argument name, over the defaults."""
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            pointee = cache_dtype if cache_dtype and name in CACHE_POINTERS else dtype
            signature[name] = {**INDEX_POINTERS, **(pointers or {})}.get(name, "*" + pointee)
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "scale" else "i64" if name in WIDE_INTS else "i32"
    source = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": 2}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def registers_and_stack(compiled) -> tuple[int, int]:
    """Registers and stack bytes a thread of a compiled kernel takes, read from its cubin by the cuobjdump
    that Triton ships (CompiledKernel.n_regs and n_spills load the kernel, which needs a GPU)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def variants() -> list[tuple]:
    """(kernel, dtype, constexprs, num_warps, cache dtype, pointer types) of every variant."""
    out = []
    for dtype, tile in (("bf16", 64), ("fp32", 32)):
        for quantized in (False, True) if dtype == "bf16" else (False,):  # True: an fp8 pool
            cache = "fp8e4nv" if quantized else None
            decode_tile = 128 if dtype == "bf16" and not quantized else tile  # the backend's decode_block_n
            # graph mode (not FUSED_MERGE) runs decode steps only, so never with a row map
            for row_map, fused in ((False, False), (False, True), (True, True)):
                for shared in (False, True):
                    out.append((decode_split_kernel, dtype, {
                        **OURO, "BLOCK_SIZE": 16, "BLOCK_N": decode_tile, "SPLIT_MIN_KEYS": 512,
                        "SPLIT_CAP": 16, "ROW_MAP": row_map, "FUSED_MERGE": fused, "SHARED": shared,
                        "LOOPS": 4 if shared else 1, "NUM_LAYERS": 24 if shared else 1,
                        "QUANTIZED": quantized, "DOT_FP32": dtype == "fp32", "FP16_DOT": quantized}, 4, cache,
                        None))
            prefill = {**OURO, "BLOCK_M": tile, "BLOCK_N": tile, "DOT_FP32": dtype == "fp32"}
            out.append((prefill_paged_kernel, dtype, {**prefill, "BLOCK_SIZE": 16, "QUANTIZED": quantized}, 8,
                        cache, None))
            out.append((kv_store_kernel, dtype, {"KV_HEADS": 16, "HEAD_DIM": 128, "BLOCK_H": 16,
                                                 "QUANTIZED": quantized}, 4, cache, None))
        out.append((decode_merge_kernel, dtype, {"HEADS": 16, "HEAD_DIM": 128, "SPLIT_MIN_KEYS": 512,
                                                 "SPLIT_CAP": 16}, 4, None, None))
        out.append((prefill_packed_kernel, dtype, {**OURO, "BLOCK_M": tile, "BLOCK_N": tile,
                                                   "DOT_FP32": dtype == "fp32"}, 8, None, None))
        for masked in (False, True):
            out.append((copy_forward_kernel, dtype, {"LOOPS": 4, "LAYERS": 24, "ROW": 2048, "BLOCK": 2048,
                                                     "MASKED": masked}, 4, None, None))
    # The KVarN kernels: decode at k4v2 and k5v5 (one plane, and a 4-bit plus a 1-bit plane, which the
    # decode kernel takes apart differently); prefill at every preset's planes and tile, in the engine's 128-
    # query programs over a bf16 model, and at k4v2 in 64-query programs (the benchmark's other choice) and
    # over an fp32 model: the slowest variants to compile.
    for key_bits, value_bits, tile in ((4, 2, 64), (5, 5, 64), (4, 4, 64), (4, 2, 128)):
        (k_low, k_high), (v_low, v_high) = PLANE_WIDTHS[key_bits], PLANE_WIDTHS[value_bits]
        planes = {"K_LOW_BITS": k_low, "K_HIGH_BITS": k_high, "V_LOW_BITS": v_low, "V_HIGH_BITS": v_high}
        kvarn = {**OURO, "TILE": tile, **planes}
        if (key_bits, value_bits, tile) in ((4, 2, 64), (5, 5, 64)):
            out.append((kvarn_decode_split_kernel, "bf16", {**kvarn, "SPLIT_MIN_KEYS": 512, "SPLIT_CAP": 16,
                                                            "TWO_BASES": True}, 4, None, KVARN_POINTERS))
        prefills = [(128, 8, "bf16")]
        if (key_bits, value_bits, tile) == (4, 2, 64):
            prefills += [(64, 4, "bf16"), (128, 8, "fp32")]
        for block_m, num_warps, dtype in prefills:  # q and out in the model's dtype
            pointers = {**KVARN_POINTERS, "q_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
            constexprs = {**kvarn, "BLOCK_M": block_m, "EXACT_FP32": dtype == "fp32"}
            out.append((kvarn_prefill_kernel, dtype, constexprs, num_warps, None, pointers))
    for base in (False, True):  # KVarN's rotations of the decode query and of its output back
        out.append((rotate_rows_kernel, "fp32", {"D": 128, "BLOCK_R": 16, "BASE": base}, 4, None,
                    {"matrix_ptr": "*fp32"}))
    return out


def compile_variant(index: int) -> str:
    """Variant `index` of variants() (kernels do not pickle: each worker process builds the list), as a line:
    the kernel, its constexprs that differ between variants, num_warps, registers and stack bytes."""
    fn, dtype, constexprs, num_warps, cache_dtype, _ = variant = variants()[index]
    registers, stack = registers_and_stack(compile_for_hopper(*variant))
    shown = {name: value for name, value in constexprs.items() if name not in OURO}
    return (f"{fn.__name__} {dtype}{'/' + cache_dtype if cache_dtype else ''} {shown} warps {num_warps}: "
            f"{registers} registers, {stack} stack bytes")


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    # Each compile is one CPU thread's work: two processes halve the wall time on CI's two cores.
    with ProcessPoolExecutor(max_workers=2) as pool:
        for line in pool.map(compile_variant, range(len(variants()))):
            print(line)
    print("all kernel variants compile for sm_90")


if __name__ == "__main__":
    main()
