"""The skinny GEMM (model/kernels/gemv.py) against torch at tiny shapes. Without CUDA it runs in the Triton
interpreter (conftest sets TRITON_INTERPRET=1), so shapes stay small; the GPU test runs Ouro's shapes.

Tolerance: the rounding-error bound of a dot product, elementwise, against an fp64 reference. The kernel sums
K products in fp32 (exact for fp16 and bf16 inputs, each rounded for fp32), in any order and split: that errs
by at most gamma_K * sum_k |x_k w_k|, gamma_K = K u / (1 - K u) with u = 2^-24 (Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed., section 3.1). Rounding once to the output dtype adds u_out |y|:
2^-24, 2^-11, 2^-8 for fp32, fp16, bf16, twice that for bf16 under the interpreter, whose fp32 -> bf16 cast
truncates (triton 3.x)."""

import pytest
import torch
import torch.nn.functional as F

from model.kernels import gemv
from model.kernels.gemv import GemvConfig, linear, skinny_linear
from tests.numerics import unit_roundoff

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
SHAPES = [(96, 80), (256, 128)]  # (N, K): neither a multiple of every block size
# Configs at tiny shapes: several N tiles, K blocks that do not divide K, and splits of K.
CONFIGS = {
    "default": None,
    "dot_split3": GemvConfig(16, 32, split_k=3),
    "dot_split2": GemvConfig(32, 64, split_k=2, num_stages=2),
    "fma_split2": GemvConfig(16, 32, split_k=2, use_dot=False),  # M <= MAX_FMA_M only
    "fma_preload": GemvConfig(16, 32, use_dot=False, preload=True),  # K padded to a power of 2
    "fma_preload_split2": GemvConfig(16, 32, split_k=2, use_dot=False, preload=True),  # the last split short
}


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Every element within the module doc's bound: u_out |ref| + (1 + u_out) gamma_K (|x| @ |w|^T)."""
    ref = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    k, u = x.shape[1], 2.0**-24
    gamma = k * u / (1 - k * u)
    u_out = unit_roundoff(y.dtype) * (2 if INTERPRETED and y.dtype == torch.bfloat16 else 1)
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()
    excess = (y.double() - ref).abs() - (u_out * ref.abs() + (1 + u_out) * gamma * magnitude)
    assert excess.max() <= 0, f"{y.dtype}: {excess.max().item():.3g} past the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch(dtype, n, k, m, name):
    config = CONFIGS[name]
    if config is not None and not config.use_dot and m > gemv.MAX_FMA_M:
        with pytest.raises(ValueError, match="FMA path"):
            skinny_linear(torch.zeros(m, k, dtype=dtype, device=DEVICE),
                          torch.zeros(n, k, dtype=dtype, device=DEVICE), config=config)
        return
    torch.manual_seed(n * 1000 + k * 10 + m)
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: every element written
    y = skinny_linear(x, w, out=out, config=config)
    assert y is out
    check_close(y, x, w)


