"""The looped-model families this engine knows, by config.json's model_type: each one's config class, its
loader, and the Engine options it cannot serve (refused by name, with the reason). A family the runner
cannot drive yet would be known by name, so that its checkpoint is refused with a reason rather than as an
unknown model type.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

from exit_policy import ExitPolicy
from model import huginn_fused, ouro_fused
from model.checkpoint_paths import checkpoint_file
from model.config import OuroConfig, read_config_json
from model.huginn import HuginnConfig
from model.huginn_loader import load_huginn
from model.loader import load_model as load_ouro
from model.looped import LoopedConfig, LoopedModel


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str
    config_class: type
    # (model_dir, config, device, dtype, batch_invariant, check_finite) -> the model
    load: Callable[[Path, LoopedConfig, torch.device, torch.dtype, bool, bool], LoopedModel]
    # options (EngineConfig's fields) -> the reason the first one it cannot serve is refused, or None
    refusal: Callable[[dict[str, Any]], str | None] | None = None


def _load_ouro(model_dir: Path, config: OuroConfig, device: torch.device, dtype: torch.dtype,
               batch_invariant: bool, check_finite: bool) -> LoopedModel:
    """Fused Triton kernels around the GEMMs on CUDA (model/ouro_fused.py); the plain torch ops elsewhere."""
    return load_ouro(model_dir, config, device, dtype,
                     fused_kernels=device.type == "cuda" and ouro_fused.available(),
                     batch_invariant=batch_invariant, check_finite=check_finite)


def _load_huginn(model_dir: Path, config: HuginnConfig, device: torch.device, dtype: torch.dtype,
                 batch_invariant: bool, check_finite: bool) -> LoopedModel:
    """Fused Triton kernels around the GEMMs on CUDA (model/huginn_fused.py); the plain torch ops elsewhere
    (deterministic mode is refused beforehand)."""
    return load_huginn(model_dir, config, device, dtype, check_finite=check_finite,
                       fused_kernels=device.type == "cuda" and huginn_fused.available())


# Exit policies that read an exit gate's per-loop probabilities (exit_policy.py), and step:K, which reads
# out a loop before the last (for a model with a coda, that loop's state through the coda).
GATE_POLICIES = ("threshold", "early", "weighted", "hf")


def policy_refusal(policy: ExitPolicy, name: str = "exit_policy") -> str | None:
    """Why a model without an exit gate, whose readout runs a coda after the last loop, cannot read out
    under `policy` (None: it can)."""
    if policy.kind in GATE_POLICIES:
        return (f"{name}={str(policy)!r} reads an exit gate, which this model does not have (Huginn-0125 "
                f"exits by a criterion on successive loops, not a gate)")
    if policy.kind == "step":
        return (f"{name}={str(policy)!r} reads out an earlier loop, which this model's coda does not run at; "
                f"run loops={int(policy.value) + 1} instead")
    return None


def _huginn_refusal(options: dict[str, Any]) -> str | None:
    refusal = policy_refusal(options["exit_policy"])
    if refusal is not None:
        return refusal
    refused = [
        (options["kv_sharing"] != "none",
         f"kv_sharing={options['kv_sharing']!r} shares the loop slots of generated tokens, and this model "
         f"has prelude and coda slots besides"),
        (options["deterministic"] is True,
         "deterministic=True needs the batch-invariant kernels, which only Ouro's layers run"),
        (options["kv_cache_dtype"] != "auto",
         f"kv_cache_dtype={options['kv_cache_dtype']!r} is not validated for Huginn-0125 yet; use 'auto'"),
    ]
    return next((reason for bad, reason in refused if bad), None)


FAMILIES = {
    "ouro": Family("Ouro", OuroConfig, _load_ouro),
    "huginn_raven": Family("Huginn-0125", HuginnConfig, _load_huginn, refusal=_huginn_refusal),
}


def check_engine_options(config: LoopedConfig, options: dict[str, Any]) -> None:
    """ValueError naming the first Engine option (EngineConfig's fields) the config's family cannot serve."""
    for family in FAMILIES.values():
        if isinstance(config, family.config_class) and family.refusal is not None:
            refusal = family.refusal(options)
            if refusal is not None:
                raise ValueError(f"{family.name}: {refusal}")


def read_config(model_dir: Path) -> LoopedConfig:
    """The checkpoint's config, read by its family's config class. ValueError naming model_type for a family
    this engine does not know."""
    path = checkpoint_file(Path(model_dir), "config.json", "the checkpoint's config")
    raw = read_config_json(path)
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        known = ", ".join(repr(name) for name in FAMILIES)
        raise ValueError(f"config field 'model_type' must name a looped-model family this engine knows "
                         f"({known}), got {model_type!r}")
    try:
        return family.config_class.from_dict(raw)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def load_model(model_dir: Path, config: LoopedConfig, device: torch.device, dtype: torch.dtype,
               batch_invariant: bool = False, check_finite: bool = True) -> LoopedModel:
    """The checkpoint's model, by the loader of the family whose config `config` is (read_config's);
    check_finite refuses NaN and infinite weights (model/loader.py: read_tensors)."""
    for family in FAMILIES.values():
        if isinstance(config, family.config_class):
            return family.load(model_dir, config, device, dtype, batch_invariant, check_finite)
    raise ValueError(f"no loader for a config of type {type(config).__name__}: pass read_config's")
