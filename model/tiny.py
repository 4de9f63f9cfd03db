"""Write complete HF-layout Ouro checkpoints with random weights, for tests, demos and benchmarks.

    python -m model.tiny --out DIR --preset tiny|ouro-1.4b|ouro-2.6b [--seed N] [--dtype bfloat16]

The output (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) loads exactly as a downloaded checkpoint does. The ouro-* presets have the
real shapes of docs/ouro.md §1; their weights are random, so only their speed means anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in Ouro

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_OURO = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
             head_dim=128, vocab_size=49152, max_position_embeddings=65536, rope_theta=1000000.0)
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=32, vocab_size=512, max_position_embeddings=4096,
                 rope_theta=10000.0),
    "ouro-1.4b": dict(_OURO, num_hidden_layers=24),
    "ouro-2.6b": dict(_OURO, num_hidden_layers=48),
}

TOKENIZER_TEXT = """\
A looped language model applies the same stack of layers several times to every token.
Each pass refines the hidden state; an exit gate reads the state after each pass and says how
likely it is that the model could stop there. The engine keeps the keys and values of every pass
in its own slot, so that later tokens can attend to the matching pass of earlier ones.
Small models are good for tests: they load in a moment, run on any computer, and still exercise
every part of the code that a large model would use. The numbers they print mean nothing, but the
paths they take are the same ones.
Hello, world! The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ?
"""


def train_tokenizer(vocab_size: int, text: str = TOKENIZER_TEXT) -> Tokenizer:
    """A byte-level BPE trained on `text`; every byte string encodes, so any prompt works."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    return tokenizer


def hf_config(shape: dict, loops: int = 4, dtype: str = "bfloat16") -> dict:
    return {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False,
            "rope_scaling": None, "total_ut_steps": loops, "early_exit_threshold": 1.0,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": dtype, **shape}


def random_weights(config: dict, seed: int, dtype: torch.dtype, std: float) -> dict[str, torch.Tensor]:
    """HF-named tensors: normal(0, std) projections and embeddings, unit norms, a zero gate bias."""
    from model.config import OuroConfig
    from model.loader import expected_tensors

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(OuroConfig.from_dict(config)).items():
        if "layernorm" in name or name == "model.norm.weight":
            tensors[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith("bias"):
            tensors[name] = torch.zeros(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * std).to(dtype)
    return tensors


def write_checkpoint(out: str | Path, preset: str = "tiny", seed: int = 0, dtype: str | None = None,
                     loops: int = 4, std: float | None = None, layers: int | None = None) -> Path:
    """layers: fewer layers than the preset's (a short model of its shapes)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if layers is not None and not 0 < layers <= PRESETS[preset]["num_hidden_layers"]:
        raise ValueError(f"layers must be in 1..{PRESETS[preset]['num_hidden_layers']}, got {layers}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(PRESETS[preset], **({"num_hidden_layers": layers} if layers else {}))
    dtype = dtype or ("float32" if preset == "tiny" else "bfloat16")
    tokenizer = train_tokenizer(shape["vocab_size"] if preset == "tiny" else 4096)
    if preset == "tiny":
        shape["vocab_size"] = tokenizer.get_vocab_size()
    config = hf_config(shape, loops, dtype)
    std = std if std is not None else (0.1 if preset == "tiny" else 0.02)
    tensors = random_weights(config, seed, getattr(torch, dtype), std)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [0, 2]},
                                                           indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "chat_template": CHAT_TEMPLATE, "model_max_length": shape["max_position_embeddings"]},
        indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="stored dtype (default: float32 for tiny, bfloat16 for the real shapes)")
    parser.add_argument("--loops", type=int, default=4, help="total_ut_steps written into config.json")
    args = parser.parse_args()
    path = write_checkpoint(args.out, args.preset, args.seed, args.dtype, args.loops)
    print(f"wrote {args.preset} checkpoint to {path}")


if __name__ == "__main__":
    main()
