"""The attention backends by name, and `select`: a fresh instance of one, whose Capabilities are a copy, so a
requirement switches a capability on for that instance only, never for the class or the registry.

The built-in backends are listed here by module and class and imported on first use: a backend imports only
the interface (attention/base.py), never this registry. Adding one is its own file plus a line in BUILTIN.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import torch

from attention.base import AttentionBackend
from triton_runtime.installed import triton_missing

# name -> (module, class). A backend whose module needs triton is left out where triton is not installed.
BUILTIN = {"torch": ("attention.torch_backend", "TorchBackend"),
           "triton": ("attention.triton_backend", "TritonBackend")}
_REGISTRY: dict[str, type[AttentionBackend]] = {}


def available() -> list[str]:
    _load_builtin_backends()
    return sorted(_REGISTRY)


def check_name(name: str) -> None:
    """ValueError for a backend name select() refuses: one not registered, or triton without its package."""
    _load_builtin_backends()
    if name == "auto" or name in _REGISTRY:
        return
    if name == "triton":
        raise ValueError("attention='triton' needs the triton package, which is not installed here "
                         "(pip install triton, Linux only; or pip install -e '.[gpu]'); "
                         "attention='torch' runs without it")
    raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(sorted(_REGISTRY))}")


def select(name: str, device: torch.device, requirements: dict[str, bool] | None = None) -> AttentionBackend:
    """A new backend instance. "auto" is triton on CUDA and torch elsewhere.

    `requirements` names capabilities to switch on, on the returned instance only.
    """
    if name == "auto" and device.type == "cuda" and resolve_name(name, device) == "torch":
        warnings.warn("triton is not installed: attention='auto' on CUDA falls back to the torch backend "
                      "(slower; pip install triton for the Triton kernels)", stacklevel=3)
    name = resolve_name(name, device)
    check_name(name)
    cls = _REGISTRY[name]
    caps = dataclasses.replace(cls.default_capabilities)
    for key, wanted in (requirements or {}).items():
        if not wanted:
            continue
        if key not in cls.optional_capabilities:
            raise ValueError(f"attention backend {name!r} cannot provide {key!r}")
        setattr(caps, key, True)
    return cls(caps)


def resolve_name(name: str, device: torch.device) -> str:
    """The backend a name selects on a device: "auto" is triton on CUDA (where installed), else torch."""
    _load_builtin_backends()
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and "triton" in _REGISTRY else "torch"


def _load_builtin_backends() -> None:
    for name, (module, cls) in BUILTIN.items():
        if name in _REGISTRY:
            continue
        try:
            _REGISTRY[name] = getattr(importlib.import_module(module), cls)
        except ModuleNotFoundError as err:
            if not triton_missing(err):
                raise
