"""The looped-model families this engine knows, by config.json's model_type: each one's config class and
loader. A family the runner cannot drive yet is known by name, so that its checkpoint is refused with a reason
rather than as an unknown model type.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from model import ouro_fused
from model.checkpoint_paths import checkpoint_file
from model.config import OuroConfig, read_config_json
from model.huginn import HuginnConfig
from model.loader import load_model as load_ouro
from model.looped import LoopedConfig, LoopedModel


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str
    config_class: type
    # (model_dir, config, device, dtype, batch_invariant, check_finite) -> the model; None: not served yet,
    # for `not_served`
    load: Callable[[Path, LoopedConfig, torch.device, torch.dtype, bool, bool], LoopedModel] | None
    not_served: str = ""


def _load_ouro(model_dir: Path, config: OuroConfig, device: torch.device, dtype: torch.dtype,
               batch_invariant: bool, check_finite: bool) -> LoopedModel:
    """Fused Triton kernels around the GEMMs on CUDA (model/ouro_fused.py); the plain torch ops elsewhere."""
    return load_ouro(model_dir, config, device, dtype,
                     fused_kernels=device.type == "cuda" and ouro_fused.available(),
                     batch_invariant=batch_invariant, check_finite=check_finite)


FAMILIES = {
    "ouro": Family("Ouro", OuroConfig, _load_ouro),
    "huginn_raven": Family(
        "Huginn-0125", HuginnConfig, None,
        "its model runs on its own (model/huginn.py), but its runner wiring (the prelude, the injected state "
        "and the coda in the loop driver and the graphs, its KV layouts and exit criteria) is not built yet; "
        "docs/huginn.md §8"),
}


def read_config(model_dir: Path) -> LoopedConfig:
    """The checkpoint's config, read by its family's config class. ValueError naming model_type for a family
    this engine does not know or cannot serve yet."""
    path = checkpoint_file(Path(model_dir), "config.json", "the checkpoint's config")
    raw = read_config_json(path)
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        known = ", ".join(repr(name) for name in FAMILIES)
        raise ValueError(f"config field 'model_type' must name a looped-model family this engine knows "
                         f"({known}), got {model_type!r}")
    if family.load is None:
        raise ValueError(f"{path}: model_type {model_type!r} is {family.name}, which the engine cannot serve "
                         f"yet: {family.not_served}")
    try:
        return family.config_class.from_dict(raw)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def load_model(model_dir: Path, config: LoopedConfig, device: torch.device, dtype: torch.dtype,
               batch_invariant: bool = False, check_finite: bool = True) -> LoopedModel:
    """The checkpoint's model, by the loader of the family whose config `config` is (read_config's);
    check_finite refuses NaN and infinite weights (model/loader.py: read_tensors)."""
    for family in FAMILIES.values():
        if isinstance(config, family.config_class) and family.load is not None:
            return family.load(model_dir, config, device, dtype, batch_invariant, check_finite)
    raise ValueError(f"no loader for a config of type {type(config).__name__}: pass read_config's")
