"""The copy-forward Triton kernel (cache/copy_forward.py launches it on CUDA): one program per (stopped
token, layer), optionally skipped by a device-side row mask, from one loop or from each row's own."""

import triton
import triton.language as tl


@triton.jit
def copy_forward_kernel(key_ptr, value_ptr, slots_ptr, mask_ptr, loop, loops_ptr, plane_tokens,
                        LOOPS: tl.constexpr, LAYERS: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
                        MASKED: tl.constexpr, ROW_LOOPS: tl.constexpr):
    """One program per (stopped token, layer): its K and V row of plane (loop, layer) into planes (t, layer)
    for every t > loop; ROW_LOOPS: the row's loop is loops_ptr's (a stored loop past the last copies
    nothing). 64-bit offsets: a pool exceeds 2^31 elements."""
    row = tl.program_id(0)
    layer = tl.program_id(1)
    if MASKED:
        if tl.load(mask_ptr + row).to(tl.int32) == 0:
            return
    if ROW_LOOPS:
        loop = tl.load(loops_ptr + row)
        if loop + 1 >= LOOPS:
            return
    token = tl.load(slots_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < ROW
    plane = (loop * LAYERS + layer).to(tl.int64)
    source = (plane * plane_tokens + token) * ROW + offs
    k = tl.load(key_ptr + source, mask=inside)
    v = tl.load(value_ptr + source, mask=inside)
    for deeper in range(loop + 1, LOOPS):
        target = ((deeper * LAYERS + layer).to(tl.int64) * plane_tokens + token) * ROW + offs
        tl.store(key_ptr + target, k, mask=inside)
        tl.store(value_ptr + target, v, mask=inside)
