"""Find a checkpoint (local directory or HF repo id) and load its safetensors into OuroForCausalLM.

Every expected tensor is checked for presence, shape and dtype before any is used, and for non-finite values
(NaN, inf) as it is read; every error names the file and the tensor. No pickle and no remote code: only
config.json, safetensors and tokenizer files are read, each inside the checkpoint directory
(model/checkpoint_paths.py). q/k/v and gate/up are fused at load time.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from model.checkpoint_paths import checkpoint_file
from model.config import OuroConfig
from model.ouro import OuroForCausalLM

HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """A local directory as is; an HF repo id through huggingface_hub (respects HF_HOME, HF_HUB_OFFLINE)."""
    if not isinstance(model, (str, os.PathLike)) or (isinstance(model, str) and not model.strip()):
        raise ValueError(f"model must be a checkpoint directory or a Hugging Face repo id, got {model!r} "
                         "(for the embedded tiny checkpoint leave it out, or pass None)")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if path.exists():
        raise ValueError(f"model {text!r} is a file; pass the checkpoint's directory")
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {text!r} does not exist")
    return _download(text)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1). Download it once while online "
            f"(`hf download {repo_id}`; `huggingface-cli download {repo_id}` before huggingface_hub 0.34), "
            "point HF_HOME at a cache that has it, or pass a local checkpoint directory.") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r}: no such repository on the Hugging Face hub "
                                "(or it is gated and you are not logged in)") from None


def expected_tensors(config: OuroConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of an Ouro checkpoint (docs/ouro.md §6)."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,),
                                          "model.early_exit_gate.weight": (1, hidden),
                                          "model.early_exit_gate.bias": (1,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            shapes[p + norm + ".weight"] = (hidden,)
    return shapes


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (single-file or sharded checkpoint). Every file must lie
    inside the checkpoint (checkpoint_file)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        index = checkpoint_file(model_dir, index.name, str(index))
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
            raise ValueError(f"{index} is not a JSON object with a 'weight_map': {err}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        files: dict[str, Path] = {}
        for name, file in weight_map.items():
            files[name] = checkpoint_file(model_dir, file, f"{index}: the entry for tensor {name!r}")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    single = checkpoint_file(model_dir, "model.safetensors", str(single))
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """safetensors' safe_open on the CPU, its errors (a truncated or corrupt file) as ValueError naming the
    file."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(f"{file} is not a readable safetensors file ({err}): it may be truncated or "
                         "corrupt; download or write it again") from None
    with handle as f:
        yield f


def check_tensors(config: OuroConfig, files: dict[str, Path]) -> None:
    """Presence, shape and dtype of every expected tensor, before any is loaded."""
    expected = expected_tensors(config)
    missing = [name for name in expected if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = sorted({str(f.parent) for f in files.values()}) or ["the checkpoint"]
        raise ValueError(f"checkpoint {where[0]} is missing tensor {missing[0]!r}{more}")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        warnings.warn(f"checkpoint has {len(unexpected)} unexpected tensor(s), ignored: "
                      f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}", stacklevel=3)
    for file in sorted(set(files[name] for name in expected)):
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint shard {file} (named in the index) does not exist")
        with open_safetensors(file) as f:
            for name in f.keys():
                if name not in expected or files[name] != file:
                    continue
                piece = f.get_slice(name)
                shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                if shape != expected[name]:
                    raise ValueError(f"tensor {name!r} in {file} has shape {shape}, "
                                     f"expected {expected[name]}")
                if dtype not in _FLOAT_DTYPES:
                    raise ValueError(f"tensor {name!r} in {file} has dtype {dtype}, "
                                     "expected one of F32, F16, BF16")


def read_tensors(files: dict[str, Path], names: list[str], device: torch.device, dtype: torch.dtype,
                 check_finite: bool = True) -> dict[str, torch.Tensor]:
    """The tensors, converted to `dtype` on `device`. check_finite: a tensor with a NaN or an infinity (in
    the file, or once converted) is refused naming it and its file. The check sums each tensor on the device
    in its dtype (one pass, no copy: a sum is finite when no value is NaN or infinite, unless it overflows,
    which the exact check behind a non-finite sum rules out) and reads the sums back once: on a GPU a small
    part of the copy's time, on a CPU about 7% of the load (measured at Ouro-1.4B's shape)."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    sums = []
    for file, file_names in by_file.items():
        with open_safetensors(file) as f:
            for name in file_names:
                try:
                    raw = f.get_tensor(name)
                except SafetensorError as err:
                    raise ValueError(f"tensor {name!r} in {file} cannot be read ({err}): the file may be "
                                     "truncated or corrupt") from None
                out[name] = raw.to(device=device, dtype=dtype)
                if check_finite:
                    sums.append(out[name].sum())
    if sums and not torch.stack(sums).isfinite().all():
        for name, total in zip([n for file_names in by_file.values() for n in file_names], sums):
            if not total.isfinite():
                _refuse_non_finite(name, files[name], out[name])
    return out


def _refuse_non_finite(name: str, file: Path, tensor: torch.Tensor) -> None:
    """Raise ValueError if the tensor holds a NaN or an infinity (its sum alone may have overflowed),
    saying whether the file holds them or the conversion to the engine's dtype made them."""
    bad = int((~torch.isfinite(tensor)).sum())
    if not bad:
        return
    with open_safetensors(file) as f:
        raw = f.get_tensor(name)
    in_file = int((~torch.isfinite(raw)).sum())
    if in_file:
        raise ValueError(f"tensor {name!r} in {file} holds {in_file} non-finite value(s) (NaN or inf) of "
                         f"{raw.numel()}: the checkpoint is corrupt or diverged in training")
    raise ValueError(f"tensor {name!r} in {file} holds {bad} value(s) beyond the range of {tensor.dtype}, "
                     f"which become infinite once converted from {raw.dtype}; load it with dtype='float32' "
                     "or 'bfloat16'")


def load_model(model_dir: Path, config: OuroConfig, device: torch.device, dtype: torch.dtype,
               fused_kernels: bool = False, batch_invariant: bool = False,
               check_finite: bool = True) -> OuroForCausalLM:
    """The model, its tensors checked (check_tensors) and read (read_tensors: check_finite refuses NaN and
    infinite weights)."""
    files = checkpoint_files(model_dir)
    check_tensors(config, files)
    tensors = read_tensors(files, list(expected_tensors(config)), device, dtype, check_finite)
    with torch.device("meta"):
        model = OuroForCausalLM(config, fused_kernels=fused_kernels, batch_invariant=batch_invariant)
    state = {"embed_tokens.weight": tensors["model.embed_tokens.weight"],
             "norm.weight": tensors["model.norm.weight"],
             "early_exit_gate.weight": tensors["model.early_exit_gate.weight"],
             "early_exit_gate.bias": tensors["model.early_exit_gate.bias"],
             "lm_head.weight": tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = [tensors.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        state[f"layers.{i}.qkv_proj.weight"] = torch.cat(attn)
        state[f"layers.{i}.o_proj.weight"] = tensors.pop(p + "self_attn.o_proj.weight")
        gate_up = [tensors.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
        state[f"layers.{i}.gate_up_proj.weight"] = torch.cat(gate_up)
        state[f"layers.{i}.down_proj.weight"] = tensors.pop(p + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            state[f"layers.{i}.{norm}.weight"] = tensors.pop(p + norm + ".weight")
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.to(device)  # its table is real (built on the CPU) in a meta-device model
    return model.eval().requires_grad_(False)
