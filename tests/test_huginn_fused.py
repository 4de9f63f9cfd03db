"""Huginn's fused path (model/huginn_fused.py: its blocks as the skinny GEMM's epilogues at decode sizes, the
CUDA configuration; here in the Triton interpreter) computes the torch path's network: every piece of the
forward pass no farther from the exact answer than the torch path in the same dtype (tests/numerics.py), the
Engine's fp32 greedy tokens the oracle's, and a block at decode sizes 4 model launches. The GPU test runs
Huginn-0125's widths in bf16.

The interpreter's bf16 casts truncate (tests/test_fused_kernels.py), so the CPU tests take fp16 for the
half-precision bound: it rounds to nearest there, as every dtype does on CUDA."""

import pytest
import torch

from engine import Engine, SamplingParams
from model.huginn import HuginnConfig, HuginnForCausalLM, Rotary
from model.huginn_loader import load_huginn
from model.kernels import gemv
from model.kernels.gemv import GemvConfig
from model.kernels.gemv_epilogues import MAX_EPILOGUE_M, MAX_NORM_EPILOGUE_M
from model.tiny import HUGINN_PRESETS, huginn_hf_config
from tests.numerics import assert_within_noise
from tests.reference_huginn import ReferenceHuginn
from tests.test_fused_model import launched_kernels
from tests.test_huginn_engine import PROMPTS, write_head_dim_96_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Huginn at width 192 over 2 heads: Huginn-0125's head_dim, 96, which is no power of two."""
    return write_head_dim_96_checkpoint(tmp_path_factory.mktemp("huginn-fused") / "huginn-96")


@pytest.fixture
def coarse_gemm_tiles(monkeypatch):
    """One N tile of 128 rows and no split for every skinny GEMM: a few programs a launch, which the
    interpreter runs in seconds (tests/test_gemv_epilogues.py covers tiles, splits and the FMA path)."""
    monkeypatch.setattr(gemv, "select_config",
                        lambda m, n, k, dtype, sm_count=0: GemvConfig(128, 128, use_dot=m > 1))


def dense_causal_attention(q, k, v, slot):
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)


def forward_pieces(model: HuginnForCausalLM, ids: torch.Tensor, recurrences: int) -> dict[str, torch.Tensor]:
    """The injection, each recurrence's state, the coda's hidden and the logits, over the rows of ids."""
    with torch.inference_mode():
        cos, sin = model.rotary(torch.arange(ids.shape[0], device=ids.device))
        pieces = {"injection": model.run_prelude(ids, cos, sin, dense_causal_attention)}
        state = torch.zeros_like(pieces["injection"])
        for i in range(recurrences):
            state = pieces[f"state {i}"] = model.core_step(state, pieces["injection"], cos, sin,
                                                           dense_causal_attention, i)
        pieces["hidden"] = model.run_coda(state, cos, sin, dense_causal_attention, recurrences)
        pieces["logits"] = model.logits(pieces["hidden"])
    return pieces


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_pieces_are_as_close_to_exact_as_the_torch_paths(checkpoint, coarse_gemm_tiles, dtype, rows):
    """Rows that take the epilogue GEMMs (the norm epilogue at one row): the injection, every recurrence's
    state, the coda's hidden and the logits against the network in fp64, within tests/numerics.py's bound:
    no farther than 4x the torch path in the same dtype (both round the same ops in other orders), plus a
    few ulps."""
    config = HuginnConfig.from_file(checkpoint / "config.json")
    model = load_huginn(checkpoint, config, DEVICE, dtype, fused_kernels=True)
    exact_model = load_huginn(checkpoint, config, DEVICE, torch.float64)
    ids = torch.randint(0, config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    ids = ids.to(DEVICE)
    fused = forward_pieces(model, ids, 2)
    model.fused_kernels = False
    plain, exact = forward_pieces(model, ids, 2), forward_pieces(exact_model, ids, 2)
    for name in exact:
        assert_within_noise(fused[name], plain[name], exact[name], name)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2, MAX_EPILOGUE_M, MAX_EPILOGUE_M + 1])
