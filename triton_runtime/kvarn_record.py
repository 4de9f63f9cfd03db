"""Where a KVarN record (cache/kvarn.py: record_codes) keeps its bytes, as jit helpers: shared by the kernel
that packs records (cache/kvarn_pack_kernel.py) and the prefill attention that reads them
(attention/kernels/kvarn_prefill.py)."""

import triton
import triton.language as tl


@triton.jit
def high_byte_offset(rows, columns, G: tl.constexpr, D: tl.constexpr):
    """Where kvarn.record_codes puts the high byte of row `rows`' 40-bit column `columns` of 5-bit codes in a
    record of G rows: after every row's 4-byte words, by 8-row groups, column-major within a group."""
    return G * (D // 2) + (rows // 8) * D + columns * 8 + rows % 8
