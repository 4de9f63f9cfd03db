"""Rounding a kernel pins down itself: `mul_rn`, an fp32 multiply rounded on its own, which no add after it
contracts into an FMA. The model's elementwise kernels and epilogues (model/kernels/) and the prefill
attention (attention/kernels/prefill.py) multiply through it."""

import triton
import triton.language as tl


@triton.jit
def mul_rn(a, b, PRECISE: tl.constexpr):
    """a * b in fp32, rounded by itself: an add that follows never contracts it into an FMA, whatever the
    launch's fp fusion (PTX mul.rn; not libdevice's __fmul_rn, which Triton builds flushing denormals).
    Without PRECISE (callers pass False under Triton's interpreter, which has no inline PTX and never
    contracts) a plain multiply."""
    if PRECISE:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b