def test_the_model_launches_of_a_decode_sized_recurrence_and_coda(checkpoint, monkeypatch, coarse_gemm_tiles,
                                                                   rows):
    """A recurrence: the adapter (a skinny GEMM on CUDA, F.linear here) and the first pre-norm, then per core
    block the 4 epilogue GEMMs; past MAX_NORM_EPILOGUE_M rows the two norms after attention's and the MLP's
    projections are the norm kernel's (after plain skinny GEMMs on CUDA, F.linear here). The coda: ln_f and
    the first pre-norm in one launch, then its blocks. Past MAX_EPILOGUE_M rows: the torch ops, no Triton."""
    config = HuginnConfig.from_file(checkpoint / "config.json")
    model = load_huginn(checkpoint, config, DEVICE, torch.float32, fused_kernels=True)
    state, e = torch.randn(2, rows, config.n_embd, device=DEVICE)
    cos, sin = model.rotary(torch.arange(rows, device=DEVICE))
    names = launched_kernels(monkeypatch)
    with torch.inference_mode():
        model.core_step(state, e, cos, sin, dense_causal_attention, 0)
        recurrence = list(names)
        names.clear()
        model.run_coda(state, cos, sin, dense_causal_attention, 1)
    linear = ["skinny_gemm_kernel"] if DEVICE == "cuda" else []
    if rows <= MAX_NORM_EPILOGUE_M:
        block = ["skinny_gemm_rope_kernel", "skinny_gemm_add_norms_kernel", "skinny_gemm_silu_mul_kernel",
                 "skinny_gemm_add_norms_kernel"]
    elif rows <= MAX_EPILOGUE_M:
        block = ["skinny_gemm_rope_kernel", *linear, "rmsnorm_kernel", "skinny_gemm_silu_mul_kernel", *linear,
                 "rmsnorm_kernel"]
    else:
        assert recurrence == names == []
        return
    assert recurrence == linear + ["rmsnorm_kernel"] + block * config.n_layers_in_recurrent_block
    assert names == ["rmsnorm_kernel"] + block * config.n_layers_in_coda


@pytest.mark.interpreter
def test_engine_on_the_fused_path_gives_the_oracles_greedy_tokens_fp32(checkpoint, coarse_gemm_tiles,
                                                                       monkeypatch):
    """The Triton backend with the fused kernels (the CUDA configuration, here under the interpreter): a
    prefill of two prompts and their two decode rows, then one prompt alone (one decode row: the norm
    epilogue), all through the epilogue GEMMs, at head_dim 96."""
    reference = ReferenceHuginn(checkpoint)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with Engine(checkpoint, device="cpu", dtype="float32", attention="triton", loops=2, init_scale=0,
                verbose=False) as engine:
        engine.model.fused_kernels = True
        assert sum(map(len, PROMPTS[:2])) <= MAX_EPILOGUE_M
        names = launched_kernels(monkeypatch)
        pair = engine.generate(PROMPTS[:2], params, use_tqdm=False)
        alone = engine.generate(PROMPTS[2:3], params, use_tqdm=False)
    assert names.count("skinny_gemm_add_norms_kernel") > 0 and names.count("skinny_gemm_rope_kernel") > 0
    tokens = [list(o.outputs[0].token_ids) for o in pair + alone]
    assert tokens == [reference.generate(p, 3, 2).tokens for p in PROMPTS[:3]]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_huginn_0125_widths_in_bf16_are_as_exact_fused_as_through_torch(rows):
    """One prelude, one core and one coda block at Huginn-0125's widths (5280 = 55 heads x 96, intermediate
    17920, vocab 65536; random weights, the q/k bias on), bf16, 2 recurrences: each piece of the forward pass
    on the fused path (the norm epilogue at one row, the norm kernel at 4 and 16) no farther from the network
    in fp64 than 4x the torch path in bf16 (tests/numerics.py)."""
    shape = {**HUGINN_PRESETS["huginn-0125"], "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 1,
             "n_layers_in_coda": 1}
    config = HuginnConfig.from_dict(huginn_hf_config(shape, "bfloat16"))
    assert (config.n_embd, config.head_dim, config.intermediate_size) == (5280, 96, 17920)
    with torch.device("meta"):
        model, exact = HuginnForCausalLM(config, fused_kernels=True), HuginnForCausalLM(config)
    g = torch.Generator("cuda").manual_seed(rows)
    state = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=g, device="cuda")
        state[name] = (1 + 0.1 * noise if "norm" in name or "ln_f" in name else 0.02 * noise).bfloat16()
    model.load_state_dict(state, assign=True)
    exact.load_state_dict({name: tensor.double() for name, tensor in state.items()}, assign=True)
    for network in (model, exact):  # the fp32 angle tables of both, as the loader makes them
        network.rotary = Rotary(config.head_dim, config.rope_base).cuda()
    ids = torch.randint(0, config.vocab_size, (rows,), device="cuda")
    gemv.reserve_workspace("cuda")
    fused = forward_pieces(model, ids, 2)
    model.fused_kernels = False
    plain, exact_pieces = forward_pieces(model, ids, 2), forward_pieces(exact, ids, 2)
    for name in exact_pieces:
        assert_within_noise(fused[name], plain[name], exact_pieces[name], name)
