"""Compiles every Triton kernel variant the backend launches for Hopper (sm_90), without a GPU.

The interpreter accepts code that the compiler rejects (a non-constexpr global, a type that changes
across a branch), so CPU-only CI runs this as a script in a process without TRITON_INTERPRET:

    TRITON_INTERPRET=0 python -m tests.hopper_compile
"""

from __future__ import annotations

import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attention.kernels.decode import decode_merge_kernel, decode_split_kernel
from attention.kernels.kv_store import kv_store_kernel
from attention.kernels.prefill import prefill_packed_kernel, prefill_paged_kernel
from cache.copy_forward_kernel import copy_forward_kernel

OURO = {"HEADS": 16, "KV_HEADS": 16, "HEAD_DIM": 128}
INDEX_POINTERS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "rows_ptr": "*i32",
                  "query_start_loc_ptr": "*i32", "work_ptr": "*i32", "packed_ptr": "*i32",
                  "tickets_ptr": "*i32", "slot_mapping_ptr": "*i64", "partials_ptr": "*fp32",
                  "gen_tables_ptr": "*i32", "prompt_lens_ptr": "*i32", "slots_ptr": "*i64",
                  "mask_ptr": "*i1", "scales_ptr": "*fp32"}
CACHE_POINTERS = ("key_cache_ptr", "value_cache_ptr")
WIDE_INTS = {"plane_elems"}  # a pool plane can exceed 2^31 elements: the launcher passes it as i64


def compile_for_hopper(fn, dtype: str, constexprs: dict, num_warps: int,
                       cache_dtype: str | None = None) -> None:
    """cache_dtype: the KV pool's element type where it is not `dtype` (fp8e4nv: an fp8 pool)."""
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            pointee = cache_dtype if cache_dtype and name in CACHE_POINTERS else dtype
            signature[name] = INDEX_POINTERS.get(name, "*" + pointee)
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "scale" else "i64" if name in WIDE_INTS else "i32"
    source = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": 2}
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    for dtype, tile in (("bf16", 64), ("fp32", 32)):
        for quantized in (False, True) if dtype == "bf16" else (False,):  # True: an fp8 pool
            cache = "fp8e4nv" if quantized else None
            decode_tile = 128 if dtype == "bf16" and not quantized else tile  # the backend's decode_block_n
            for row_map in (False, True):
                for fused in (False, True):
                    for shared in (False, True):
                        compile_for_hopper(decode_split_kernel, dtype, {
                            **OURO, "BLOCK_SIZE": 16, "BLOCK_N": decode_tile, "SPLIT_MIN_KEYS": 512,
                            "SPLIT_CAP": 16,
                            "ROW_MAP": row_map, "FUSED_MERGE": fused, "SHARED": shared,
                            "LOOPS": 4 if shared else 1, "NUM_LAYERS": 24 if shared else 1,
                            "QUANTIZED": quantized, "DOT_FP32": dtype == "fp32", "FP16_DOT": quantized},
                            4, cache)
            prefill = {**OURO, "BLOCK_M": tile, "BLOCK_N": tile, "DOT_FP32": dtype == "fp32"}
            compile_for_hopper(prefill_paged_kernel, dtype,
                               {**prefill, "BLOCK_SIZE": 16, "QUANTIZED": quantized}, 8, cache)
            compile_for_hopper(kv_store_kernel, dtype, {"KV_HEADS": 16, "HEAD_DIM": 128, "BLOCK_H": 16,
                                                        "QUANTIZED": quantized}, 4, cache)
        compile_for_hopper(decode_merge_kernel, dtype, {"HEADS": 16, "HEAD_DIM": 128, "SPLIT_MIN_KEYS": 512,
                                                        "SPLIT_CAP": 16}, 4)
        compile_for_hopper(prefill_packed_kernel, dtype, {**OURO, "BLOCK_M": tile, "BLOCK_N": tile,
                                                          "DOT_FP32": dtype == "fp32"}, 8)
        for masked in (False, True):
            compile_for_hopper(copy_forward_kernel, dtype, {"LOOPS": 4, "LAYERS": 24, "ROW": 2048,
                                                            "BLOCK": 2048, "MASKED": masked}, 4)
    print("all kernel variants compile for sm_90")


if __name__ == "__main__":
    main()
