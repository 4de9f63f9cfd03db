"""The model's fused-kernel path (Triton around the GEMMs, used on CUDA) equals its torch path."""

import pytest
import torch

from model.config import OuroConfig
from model.loader import load_model


def dense_causal_attention(q, k, v, slot):
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_fused_loops_match_torch_loops(tiny_checkpoint, dtype, tolerance):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = OuroConfig.from_file(tiny_checkpoint / "config.json")
    model = load_model(tiny_checkpoint, config, device, dtype, fused_kernels=True)
    ids = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(9, device=device)
    with torch.inference_mode():
        fused = model(ids, positions, dense_causal_attention)
        model.fused_kernels = False
        plain = model(ids, positions, dense_causal_attention)
    torch.testing.assert_close(fused.hidden.float(), plain.hidden.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(fused.gate_logits.float(), plain.gate_logits.float(),
                               rtol=tolerance, atol=tolerance)
