"""Write complete HF-layout checkpoints (Ouro, Huginn) with random weights, for tests, demos and benchmarks.

    python -m model.tiny --out DIR --preset tiny|ouro-1.4b|ouro-2.6b|huginn-tiny|huginn-0125 [--seed N]

The embedded model/checkpoints/tiny-huginn is `--preset huginn-tiny --heads 2` (head_dim 32; the Triton
kernels take any multiple of 16 up to 256).

The output (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) loads exactly as a downloaded checkpoint does. The ouro-* presets have the
real shapes of docs/ouro.md §1 and huginn-0125 those of docs/huginn.md §1; their weights are random, so
only their speed means anything.
"""

from __future__ import annotations

import argparse
import json
import math
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


def train_tokenizer(vocab_size: int, text: str = TOKENIZER_TEXT,
                    special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """A byte-level BPE trained on `text`; every byte string encodes, so any prompt works. The special
    tokens take the first ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
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
                     loops: int | None = None, std: float | None = None, layers: int | None = None,
                     heads: int | None = None) -> Path:
    """loops: Ouro's total_ut_steps (default 4) or Huginn's mean_recurrence (default the preset's). layers
    (Ouro): fewer layers than the preset's (a short model of its shapes). heads (Huginn): another head count
    than the preset's, at its width."""
    if preset in HUGINN_PRESETS:
        if layers is not None:
            raise ValueError(f"layers applies to the Ouro presets, not {preset!r}")
        return write_huginn_checkpoint(out, preset, seed, dtype, loops, std, heads)
    if heads is not None:
        raise ValueError(f"heads applies to the Huginn presets, not {preset!r}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join([*PRESETS, *HUGINN_PRESETS])}")
    loops = 4 if loops is None else loops
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


# Huginn: the special tokens in the official order (ids 65504..65509 in Huginn-0125, the first ids here),
# its chat format (the assistant speaks as "Huginn"), and the HF config.json of the official RavenConfig.
HUGINN_SPECIAL_TOKENS = ["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>",
                         "<|end_turn|>", "<|pad|>"]
HUGINN_CHAT_TEMPLATE = (
    "{{ '<|begin_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|begin_header|>' + ('Huginn' if message['role'] == 'assistant' else message['role'])"
    " + '<|end_header|>\\n\\n' + message['content'] + '<|end_turn|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% endif %}"
)
HUGINN_PRESETS: dict[str, dict] = {
    "huginn-tiny": dict(n_embd=64, n_heads=4, n_layers_in_prelude=1, n_layers_in_recurrent_block=2,
                        n_layers_in_coda=1, mean_recurrence=8, intermediate_size=128, vocab_size=512,
                        block_size=1024),
    "huginn-0125": dict(n_embd=5280, n_heads=55, n_layers_in_prelude=2, n_layers_in_recurrent_block=4,
                        n_layers_in_coda=2, mean_recurrence=32, intermediate_size=17920, vocab_size=65536,
                        block_size=4096),
}


def huginn_hf_config(shape: dict, dtype: str = "bfloat16") -> dict:
    """The fields the official RavenConfig writes (init_values derived from n_embd as it derives them).
    No tie_word_embeddings: the official loader refuses a config that has it beside tie_embeddings."""
    hidden = shape["n_embd"]
    layers = shape["n_layers_in_prelude"] + shape["n_layers_in_recurrent_block"] + shape["n_layers_in_coda"]
    depth = layers - shape["n_layers_in_recurrent_block"] + shape["n_layers_in_recurrent_block"] * \
        shape["mean_recurrence"]
    std = math.sqrt(2 / (5 * hidden))
    return {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "n_layers": layers,
            "padded_vocab_size": shape["vocab_size"], "padding_multiple": 4096, "tie_embeddings": True,
            "bias": False, "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
            "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "mlp_class_name": "GatedMLP",
            "nonlin_name": "SiLU", "init_strategy": "takase", "init_orthogonal": False,
            "state_init": "like-init", "injection_type": "linear",
            "sampling_scheme": "poisson-lognormal-filling", "mean_backprop_depth": 8, "qk_bias": True,
            "activation_checkpoint_impl": "per-iteration",
            "rope_base": 50000, "effective_expected_depth": depth,
            "init_values": {"std": std, "out_proj": std / math.sqrt(2 * depth), "embedding": std,
                            "embed_scale": math.sqrt(hidden)},
            "bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 5, "torch_dtype": dtype, **shape}


def huginn_random_weights(config: dict, seed: int, dtype: torch.dtype, std: float) -> dict[str, torch.Tensor]:
    """HF-named tensors: normal(0, std) projections, embedding and q/k bias, norm weights uniform in
    [0.5, 1.5] (so that a norm applied in the wrong place, or ln_f taken for another norm, changes the
    output), and the official fp32 RoPE buffer freqs_cis [1, block_size, 1, head_dim/2, 2] (cos, sin), which
    loaders ignore."""
    from model.huginn import HuginnConfig
    from model.huginn_loader import expected_tensors

    parsed = HuginnConfig.from_dict(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(parsed).items():
        if ".norm_" in name or name == "transformer.ln_f.weight":
            tensors[name] = (torch.rand(shape, generator=generator) + 0.5).to(dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * std).to(dtype)
    head_dim = parsed.head_dim
    inv_freq = 1.0 / (parsed.rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(parsed.block_size, dtype=torch.float32), inv_freq)
    tensors["freqs_cis"] = torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]
    return tensors


def write_huginn_checkpoint(out: str | Path, preset: str = "huginn-tiny", seed: int = 0,
                            dtype: str | None = None, mean_recurrence: int | None = None,
                            std: float | None = None, heads: int | None = None) -> Path:
    """A Huginn preset in the HF layout: huginn-tiny (fp32, a few hundred thousand parameters, its tokenizer's
    vocabulary) or huginn-0125 (the real shape, bf16, about 3.6B parameters: a 7 GB file)."""
    if preset not in HUGINN_PRESETS:
        raise ValueError(f"unknown Huginn preset {preset!r}; choose one of {', '.join(HUGINN_PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = preset == "huginn-tiny"
    shape = dict(HUGINN_PRESETS[preset])
    if mean_recurrence is not None:
        shape["mean_recurrence"] = mean_recurrence
    if heads is not None:
        shape["n_heads"] = heads
    dtype = dtype or ("float32" if tiny else "bfloat16")
    tokenizer = train_tokenizer(shape["vocab_size"] if tiny else 4096, special_tokens=HUGINN_SPECIAL_TOKENS)
    if tiny:
        shape["vocab_size"] = tokenizer.get_vocab_size()
    config = huginn_hf_config(shape, dtype)
    std = std if std is not None else (0.1 if tiny else config["init_values"]["std"])
    tensors = huginn_random_weights(config, seed, getattr(torch, dtype), std)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 5}, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_text|>", "eos_token": "<|end_text|>", "pad_token": "<|pad|>",
         "chat_template": HUGINN_CHAT_TEMPLATE, "model_max_length": shape["block_size"]}, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--preset", default="tiny", choices=sorted([*PRESETS, *HUGINN_PRESETS]),
                        help="model shape")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="stored dtype (default: float32 for the tiny presets, bfloat16 for the real "
                             "shapes)")
    parser.add_argument("--loops", type=int, default=None,
                        help="total_ut_steps (Ouro, default 4) or mean_recurrence (Huginn, default the "
                             "preset's) written into config.json")
    parser.add_argument("--heads", type=int, default=None,
                        help="Huginn: n_heads (default the preset's), at the preset's width")
    args = parser.parse_args()
    path = write_checkpoint(args.out, args.preset, args.seed, args.dtype, args.loops, heads=args.heads)
    print(f"wrote {args.preset} checkpoint to {path}")


if __name__ == "__main__":
    main()
