"""The engine's greedy tokens equal the dense fp32 oracle's (tests/reference.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from attention.registry import select
from engine import Engine, SamplingParams
from model.tiny import random_weights
from tests.conftest import ROOT
from tests.numerics import assert_within_noise
from tests.reference import ReferenceOuro

PROMPTS = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog again and again",
           "0123456789 + - * / = 42"]


@pytest.mark.parametrize("loops", [1, 2, 4])
def test_greedy_tokens_match_reference_fp32(tiny_checkpoint, loops):
    reference = ReferenceOuro(tiny_checkpoint, loops=loops)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", loops=loops, verbose=False) as engine:
        outputs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                  use_tqdm=False)
        prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(ids) for ids in prompt_ids}) == len(PROMPTS)  # mixed lengths
    for ids, out in zip(prompt_ids, outputs):
        assert out.outputs[0].token_ids == reference.greedy(ids, 16)
        assert out.outputs[0].finish_reason == "length"


def _dense_attention(q, k, v, slot):
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_logits_in_each_dtype_are_as_close_to_exact_as_the_oracle_in_that_dtype(tiny_checkpoint, dtype):
    """The engine's logits in `dtype` against the exact (fp64) ones, within tests/numerics.py's bound: no
    farther than 4x the plain oracle run in the same dtype (bf16 keeps 8 mantissa bits, fp16 11: after 4
    loops x 2 layers both are off by a few % and a few 0.1 % of the largest logit)."""
    exact_oracle, oracle = ReferenceOuro(tiny_checkpoint, dtype=torch.float64), ReferenceOuro(tiny_checkpoint,
                                                                                               dtype=dtype)
    with Engine(tiny_checkpoint, device="cpu", dtype=dtype, verbose=False) as engine:
        ids = engine.tokenizer.encode(PROMPTS[2])
        with torch.inference_mode():
            states = engine.model(torch.tensor(ids), torch.arange(len(ids)), _dense_attention)
            logits = engine.model.compute_logits(states.hidden[-1])
    exact, expected = ((r.loop_states(ids)[0][-1] @ r.lm_head.T) for r in (exact_oracle, oracle))
    assert logits.dtype == expected.dtype == dtype
    assert_within_noise(logits, expected, exact, f"logits in {dtype}")


def test_cli_generate_runs_offline_on_the_embedded_model(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    result = subprocess.run([sys.executable, "engine.py", "generate", "--max-tokens", "5", "--device", "cpu"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("A looped language model")
    assert "tok/s" in result.stderr and "GB/s" in result.stderr


def test_cli_help_documents_every_flag():
    result = subprocess.run([sys.executable, "engine.py", "generate", "--help"],
                            cwd=ROOT, capture_output=True,
                            text=True)
    for flag in ("--model", "--prompt", "--chat", "--prompts-file", "--max-tokens", "--temperature",
                 "--top-p", "--top-k", "--min-p", "--seed", "--stop", "--ignore-eos", "--loops", "--device",
                 "--dtype", "--threads", "--max-model-len", "--num-kv-blocks", "--kv-cache-gib", "--stream",
                 "--min-tokens", "--repetition-penalty", "--presence-penalty", "--frequency-penalty"):
        assert flag in result.stdout


def test_cli_reports_a_bad_model_path_clearly(tmp_path):
    result = subprocess.run([sys.executable, "engine.py", "generate", "--model", str(tmp_path / "missing")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "does not exist" in result.stderr


@pytest.mark.interpreter
def test_triton_backend_gives_the_torch_backends_greedy_tokens_fp32(tiny_checkpoint):
    """On CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set in conftest)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for attention in ("torch", "triton"):
        with Engine(tiny_checkpoint, device="cpu", dtype="float32", attention=attention,
                    verbose=False) as engine:
            assert engine.backend.name == attention
            outputs = engine.generate(PROMPTS[:2], params, use_tqdm=False)
        tokens[attention] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("head_dim", [8, 24])
def test_torch_backend_runs_any_even_head_dim(tiny_checkpoint, tmp_path, head_dim):
    """head_dim is free of hidden_size / heads (Qwen3-style configs); the reference backend takes any even
    one, and the Triton backend names the set it was built for (the multiples of 16 up to 256)."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["head_dim"] = head_dim
    (path / "config.json").write_text(json.dumps(config))
    save_file(random_weights(config, seed=1, dtype=torch.float32, std=0.1), str(path / "model.safetensors"))
    reference = ReferenceOuro(path)
    with Engine(path, device="cpu", attention="torch", verbose=False) as engine:
        out = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)
        ids = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    assert [o.outputs[0].token_ids for o in out] == [reference.greedy(i, 6) for i in ids]
    with pytest.raises(ValueError, match=rf"'triton' does not support head_dim {head_dim} \(it supports "
                                         r"16, 32, 48, .*, 240, 256\)"):
        select("triton", torch.device("cpu")).check(torch.float32, head_dim, torch.device("cpu"))
