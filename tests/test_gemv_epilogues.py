"""The skinny GEMM's epilogue variants (model/kernels/gemv_epilogues.py) against the unfused composition they
replace: the plain skinny GEMM, then fused.py's elementwise kernel. Without CUDA they run in the Triton
interpreter at tiny shapes; the GPU tests run Ouro-1.4B's shapes.

What is promised, as bits:
- rope and silu-mul load their W rows paired ([a0, b0, a1, b1, ..]); with the plain kernel run on those same
  rows, in that order, they are bitwise equal to the composition in every dtype. Against the rows in their
  own order they are bitwise equal on CUDA, where a dot's element does not depend on its row's place in the
  tile; the interpreter's fp32 dot is numpy's BLAS, whose sums do depend on it.
- Huginn's options (a q/k bias and an fp32 rotation in rope; the norm after the residual add, and no next
  norm, in add_norms) are held to the same promises, rope's against Huginn's torch code.
- add_norms is bitwise equal to skinny_linear + add_rmsnorm_rmsnorm under the interpreter. On CUDA its norm
  sums squares over another thread layout than rmsnorm_kernel (4 warps, not 8), so the inverse rms may differ
  in its last bit: test_fused_kernels.py's "norm" tolerance (fp32 within 8 ulps; fp16 and bf16 within 2 ulps,
  at least 99% of elements bitwise equal).
"""

import pytest
import torch

from engine import Engine, SamplingParams
from model.config import OuroConfig
from model.kernels import gemv, gemv_epilogues
from model.kernels.fused import add_rmsnorm_rmsnorm, rmsnorm, rope_qkv, silu_mul
from model.kernels.gemv import GemvConfig, skinny_linear
from model.kernels.gemv_epilogues import gate_up_silu, linear_add_norms, qkv_rope
from model.huginn import Rotary as HuginnRotary
from model.huginn import apply_rope
from model.ouro import OuroLayer, Rotary
from model.ouro_fused import EpilogueBuffers, FusedOuro
from model.tiny import PRESETS, hf_config, write_checkpoint
from tests.numerics import assert_within_noise
from tests.test_fused_kernels import assert_matches_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6
HEADS, KV_HEADS, HEAD_DIM, K = 3, 1, 16, 80  # qkv: 80 W rows, 40 pairs; K not a multiple of every block
CONFIGS = {
    "default": None,
    "dot_split3": GemvConfig(16, 32, split_k=3),
    "fma_split2": GemvConfig(16, 32, split_k=2, use_dot=False),  # M <= MAX_FMA_M only
    "fma_preload": GemvConfig(16, 32, use_dot=False, preload=True),
    "fma_preload_split2": GemvConfig(16, 32, split_k=2, use_dot=False, preload=True),
}
CASES = [(1, "default"), (3, "default"), (5, "dot_split3"), (1, "fma_split2"), (1, "fma_preload"),
         (1, "fma_preload_split2"), (2, "fma_split2"), (2, "fma_preload_split2")]