@pytest.mark.parametrize("name", ["fma_preload", "fma_preload_split2"])
def test_two_fma_rows_are_each_its_one_row_product(name):
    """The FMA path's two rows (a pipelined pass's at batch 1, or batch 2) read the weight once and give each
    row the bits it gets alone, preloaded; streamed, the two rows agree with torch (test_matches_torch)."""
    torch.manual_seed(4)
    x = torch.randn(2, 80, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(96, 80, dtype=torch.bfloat16, device=DEVICE)
    config = CONFIGS[name]
    both = skinny_linear(x, w, config=config)
    for row in range(2):
        assert torch.equal(both[row], skinny_linear(x[row:row + 1].contiguous(), w, config=config)[0])


@pytest.mark.parametrize("name", ["dot_split3", "fma_preload"])
def test_a_set_skip_flag_leaves_the_output_unwritten_and_a_clear_one_gives_the_same_bits(name):
    """skinny_linear(skip=flag): the head of a chained pass in which no row reads out reads no weight; with
    the flag clear it is the plain kernel, bit for bit (split-K tickets reset either way)."""
    torch.manual_seed(5)
    x = torch.randn(2, 80, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(96, 80, dtype=torch.bfloat16, device=DEVICE)
    config = CONFIGS[name]
    out = torch.full((2, 96), 7.0, dtype=torch.bfloat16, device=DEVICE)
    skinny_linear(x, w, out=out, config=config, skip=torch.ones(1, dtype=torch.bool, device=DEVICE))
    assert (out == 7).all()
    y = skinny_linear(x, w, out=out, config=config, skip=torch.zeros(1, dtype=torch.bool, device=DEVICE))
    assert torch.equal(y, skinny_linear(x, w, config=config))
    tickets = gemv._WORKSPACES[x.device].tickets
    assert tickets is None or not tickets.any()
    with pytest.raises(ValueError, match="skip must be one bool"):
        skinny_linear(x, w, config=GemvConfig(32, 16), skip=torch.zeros(2, dtype=torch.bool, device=DEVICE))


def test_deterministic_and_tickets_reset():
    torch.manual_seed(1)
    x = torch.randn(3, 80, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(96, 80, dtype=torch.bfloat16, device=DEVICE)
    config = GemvConfig(16, 16, split_k=5)
    first = skinny_linear(x, w, config=config)
    second = skinny_linear(x, w, config=config)
    assert torch.equal(first, second)
    tickets = gemv._WORKSPACES[x.device].tickets
    assert tickets is not None and not tickets.any()


def test_rows_do_not_depend_on_padding_rows():
    """A row gives the same bits at any M of its bucket: eager batch 3 vs a graph padded to 4."""
    torch.manual_seed(2)
    x = torch.randn(4, 128, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(256, 128, dtype=torch.bfloat16, device=DEVICE)
    assert gemv.select_config(3, 256, 128, torch.bfloat16) == gemv.select_config(4, 256, 128, torch.bfloat16)
    padded = skinny_linear(x, w)
    alone = skinny_linear(x[:3].contiguous(), w)
    assert torch.equal(padded[:3], alone)


def test_strided_and_batched_inputs():
    torch.manual_seed(3)
    w = torch.randn(96, 80, dtype=torch.float32, device=DEVICE)
    wide = torch.randn(3, 200, dtype=torch.float32, device=DEVICE)
    x = wide[:, 40:120]  # row stride 200
    check_close(skinny_linear(x, w), x, w)
    x3 = torch.randn(2, 3, 80, dtype=torch.float32, device=DEVICE)
    y3 = skinny_linear(x3, w)
    assert y3.shape == (2, 3, 96)
    check_close(y3.view(6, 96), x3.view(6, 80), w)


@pytest.mark.parametrize("tile_block_k", [None, 16])
@pytest.mark.parametrize("split_programs", [False, True])
@pytest.mark.parametrize("n,k,split", [(96, 80, 3), (64, 256, 2)])
def test_tiled_kernel_gives_the_skinny_kernels_bits(n, k, split, split_programs, tile_block_k):
    """tiled_linear (deterministic mode past MAX_SKINNY_M rows), its splits in one program's loop or a
    program each, its K block the config's or (on a GPU) half of it, against skinny_linear under the same
    config: the same bits, with K not a multiple of the K block (the last split short) and tiles past M and
    N."""
    torch.manual_seed(n + k)
    x = torch.randn(70, k, device=DEVICE)  # fp32: a sum in another order shows in the output's bits
    w = torch.randn(n, k, device=DEVICE)
    config = GemvConfig(32, 32, split_k=split, block_m=gemv.MAX_SKINNY_M)
    tile = gemv.TiledTile(gemv.MAX_SKINNY_M, 32, 4, 2, group_m=2, split_programs=split_programs,
                          block_k=tile_block_k)
    tiled = gemv.tiled_linear(x, w, config, tile=tile)
    skinny = torch.cat([skinny_linear(x[:64], w, config=config), skinny_linear(x[64:], w, config=config)])
    assert torch.equal(tiled, skinny)
    assert not gemv._WORKSPACES[x.device].tickets.any()


def test_buckets_and_config_lookup(monkeypatch):
    assert [gemv.m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32,
                                                                                   64, 64]
    table = {1: GemvConfig(16, 512, use_dot=False), 4: GemvConfig(32, 256, 2), 64: GemvConfig(128, 128)}
    monkeypatch.setitem(gemv.TUNED, (6144, 2048), table)
    bf16 = torch.bfloat16
    assert gemv.select_config(1, 6144, 2048, bf16) == table[1]
    assert gemv.select_config(2, 6144, 2048, bf16) == table[4]  # the nearest measured bucket above
    assert gemv.select_config(9, 6144, 2048, bf16) == table[64]
    fp32 = torch.float32
    assert gemv.select_config(1, 6144, 2048, fp32) == gemv.default_config(1, 6144, 2048, fp32)
    for m in (1, 4, 16, 64):
        config = gemv.default_config(m, 2048, 5632, bf16)
        grid, _ = gemv.kernel_args(m, 2048, 5632, 5632, 5632, 2048, bf16, config)
        assert grid[0] * grid[1] >= 2 * gemv.CPU_SM_COUNT  # the default fills the SMs


def test_preload_configs_are_checked():
    bf16, preload = torch.bfloat16, GemvConfig(8, 512, use_dot=False, preload=True)
    assert gemv.kernel_args(1, 2048, 2048, 2048, 2048, 2048, bf16, preload)[1][-1] == 2048  # PRELOAD_K
    assert gemv.kernel_args(1, 2048, 2000, 2000, 2000, 2048, bf16, preload)[1][-1] == 2048  # K's power of 2
    streamed = GemvConfig(8, 512, use_dot=False)
    assert gemv.kernel_args(1, 2048, 2048, 2048, 2048, 2048, bf16, streamed)[1][-1] == 0
    # A split preloads its own columns: down's 22 blocks of 256 in 3 splits of 8 blocks, 2,048 columns.
    split = GemvConfig(8, 256, split_k=3, use_dot=False, preload=True)
    assert gemv.kernel_args(1, 2048, 5632, 5632, 5632, 2048, bf16, split)[1][-1] == 2048
    for config, k in ((GemvConfig(16, 512, use_dot=True, preload=True), 2048),  # the dot path
                      (preload, 5632)):  # 8 x 8192 bf16 = 128 KB, past 4 warps' 32 KB
        with pytest.raises(ValueError, match="preload"):
            gemv.kernel_args(1, 2048, k, k, k, 2048, bf16, config)


def test_a_plan_serves_only_its_operands_dtypes():
    """A cached launch plan is keyed by every operand's dtype: one built for an fp32 weight is not taken for
    an fp16 weight of the same shape (which must be refused, as it is on a first call)."""
    x = torch.randn(2, 80, device=DEVICE)
    w = torch.randn(96, 80, device=DEVICE)
    skinny_linear(x, w)
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_linear(x, w.half())


def test_linear_dispatch_off_cuda_is_f_linear():
    x = torch.randn(2, 80)
    w = torch.randn(96, 80)
    if DEVICE == "cpu":
        assert torch.equal(linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError):
        skinny_linear(x.to(DEVICE), w.to(DEVICE).half())


OURO = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
        "lm_head": (49152, 2048)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(OURO))
def test_ouro_shapes_on_gpu(shape):
    n, k = OURO[shape]
    torch.manual_seed(4)
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    gemv.reserve_workspace("cuda")
    for m in (1, 3, 4, 16, 33, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = linear(x, w, out=out)
        check_close(y, x, w)
        assert torch.equal(y, skinny_linear(x, w))  # deterministic
        # A CUDA graph replays the same bits as eager.
        static = torch.empty_like(y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            linear(x, w, out=static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, y)
    x = torch.randn(4, k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(linear(x, w)[:3], linear(x[:3].contiguous(), w))
