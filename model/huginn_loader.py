"""Load a Huginn checkpoint in the HF layout (docs/huginn.md §6) into HuginnForCausalLM.

Every expected tensor is checked for presence, shape and dtype before any is used; the error names the
tensor. Files are found and read with model/loader.py's helpers. A stored `freqs_cis` (the official RoPE
buffer) is ignored: the tables are recomputed in fp32. Each head's q and k rows of Wqkv, and the qk bias, are
permuted into half-split order at load (model/huginn.py: half_split_order).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from model.huginn import HuginnConfig, HuginnForCausalLM, half_split_order
from model.loader import checkpoint_files, read_tensors

_FLOAT_DTYPES = ("F32", "F16", "BF16")
_BLOCK_GROUPS = ("prelude", "core_block", "coda")


def block_names(config: HuginnConfig) -> list[tuple[str, str]]:
    """(HF prefix, module prefix) of every block, in checkpoint order: prelude, core, coda."""
    counts = (config.n_layers_in_prelude, config.n_layers_in_recurrent_block, config.n_layers_in_coda)
    modules = ("prelude_blocks", "core_blocks", "coda_blocks")
    return [(f"transformer.{group}.{i}.", f"{module}.{i}.")
            for group, module, count in zip(_BLOCK_GROUPS, modules, counts) for i in range(count)]


def expected_tensors(config: HuginnConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Huginn checkpoint. lm_head.weight only when the head is untied."""
    hidden, inter, vocab = config.n_embd, config.intermediate_size, config.padded_vocab_size
    shapes: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (vocab, hidden),
                                          "transformer.adapter.weight": (hidden, 2 * hidden),
                                          "transformer.ln_f.weight": (hidden,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for prefix, _ in block_names(config):
        for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
            shapes[f"{prefix}{norm}.weight"] = (hidden,)
        shapes[prefix + "attn.Wqkv.weight"] = (3 * hidden, hidden)
        if config.qk_bias:
            shapes[prefix + "attn.qk_bias"] = (2, 1, config.n_heads, config.head_dim)
        shapes[prefix + "attn.proj.weight"] = (hidden, hidden)
        shapes[prefix + "mlp.fc.weight"] = (2 * inter, hidden)
        shapes[prefix + "mlp.proj.weight"] = (hidden, inter)
    return shapes


def _ignored(config: HuginnConfig) -> set[str]:
    """Tensors a checkpoint may hold that the model does not read: the RoPE buffer and, with a tied head,
    the head's stored copy of wte (the model card says the upload holds both)."""
    return {"freqs_cis"} | ({"lm_head.weight"} if config.tie_embeddings else set())


def check_tensors(config: HuginnConfig, files: dict[str, Path]) -> None:
    """Presence, shape and dtype of every expected tensor (and of a stored tied lm_head), before any is
    read."""
    expected = expected_tensors(config)
    missing = [name for name in expected if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    unexpected = sorted(set(files) - set(expected) - _ignored(config))
    if unexpected:
        warnings.warn(f"checkpoint has {len(unexpected)} unexpected tensor(s), ignored: "
                      f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}", stacklevel=3)
    checked = dict(expected)
    if config.tie_embeddings and "lm_head.weight" in files:
        checked["lm_head.weight"] = expected["transformer.wte.weight"]
    for file in sorted(set(files[name] for name in checked)):
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint shard {file} (named in the index) does not exist")
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name not in checked or files[name] != file:
                    continue
                piece = f.get_slice(name)
                shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                if shape != checked[name]:
                    raise ValueError(f"tensor {name!r} has shape {shape}, expected {checked[name]}")
                if dtype not in _FLOAT_DTYPES:
                    raise ValueError(f"tensor {name!r} has dtype {dtype}, expected one of F32, F16, BF16")


def module_state(config: HuginnConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> HuginnForCausalLM's state dict, q and k rows (and bias) in half_split_order."""
    hidden, heads, head_dim = config.n_embd, config.n_heads, config.head_dim
    order = half_split_order(head_dim)
    state = {"wte.weight": tensors["transformer.wte.weight"],
             "adapter.weight": tensors["transformer.adapter.weight"],
             "ln_f.weight": tensors["transformer.ln_f.weight"]}
    if not config.tie_embeddings:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    for hf, module in block_names(config):
        q, k, v = tensors[hf + "attn.Wqkv.weight"].split(hidden)
        q, k = (w.view(heads, head_dim, hidden)[:, order].reshape(hidden, hidden) for w in (q, k))
        state[module + "attn.Wqkv.weight"] = torch.cat([q, k, v])
        if config.qk_bias:
            state[module + "attn.qk_bias"] = tensors[hf + "attn.qk_bias"].view(2, heads, head_dim)[..., order]
        for name in ("norm_1", "norm_2", "norm_3", "norm_4"):
            state[f"{module}{name}.weight"] = tensors[f"{hf}{name}.weight"]
        for name in ("attn.proj", "mlp.fc", "mlp.proj"):
            state[f"{module}{name}.weight"] = tensors[f"{hf}{name}.weight"]
    return state


def load_huginn(model_dir: str | Path, config: HuginnConfig, device: torch.device | str, dtype: torch.dtype,
                check_finite: bool = True, fused_kernels: bool = False) -> HuginnForCausalLM:
    """The checkpoint's weights in `dtype` on `device`; the RoPE tables stay fp32. check_finite refuses NaN
    and infinite weights, naming the tensor (model/loader.py: read_tensors). fused_kernels: the model's
    (HuginnForCausalLM)."""
    files = checkpoint_files(Path(model_dir))
    check_tensors(config, files)
    tensors = read_tensors(files, list(expected_tensors(config)), torch.device(device), dtype, check_finite)
    with torch.device("meta"):
        model = HuginnForCausalLM(config, fused_kernels=fused_kernels)
    model.load_state_dict(module_state(config, tensors), strict=True, assign=True)
    model.rotary.to(device)  # its table is real (built on the CPU) in a meta-device model
    return model.eval().requires_grad_(False)