def pair_order(rows: int, span: int) -> torch.Tensor:
    """The W rows a paired kernel's tiles hold, in order: pair p is rows a = (p // span) 2 span + p % span
    and a + span."""
    p = torch.arange(rows // 2)
    first = (p // span) * 2 * span + p % span
    return torch.stack([first, first + span], 1).reshape(-1).to(DEVICE)


def paired_linear(x: torch.Tensor, weight: torch.Tensor, span: int, config) -> torch.Tensor:
    """skinny_linear on the W rows in a paired kernel's order, its columns put back in W's order."""
    order = pair_order(weight.shape[0], span)
    y = skinny_linear(x, weight[order].contiguous(), config=config)
    return y[:, torch.argsort(order)].contiguous()


def inputs(m: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, K, generator=g), 0.2 * torch.randn(n, K, generator=g)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


def rope_tables(m: int, dtype: torch.dtype, seed: int = 1):
    positions = torch.randint(0, 4000, (m,), generator=torch.Generator().manual_seed(seed))
    cos, sin = Rotary(HEAD_DIM, 10000.0)(positions, dtype)
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("m,name", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_equals_the_qkv_gemm_then_rope_qkv(dtype, m, name):
    config = CONFIGS[name]
    x, w = inputs(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype, seed=m)
    cos, sin = rope_tables(m, dtype)
    q, k, v = qkv_rope(x, w, cos, sin, HEADS, KV_HEADS, HEAD_DIM, config=config)
    qkv = paired_linear(x, w, HEAD_DIM // 2, config)
    expected = rope_qkv(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM)
    for got, want in zip((q, k, v), expected):
        assert got.shape == want.shape and torch.equal(got, want)
    # q, k and v are views into one buffer laid out as the qkv projection's output.
    assert m == 1 or q.stride(0) == k.stride(0) == v.stride(0) == qkv.shape[1]
    assert k.data_ptr() == q.data_ptr() + HEADS * HEAD_DIM * q.element_size()
    assert v.data_ptr() == k.data_ptr() + KV_HEADS * HEAD_DIM * q.element_size()


@pytest.mark.parametrize("m,name", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_silu_equals_the_gate_up_gemm_then_silu_mul(dtype, m, name):
    config = CONFIGS[name]
    intermediate = 40
    x, w = inputs(m, 2 * intermediate, dtype, seed=10 + m)
    act = gate_up_silu(x, w, config=config)
    assert act.shape == (m, intermediate)
    assert torch.equal(act, silu_mul(paired_linear(x, w, intermediate, config)))


def norm_operands(m: int, n: int, dtype: torch.dtype, seed: int):
    x, w = inputs(m, n, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    residual = torch.randn(m, n, generator=g).to(DEVICE, dtype)
    weight, next_weight = (1 + 0.2 * torch.randn(2, n, generator=g)).to(DEVICE, dtype)
    return x, w, residual, weight, next_weight


@pytest.mark.parametrize("m,name", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_add_norms_equals_the_gemm_then_add_rmsnorm_rmsnorm(dtype, m, name):
    config = CONFIGS[name]
    x, w, residual, weight, next_weight = norm_operands(m, 96, dtype, seed=20 + m)
    h, normed = linear_add_norms(x, w, residual, weight, next_weight, EPS, config=config)
    expected_h, expected_normed = add_rmsnorm_rmsnorm(residual, skinny_linear(x, w, config=config), weight,
                                                      next_weight, EPS)
    if DEVICE == "cpu":
        assert torch.equal(h, expected_h) and torch.equal(normed, expected_normed)
    else:
        assert_matches_torch(h, expected_h, "norm")
        assert_matches_torch(normed, expected_normed, "norm")


HUGINN_HEADS, HUGINN_HEAD_DIM = 2, 24  # no GQA, and a head_dim that is no power of two (Huginn-0125's is 96)


def huginn_attention_inputs(qkv: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """What Huginn's attention makes of its Wqkv output (model/huginn.py: CausalSelfAttention): q and k plus
    their bias in the dtype, then apply_rope, which rotates in fp32 and rounds once."""
    q, k, v = qkv.view(qkv.shape[0], 3, HUGINN_HEADS, HUGINN_HEAD_DIM).unbind(1)
    return apply_rope(q + bias[0], cos, sin), apply_rope(k + bias[1], cos, sin), v


@pytest.mark.parametrize("m,name", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_with_a_bias_and_fp32_rotation_equals_huginns_attention_inputs(dtype, m, name):
    config = CONFIGS[name]
    x, w = inputs(m, 3 * HUGINN_HEADS * HUGINN_HEAD_DIM, dtype, seed=70 + m)
    bias = torch.randn(2, HUGINN_HEADS, HUGINN_HEAD_DIM, generator=torch.Generator().manual_seed(m)).to(
        DEVICE, dtype)
    positions = torch.randint(0, 4000, (m,), generator=torch.Generator().manual_seed(1))
    cos, sin = (t.to(DEVICE) for t in HuginnRotary(HUGINN_HEAD_DIM, 50000.0)(positions))  # fp32 tables
    got = qkv_rope(x, w, cos, sin, HUGINN_HEADS, HUGINN_HEADS, HUGINN_HEAD_DIM, config=config, bias=bias,
                   rope_fp32=True)
    expected = huginn_attention_inputs(paired_linear(x, w, HUGINN_HEAD_DIM // 2, config), bias, cos, sin)
    # Against torch's bias add and rotation: bitwise, except for the interpreter's truncating bf16 casts
    # (test_fused_kernels.py: tolerance).
    for got_part, expected_part in zip(got, expected):
        assert_matches_torch(got_part, expected_part, "rope")


@pytest.mark.parametrize("m,name", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_add_norms_after_add_equals_the_gemm_then_huginns_two_norms(dtype, m, name):
    """norm_after_add: h = RMSNorm(residual + y) * weight; without a next_weight, h alone (and None)."""
    config = CONFIGS[name]
    x, w, residual, weight, next_weight = norm_operands(m, 96, dtype, seed=80 + m)
    h, normed = linear_add_norms(x, w, residual, weight, next_weight, EPS, config=config, norm_after_add=True)
    expected_h, expected_normed = add_rmsnorm_rmsnorm(residual, skinny_linear(x, w, config=config), weight,
                                                      next_weight, EPS, norm_after_add=True)
    alone, none = linear_add_norms(x, w, residual, weight, None, EPS, config=config, norm_after_add=True)
    assert none is None and torch.equal(alone, h)
    if DEVICE == "cpu":
        assert torch.equal(h, expected_h) and torch.equal(normed, expected_normed)
    else:
        assert_matches_torch(h, expected_h, "norm")
        assert_matches_torch(normed, expected_normed, "norm")


def test_tickets_are_back_at_zero_and_repeated_calls_give_the_same_bits():
    """Split tiles and the row ticket: every ticket is 0 after each call, whichever program finished last."""
    x, w, residual, weight, next_weight = norm_operands(3, 96, torch.bfloat16, seed=30)
    config = GemvConfig(16, 16, split_k=5)
    first = linear_add_norms(x, w, residual, weight, next_weight, EPS, config=config)
    tickets = gemv._WORKSPACES[x.device].tickets
    assert tickets is not None and not tickets.any()
    second = linear_add_norms(x, w, residual, weight, next_weight, EPS, config=config)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    cos, sin = rope_tables(3, torch.bfloat16)
    xq, wq = inputs(3, (HEADS + 2 * KV_HEADS) * HEAD_DIM, torch.bfloat16, seed=31)
    qkv_rope(xq, wq, cos, sin, HEADS, KV_HEADS, HEAD_DIM, config=config)
    gate_up_silu(xq, wq, config=config)
    assert not tickets.any()


def test_a_rows_outputs_do_not_depend_on_the_other_rows_of_its_bucket():
    """Batch invariance: 3 rows alone and the same rows padded to 4 (one bucket) give the same bits."""
    dtype = torch.bfloat16
    x, w, residual, weight, next_weight = norm_operands(4, 96, dtype, seed=40)
    padded = linear_add_norms(x, w, residual, weight, next_weight, EPS)
    alone = linear_add_norms(x[:3].contiguous(), w, residual[:3].contiguous(), weight, next_weight, EPS)
    assert all(torch.equal(p[:3], a) for p, a in zip(padded, alone))
    xq, wq = inputs(4, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype, seed=41)
    cos, sin = rope_tables(4, dtype)
    padded = qkv_rope(xq, wq, cos, sin, HEADS, KV_HEADS, HEAD_DIM)
    alone = qkv_rope(xq[:3].contiguous(), wq, cos[:3], sin[:3], HEADS, KV_HEADS, HEAD_DIM)
    assert all(torch.equal(p[:3], a) for p, a in zip(padded, alone))
    assert torch.equal(gate_up_silu(xq, wq)[:3], gate_up_silu(xq[:3].contiguous(), wq))


def test_mismatched_operands_are_refused_by_name():
    x, w, residual, weight, next_weight = norm_operands(2, 96, torch.float32, seed=50)
    with pytest.raises(ValueError, match="residual"):
        linear_add_norms(x, w, residual[:, :64], weight, next_weight, EPS)
    with pytest.raises(ValueError, match="next_weight"):
        linear_add_norms(x, w, residual, weight, next_weight[:64], EPS)
    cos, sin = rope_tables(2, torch.float32)
    with pytest.raises(ValueError, match="heads"):
        qkv_rope(x, w, cos, sin, HEADS, KV_HEADS, HEAD_DIM)  # 96 rows are not (3 + 2) x 16
    with pytest.raises(ValueError, match="gate_up"):
        gate_up_silu(x, w[:95])


def test_buffers_a_caller_passes_are_written_as_new_ones_would_be():
    """out / outputs (a layer stack reuses them): the same bits as new outputs, in the caller's buffers, one
    of them off 16-byte alignment (another plan); a buffer that is not what a new one would be is refused by
    its name."""
    x, w, residual, weight, next_weight = norm_operands(2, 96, torch.float32, seed=55)
    expected = linear_add_norms(x, w, residual, weight, next_weight, EPS)
    nans = torch.full_like(residual, float("nan"))
    buffers = (nans.clone(), off_alignment(nans))
    got = linear_add_norms(x, w, residual, weight, next_weight, EPS, outputs=buffers)
    assert got[0] is buffers[0] and got[1] is buffers[1]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    xq, wq = inputs(2, (HEADS + 2 * KV_HEADS) * HEAD_DIM, torch.float32, seed=56)
    cos, sin = rope_tables(2, torch.float32)
    out = torch.full((2, wq.shape[0]), float("nan"), device=DEVICE)
    q, k, v = qkv_rope(xq, wq, cos, sin, HEADS, KV_HEADS, HEAD_DIM, out=out)
    assert q.data_ptr() == out.data_ptr()
    new = qkv_rope(xq, wq, cos, sin, HEADS, KV_HEADS, HEAD_DIM)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), new))
    act = torch.full((2, wq.shape[0] // 2), float("nan"), device=DEVICE)
    assert gate_up_silu(xq, wq, out=act) is act and torch.equal(act, gate_up_silu(xq, wq))
    with pytest.raises(ValueError, match=r"outputs\[1\]"):
        linear_add_norms(x, w, residual, weight, next_weight, EPS, outputs=(buffers[0], residual.double()))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        qkv_rope(xq, wq, cos, sin, HEADS, KV_HEADS, HEAD_DIM, out=out.t().contiguous().t())
    with pytest.raises(ValueError, match="out must be a contiguous"):
        gate_up_silu(xq, wq, out=act[:1])


def off_alignment(tensor: torch.Tensor) -> torch.Tensor:
    """tensor's values at an address one element past a 16-byte boundary (torch allocates at 64 bytes)."""
    moved = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)[1:].view_as(tensor)
    assert moved.data_ptr() % 16
    return moved.copy_(tensor)


def test_a_plan_is_built_again_for_another_dtype_or_alignment(monkeypatch):
    """A plan is reused for new operands with the facts it was built for, and only for those: another dtype,
    or any pointer Triton specializes on at another 16-byte alignment (the weight, or an activation), gets a
    plan of its own. Counted in fresh caches, so earlier tests' plans do not count."""
    silu_plans = gemv_epilogues._Plans(gemv_epilogues.skinny_gemm_silu_mul_kernel)
    norm_plans = gemv_epilogues._Plans(gemv_epilogues.skinny_gemm_add_norms_kernel, row_ticket=True)
    monkeypatch.setattr(gemv_epilogues, "_SILU_MUL_PLANS", silu_plans)
    monkeypatch.setattr(gemv_epilogues, "_ADD_NORMS_PLANS", norm_plans)
    x, w = inputs(1, 32, torch.float32, seed=60)
    calls = [(x, w), (x.clone(), w.clone()),  # the same facts: one plan for both
             (off_alignment(x), w), (x, off_alignment(w)), (x.half(), w.half())]
    for count, (xi, wi) in zip([1, 1, 2, 3, 4], calls):
        gate_up_silu(xi, wi)
        assert len(silu_plans.plans) == count

    x, w, residual, weight, next_weight = norm_operands(1, 96, torch.float32, seed=61)
    calls = [(residual, weight, next_weight), (residual.clone(), weight.clone(), next_weight.clone()),
             (off_alignment(residual), weight, next_weight), (residual, off_alignment(weight), next_weight),
             (residual, weight, off_alignment(next_weight))]
    for count, (res, norm, following) in zip([1, 1, 2, 3, 4], calls):
        linear_add_norms(x, w, res, norm, following, EPS)
        assert len(norm_plans.plans) == count
    # weight_keys a caller keeps stand for the weights they were read of, so they key the same plan.
    keys = gemv_epilogues.WeightKeys((w, off_alignment(weight), next_weight)).keys
    linear_add_norms(x, w, residual, off_alignment(weight), next_weight, EPS, weight_keys=keys)
    assert len(norm_plans.plans) == 4


def test_a_layers_weight_keys_are_read_again_when_a_weight_changes():
    """The fused path keeps what the plans key on of a layer's weights (gemv_epilogues.WeightKeys) between
    calls and reads it again when a weight was replaced: converted by .to() (its data, in place), assigned, or
    its data replaced by data at another alignment. Copying into the weights (load_state_dict) keeps the
    keys."""
    layer, path = OuroLayer(OuroConfig.from_dict(hf_config(PRESETS["tiny"]))), FusedOuro(1)
    _, keys = path.layer_weights(layer, 0)
    assert keys[0] == gemv_epilogues.weight_key(layer.qkv_proj.weight) and keys[0][0] == torch.float32
    layer.load_state_dict(OuroLayer(OuroConfig.from_dict(hf_config(PRESETS["tiny"]))).state_dict())
    assert path.layer_weights(layer, 0)[1] is keys
    layer.half()
    _, keys = path.layer_weights(layer, 0)
    assert all(key[0] == torch.float16 for key in keys)
    layer.o_proj.weight = torch.nn.Parameter(off_alignment(layer.o_proj.weight.detach()))
    assert path.layer_weights(layer, 0)[1][1][2] == layer.o_proj.weight.data_ptr() % 16 != 0
    with torch.no_grad():
        layer.down_proj.weight.data = off_alignment(layer.down_proj.weight)
    assert path.layer_weights(layer, 0)[1][3][2] == layer.down_proj.weight.data_ptr() % 16 != 0


# --------------------------------------------------------------------------------------------------
# GPU: Ouro-1.4B's shapes (hidden 2048, 16 heads x 128, intermediate 5632)


def eager_then_graph(fn) -> tuple[torch.Tensor, ...]:
    """fn()'s outputs eagerly; fn captured in a CUDA graph and replayed must give the same bits."""
    eager = fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, static))
    return eager


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_epilogue_variants_match_the_unfused_composition_at_ouro_shapes(dtype, m):
    """rope and silu-mul bitwise equal to the plain kernel then the elementwise kernel, the W rows in their
    own order; add_norms within the norm tolerance; eager equals graph replay; every ticket back at 0."""
    hidden, heads, head_dim, intermediate = 2048, 16, 128, 5632
    gemv.reserve_workspace("cuda")
    g = torch.Generator().manual_seed(m)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to("cuda", dtype)

    x, w_qkv = randn(m, hidden), randn(3 * heads * head_dim, hidden, scale=0.02)
    cos, sin = (t.cuda() for t in Rotary(head_dim, 1e6)(torch.randint(0, 60000, (m,), generator=g), dtype))
    q, k, v = eager_then_graph(lambda: qkv_rope(x, w_qkv, cos, sin, heads, heads, head_dim))
    expected = rope_qkv(skinny_linear(x, w_qkv), cos, sin, heads, heads, head_dim)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), expected))
    w_gate_up = randn(2 * intermediate, hidden, scale=0.02)
    act, = eager_then_graph(lambda: (gate_up_silu(x, w_gate_up),))
    assert torch.equal(act, silu_mul(skinny_linear(x, w_gate_up)))
    residual = randn(m, hidden)
    weight, next_weight = 1 + randn(hidden, scale=0.1), 1 + randn(hidden, scale=0.1)
    for inputs, w in ((x, randn(hidden, hidden, scale=0.02)), (act, randn(hidden, intermediate, scale=0.02))):
        h, normed = eager_then_graph(lambda: linear_add_norms(inputs, w, residual, weight, next_weight, EPS))
        expected_h, expected_normed = add_rmsnorm_rmsnorm(residual, skinny_linear(inputs, w), weight,
                                                          next_weight, EPS)
        assert_matches_torch(h, expected_h, "norm")
        assert_matches_torch(normed, expected_normed, "norm")
    assert not gemv._WORKSPACES[x.device].tickets.any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_a_bf16_layer_at_ouro_shape_is_as_exact_on_the_epilogue_path_as_unfused(rows):
    """One Ouro-1.4B-shaped layer (random weights, each row attending to its own key only) in bf16 through
    the 4 epilogue launches and through the unfused composition, against the layer in fp64: no farther from
    it than tests/numerics.py's bound (4x the unfused path's own error, plus a few ulps)."""
    config = OuroConfig.from_dict(hf_config(dict(PRESETS["ouro-1.4b"], num_hidden_layers=1)))
    torch.manual_seed(rows)
    layer = OuroLayer(config)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            parameter.copy_(1 + 0.1 * torch.randn_like(parameter) if "norm" in name
                            else 0.02 * torch.randn_like(parameter))
    bf16, exact = layer.to("cuda", torch.bfloat16), OuroLayer(config).to("cuda", torch.float64)
    exact.load_state_dict(bf16.state_dict())
    h = torch.randn(rows, config.hidden_size, device="cuda")
    next_weight = 1 + 0.1 * torch.randn(config.hidden_size, device="cuda")
    positions = torch.randint(0, 60000, (rows,), device="cuda")
    rotary = Rotary(config.head_dim, config.rope_theta).cuda()

    def own_key_only(q, k, v, slot):
        return v.contiguous()

    with torch.inference_mode():
        hb, wb = h.bfloat16(), next_weight.bfloat16()
        cos, sin = rotary(positions, torch.bfloat16)
        normed = rmsnorm(hb, bf16.input_layernorm.weight, config.rms_norm_eps)
        buffers, path = EpilogueBuffers.for_rows(hb, config), FusedOuro(1)
        fused = path.layer_forward(bf16, 0, hb, normed, cos, sin, own_key_only, 0, wb, epilogues=buffers)
        unfused = path.layer_forward(bf16, 0, hb, normed, cos, sin, own_key_only, 0, wb, epilogues=None)
        cos64, sin64 = rotary(positions, torch.float64)
        h64 = exact(hb.double(), cos64, sin64, own_key_only, 0)
        xf = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
        normed64 = wb.double() * xf
    assert_within_noise(fused[0], unfused[0], h64, "h")
    assert_within_noise(fused[1], unfused[1], normed64, "next pre-norm")


# Where the two paths' greedy tokens part, the unfused path's top-2 logprob gap there (nats) is at most this:
# a near tie that bf16 rounding in either path may break either way.
NEAR_TIE = 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [4, 1])
def test_engine_greedy_tokens_on_the_epilogue_path_match_unfused_or_part_at_near_ties(tmp_path, batch):
    """A 2-layer model of Ouro-1.4B's shapes (random weights), bf16, 4 loops: the default engine (epilogue
    path, CUDA graphs) against an eager engine on the unfused composition, batch 4 of mixed prompts or one
    prompt. At batch 1 the projections take the one-row configs, qkv, o and gate_up preloading their weights
    before the PDL wait: there an eager engine on the same path must give the graphs' tokens exactly."""
    path = write_checkpoint(tmp_path / "ouro-2-layers", "ouro-1.4b", layers=2)
    prompts = [[3 + 17 * i + j for j in range(5 + 9 * i)] for i in range(4)][:batch]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    options = dict(device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8, verbose=False)
    with Engine(path, **options) as engine:
        fused = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    if batch == 1:
        assert gemv.select_config(1, 2048, 2048, torch.bfloat16).preload  # o: the path this case is for
        with Engine(path, enforce_eager=True, **options) as engine:
            eager = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
        assert [o.token_ids for o in eager] == [o.token_ids for o in fused]
    with Engine(path, enforce_eager=True, **options) as engine:
        engine.model.fused_epilogues = False
        unfused = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    for got, want in zip(fused, unfused):
        parted = next((t for t, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if parted is not None:
            top = sorted((p.logprob for p in want.logprobs[parted].values()), reverse=True)
            gap = top[0] - top[1]
            assert gap <= NEAR_TIE, f"tokens part at {parted} where the unfused top-2 gap is {gap:.3g}"
