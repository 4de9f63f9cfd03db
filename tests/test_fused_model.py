"""The model's fused-kernel path (Triton around the GEMMs, used on CUDA) is as exact as its torch path."""

import pytest
import torch

from model.config import OuroConfig
from model.loader import load_model
from tests.numerics import assert_within_noise


def dense_causal_attention(q, k, v, slot):
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_loops_are_as_close_to_exact_as_torch_loops(tiny_checkpoint, dtype):
    """Hidden states and gate logits of every loop against the torch path in fp64, within
    tests/numerics.py's bound: no farther than 4x the torch path in the same dtype."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = OuroConfig.from_file(tiny_checkpoint / "config.json")
    model = load_model(tiny_checkpoint, config, device, dtype, fused_kernels=True)
    exact_model = load_model(tiny_checkpoint, config, device, torch.float64)
    ids = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(9, device=device)
    with torch.inference_mode():
        fused = model(ids, positions, dense_causal_attention)
        model.fused_kernels = False
        plain = model(ids, positions, dense_causal_attention)
        exact = exact_model(ids, positions, dense_causal_attention)
    assert fused.hidden.dtype == plain.hidden.dtype == dtype
    for loop in range(config.total_ut_steps):
        assert_within_noise(fused.hidden[loop], plain.hidden[loop], exact.hidden[loop], f"loop {loop}")
    assert_within_noise(fused.gate_logits, plain.gate_logits, exact.gate_logits, "gate logits")
