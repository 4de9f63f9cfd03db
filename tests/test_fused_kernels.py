"""The fused elementwise kernels (model/kernels/fused.py) against model/ouro.py's torch code, which they
replace. Without CUDA they run in the Triton interpreter at tiny shapes; one GPU test runs Ouro's shapes.

Tolerances, as (ulps of the output dtype, fraction of elements bitwise equal to torch):
- RoPE and SiLU-mul on CUDA: bitwise, every dtype.
- The RMSNorm family: the sum of squares runs in another order than torch's, so the inverse rms may
  differ in its last bit. fp32 within 8 ulps; fp16 and bf16 within 2 ulps (one ulp of the normed term,
  counted at the sum's scale) with at least 99% of elements bitwise equal.
- Under the interpreter, SiLU-mul uses numpy's exp (fp32 within 8 ulps), and every fp32 -> bf16 cast
  truncates instead of rounding to nearest (triton 3.x), so bf16 holds to 8 ulps only there; fp16,
  which the interpreter rounds correctly, pins the rounding order.
"""

import pytest
import torch
import torch.nn.functional as F

from model.kernels.fused import add_rmsnorm, add_rmsnorm_rmsnorm, rmsnorm, rmsnorm_rmsnorm, rope_qkv, silu_mul
from model.ouro import RMSNorm, Rotary, apply_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def tolerance(kind: str, dtype: torch.dtype) -> tuple[int, float]:
    """(max ulps, min fraction bitwise equal) that `kind` holds to against torch; see the module doc."""
    if INTERPRETED and dtype == torch.bfloat16:
        return 8, 0.0
    if kind == "norm" or (kind == "silu" and INTERPRETED):
        return (8, 0.0) if dtype == torch.float32 else (2, 0.99)
    return 0, 1.0


def assert_matches_torch(out: torch.Tensor, expected: torch.Tensor, kind: str) -> None:
    """Within `ulps` units in the last place of the expected element, where elements smaller than the
    tensor's rms count at the rms (a sum that cancels has no smaller error to promise)."""
    ulps, exact = tolerance(kind, expected.dtype)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    got, want = out.float(), expected.float()
    scale = want.abs().clamp_min(want.pow(2).mean().sqrt().item())
    eps = torch.full_like(scale, torch.finfo(expected.dtype).eps)
    unit = torch.ldexp(eps, torch.frexp(scale).exponent - 1)
    excess = ((got - want).abs() / unit).max().item()
    assert excess <= ulps, f"{kind} {expected.dtype}: {excess:.2f} ulps off, {ulps} allowed"
    assert (out == expected).float().mean().item() >= exact


def hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], EPS).to(device=x.device, dtype=x.dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(x)


def norm_inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """A residual stream, a projection output at a different scale, and two norm weights near 1."""
    g = torch.Generator().manual_seed(seed)
    residual, x = torch.randn(rows, hidden, generator=g), 3 * torch.randn(rows, hidden, generator=g)
    weight, next_weight = 1 + 0.2 * torch.randn(2, hidden, generator=g)
    return (t.to(DEVICE, dtype) for t in (residual, x, weight, next_weight))


@pytest.mark.parametrize("hidden", [128, 200])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_matches_hf_rmsnorm(dtype, hidden):
    _, x, weight, _ = norm_inputs(7, hidden, dtype)
    assert_matches_torch(rmsnorm(x, weight, EPS), hf_rmsnorm(x, weight), "norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_adds_the_post_norm_to_the_residual(dtype):
    residual, x, weight, _ = norm_inputs(5, 200, dtype)
    assert_matches_torch(add_rmsnorm(residual, x, weight, EPS), residual + hf_rmsnorm(x, weight), "norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_rmsnorm_also_prenorms_the_next_sublayer(dtype):
    residual, x, weight, next_weight = norm_inputs(5, 128, dtype)
    h, normed = add_rmsnorm_rmsnorm(residual, x, weight, next_weight, EPS)
    expected_h = residual + hf_rmsnorm(x, weight)
    assert_matches_torch(h, expected_h, "norm")
    # The next norm reads the rounded h that was stored, so compare it from the kernel's own h.
    assert_matches_torch(normed, hf_rmsnorm(h, next_weight), "norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_after_add_norms_the_residual_sum_as_huginns_blocks_do(dtype):
    """Huginn's order (model/huginn.py: SandwichBlock): h = RMSNorm(residual + x) * weight, the sum rounded
    to the dtype first; rmsnorm_rmsnorm is two norms in a row (the coda's ln_f, then its first pre-norm)."""
    residual, x, weight, next_weight = norm_inputs(5, 200, dtype)
    expected_h = hf_rmsnorm(residual + x, weight)
    assert_matches_torch(add_rmsnorm(residual, x, weight, EPS, norm_after_add=True), expected_h, "norm")
    h, normed = add_rmsnorm_rmsnorm(residual, x, weight, next_weight, EPS, norm_after_add=True)
    assert_matches_torch(h, expected_h, "norm")
    assert_matches_torch(normed, hf_rmsnorm(h, next_weight), "norm")
    h, normed = rmsnorm_rmsnorm(x, weight, next_weight, EPS)
    assert_matches_torch(h, hf_rmsnorm(x, weight), "norm")
    assert_matches_torch(normed, hf_rmsnorm(h, next_weight), "norm")


def test_norms_write_into_given_buffers_in_place_and_read_row_strides():
    residual, x, weight, next_weight = norm_inputs(4, 128, torch.float16)
    wide = torch.zeros(4, 3 * 128, dtype=torch.float16, device=DEVICE)
    wide[:, 128:256] = x
    strided_x = wide[:, 128:256]
    expected_h = residual + hf_rmsnorm(x, weight)
    normed = torch.empty_like(residual)
    h, out = add_rmsnorm_rmsnorm(residual, strided_x, weight, next_weight, EPS, out=residual,
                                 normed_out=normed)
    assert h is residual and out is normed
    assert_matches_torch(residual, expected_h, "norm")
    rmsnorm(strided_x, weight, EPS, out=wide[:, :128])
    assert_matches_torch(wide[:, :128], hf_rmsnorm(x, weight), "norm")
    assert torch.equal(wide[:, 256:], torch.zeros_like(wide[:, 256:]))


@pytest.mark.parametrize("size", [256, 1100])  # 1100: two column blocks, the second one masked
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_silu_of_gate_times_up(dtype, size):
    gate_up = (4 * torch.randn(3, 2 * size, generator=torch.Generator().manual_seed(1))).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches_torch(silu_mul(gate_up), F.silu(gate) * up, "silu")


def rope_inputs(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(2))
    positions = torch.randint(0, 4000, (rows,), generator=torch.Generator().manual_seed(3))
    cos, sin = Rotary(head_dim, 10000.0)(positions, dtype)
    return qkv.to(DEVICE, dtype), cos.to(DEVICE), sin.to(DEVICE)


def torch_rope_qkv(qkv, cos, sin, heads, kv_heads, head_dim):
    """OuroLayer.forward's split, views and apply_rope."""
    rows = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return (apply_rope(q.view(rows, heads, head_dim), cos, sin),
            apply_rope(k.view(rows, kv_heads, head_dim), cos, sin), v.view(rows, kv_heads, head_dim))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_matches_apply_rope_and_views_v(dtype, heads, kv_heads):
    qkv, cos, sin = rope_inputs(6, heads, kv_heads, 32, dtype)
    q, k, v = rope_qkv(qkv, cos, sin, heads, kv_heads, 32)
    expected_q, expected_k, expected_v = torch_rope_qkv(qkv, cos, sin, heads, kv_heads, 32)
    assert_matches_torch(q, expected_q, "rope")
    assert_matches_torch(k, expected_k, "rope")
    assert torch.equal(v, expected_v) and v.data_ptr() == expected_v.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_stores_rotated_k_and_v_at_each_tokens_slot(dtype):
    rows, heads, kv_heads, head_dim, num_blocks, block_size = 5, 4, 2, 32, 4, 4
    qkv, cos, sin = rope_inputs(rows, heads, kv_heads, head_dim, dtype)
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    slot_mapping = torch.tensor([13, 2, 7, 0, 9], dtype=torch.int64, device=DEVICE)
    out = (torch.empty(rows, heads, head_dim, dtype=dtype, device=DEVICE),
           torch.empty(rows, kv_heads, head_dim, dtype=dtype, device=DEVICE))
    q, k, v = rope_qkv(qkv, cos, sin, heads, kv_heads, head_dim, key_cache, value_cache, slot_mapping,
                       out=out)
    assert q is out[0] and k is out[1]
    expected_keys, expected_values = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    expected_keys.view(-1, kv_heads, head_dim)[slot_mapping] = k
    expected_values.view(-1, kv_heads, head_dim)[slot_mapping] = v
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)
    assert_matches_torch(k, torch_rope_qkv(qkv, cos, sin, heads, kv_heads, head_dim)[1], "rope")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_torch_at_ouro_shapes(dtype, rows):
    hidden, intermediate, heads, head_dim = 2048, 5632, 16, 128
    residual, x, weight, next_weight = norm_inputs(rows, hidden, dtype, seed=rows)
    h, normed = add_rmsnorm_rmsnorm(residual, x, weight, next_weight, EPS)
    assert_matches_torch(rmsnorm(x, weight, EPS), hf_rmsnorm(x, weight), "norm")
    assert_matches_torch(h, residual + hf_rmsnorm(x, weight), "norm")
    assert_matches_torch(normed, hf_rmsnorm(h, next_weight), "norm")
    gate_up = 4 * torch.randn(rows, 2 * intermediate, device=DEVICE).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches_torch(silu_mul(gate_up), F.silu(gate) * up, "silu")
    qkv, cos, sin = rope_inputs(rows, heads, heads, head_dim, dtype)
    q, k, _ = rope_qkv(qkv, cos, sin, heads, heads, head_dim)
    expected_q, expected_k, _ = torch_rope_qkv(qkv, cos, sin, heads, heads, head_dim)
    assert_matches_torch(q, expected_q, "rope")
    assert_matches_torch(k, expected_k, "rope")


def test_the_launch_cache_keys_on_what_triton_specializes_on():
    """A cached compiled variant is reused only for arguments Triton would compile the same: a tensor's
    dtype, device and 16-byte alignment, each int's value; a float's value does not count."""
    from triton_runtime.launch import specialization

    x = torch.zeros(64)
    base = specialization((x, 16, 1e-6, True, None))
    assert specialization((torch.ones(64), 16, 1e-5, True, None)) == base
    for other in ((x[1:], 16, 1e-6, True, None), (x.half(), 16, 1e-6, True, None),
                  (x, 17, 1e-6, True, None), (x, 16, 1e-6, False, None), (x, 16, 1e-6, True, x)):
        assert specialization(other) != base


def test_direct_launches_pass_only_registered_launch_hooks():
    """A direct launch hands Triton's launcher None for an empty hook chain (which Triton would call, with
    metadata built for it, at every launch) and the chain itself once a hook is registered."""
    from triton.knobs import HookChain

    from triton_runtime.launch import _registered

    chain = HookChain()
    assert _registered(chain) is None and _registered(None) is None
    chain.add(print)
    assert _registered(chain) is chain
    assert _registered(print) is print  # a Triton whose hooks are plain callables


@pytest.mark.gpu
def test_direct_launches_still_call_a_registered_launch_hook():
    import triton

    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    rmsnorm(x, weight, EPS)  # the JIT-dispatched first call: later ones launch directly
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        rmsnorm(x, weight, EPS)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert seen and "rmsnorm" in seen[-1]
    rmsnorm(x, weight, EPS)
    assert len(seen) == 1


@pytest.mark.gpu
def test_cached_launches_give_the_jit_launch_results():
    """The fused kernels' direct launches (after each shape's first call) give what the first, JIT-dispatched
    call gave, on a second shape and a misaligned view too."""
    for rows in (3, 8):
        x = torch.randn(rows + 1, 256, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(256, device="cuda", dtype=torch.bfloat16)
        for view in (x[:rows], x[1:]):  # x[1:] starts 512 bytes in: aligned; a column offset is not
            first = rmsnorm(view, weight, EPS)
            assert torch.equal(rmsnorm(view, weight, EPS), first)
        gate_up = torch.randn(rows, 2 * 300, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(silu_mul(gate_up), silu_mul(gate_up.clone()))
        unaligned = torch.randn(rows, 2 * 300 + 1, device="cuda", dtype=torch.bfloat16)[:, 1:]
        aligned = silu_mul(unaligned.contiguous())  # another variant (16-byte aligned rows), compiled first
        assert torch.equal(silu_mul(unaligned), aligned) and torch.equal(silu_mul(unaligned), aligned)
