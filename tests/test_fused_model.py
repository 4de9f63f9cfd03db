"""The model's fused-kernel path (Triton around the GEMMs, used on CUDA) is as exact as its torch path, and a
layer at one row is 4 model launches (model/kernels/gemv_epilogues.py)."""

import pytest
import torch

from engine import Engine, SamplingParams
from model.config import OuroConfig
from model.kernels import gemv
from model.kernels.gemv import GemvConfig
from model.kernels.gemv_epilogues import MAX_EPILOGUE_M, MAX_NORM_EPILOGUE_M
from model.loader import load_model
from tests.numerics import assert_within_noise
from tests.reference import ReferenceOuro
from tests.test_engine_parity import PROMPTS
from triton_runtime.launch import CompiledLaunch


def dense_causal_attention(q, k, v, slot):
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)


@pytest.fixture
def coarse_gemm_tiles(monkeypatch):
    """One N tile of 128 rows and no split for every skinny GEMM: a few programs a launch, which the
    interpreter runs in seconds (test_gemv_epilogues.py covers tiles, splits and the FMA path)."""
    monkeypatch.setattr(gemv, "select_config",
                        lambda m, n, k, dtype, sm_count=0: GemvConfig(128, 128, use_dot=m > 1))


@pytest.mark.parametrize("epilogues,rows", [(False, 9), (True, 9), (True, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_loops_are_as_close_to_exact_as_torch_loops(tiny_checkpoint, dtype, epilogues, rows,
                                                          coarse_gemm_tiles):
    """Hidden states and gate logits of every loop against the torch path in fp64, within
    tests/numerics.py's bound: no farther than 4x the torch path in the same dtype. The rows take the
    epilogue GEMMs (at most MAX_EPILOGUE_M; the norm epilogue at one row), or the unfused composition."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = OuroConfig.from_file(tiny_checkpoint / "config.json")
    model = load_model(tiny_checkpoint, config, device, dtype, fused_kernels=True)
    model.fused_epilogues = epilogues
    exact_model = load_model(tiny_checkpoint, config, device, torch.float64)
    ids = torch.randint(0, config.vocab_size, (rows,), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(rows, device=device)
    with torch.inference_mode():
        fused = model(ids, positions, dense_causal_attention)
        model.fused_kernels = False
        plain = model(ids, positions, dense_causal_attention)
        exact = exact_model(ids, positions, dense_causal_attention)
    assert fused.hidden.dtype == plain.hidden.dtype == dtype
    for loop in range(config.total_ut_steps):
        assert_within_noise(fused.hidden[loop], plain.hidden[loop], exact.hidden[loop], f"loop {loop}")
    assert_within_noise(fused.gate_logits, plain.gate_logits, exact.gate_logits, "gate logits")


def launched_kernels(monkeypatch) -> list[str]:
    """Names of the Triton kernels launched through CompiledLaunch (all the model's launches), in order."""
    names = []
    call = CompiledLaunch.__call__

    def counted(self, stream, args):
        names.append(self.fn.__name__)
        call(self, stream, args)

    monkeypatch.setattr(CompiledLaunch, "__call__", counted)
    return names


@pytest.mark.parametrize("rows", [1, 2, MAX_EPILOGUE_M, MAX_EPILOGUE_M + 1])
def test_the_model_launches_of_a_decode_sized_layer(tiny_checkpoint, monkeypatch, coarse_gemm_tiles, rows):
    """A loop at decode sizes: the first pre-norm, then per layer the 4 epilogue GEMMs (attention is the
    callable's). Past MAX_NORM_EPILOGUE_M rows the o and down GEMMs are followed by the norm kernel (plain
    skinny GEMMs on CUDA, F.linear here); past MAX_EPILOGUE_M rows the unfused composition's elementwise
    kernels run instead (its GEMMs are cuBLAS on CUDA, F.linear here)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = OuroConfig.from_file(tiny_checkpoint / "config.json")
    model = load_model(tiny_checkpoint, config, device, torch.float32, fused_kernels=True)
    h = torch.randn(rows, config.hidden_size, device=device)
    cos, sin = model.rotary(torch.arange(rows, device=device), h.dtype)
    names = launched_kernels(monkeypatch)
    with torch.inference_mode():
        model.run_loop(h, cos, sin, dense_causal_attention, 0)
    if rows <= MAX_NORM_EPILOGUE_M:
        layer = ["skinny_gemm_rope_kernel", "skinny_gemm_add_norms_kernel", "skinny_gemm_silu_mul_kernel",
                 "skinny_gemm_add_norms_kernel"]
    elif rows <= MAX_EPILOGUE_M:
        linear = ["skinny_gemm_kernel"] if device.type == "cuda" else []
        layer = ["skinny_gemm_rope_kernel", *linear, "rmsnorm_kernel",
                 "skinny_gemm_silu_mul_kernel", *linear, "rmsnorm_kernel"]
    else:
        layer = ["rope_qkv_kernel", "rmsnorm_kernel", "silu_mul_kernel", "rmsnorm_kernel"]
    assert names == ["rmsnorm_kernel"] + layer * config.num_hidden_layers


@pytest.mark.interpreter
def test_engine_on_the_epilogue_path_gives_the_oracles_greedy_tokens_fp32(tiny_checkpoint, coarse_gemm_tiles):
    """The Triton backend with the fused kernels (the CUDA configuration, here under the interpreter): the
    steps' rows (a prefill of two prompts, then two decode rows) all take the epilogue GEMMs."""
    reference = ReferenceOuro(tiny_checkpoint, loops=2)
    prompts = PROMPTS[:2]
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", attention="triton", loops=2,
                verbose=False) as engine:
        engine.model.fused_kernels = True
        ids = [engine.tokenizer.encode(p) for p in prompts]
        assert sum(map(len, ids)) <= MAX_EPILOGUE_M
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                  use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [reference.greedy(i, 3) for i in ids]
