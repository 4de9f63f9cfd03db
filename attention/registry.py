"""The attention backends by name, and `select`, which builds a new instance for each engine. A backend is a
file of its own (an attention/base.py: AttentionBackend subclass) and its line in BACKENDS; each is imported
at first use, so one whose package is missing (triton on macOS, Windows, CPU-only installs) is left out and
costs the others nothing. The registry imports the backends; none of them imports it.

`select` returns a fresh instance whose Capabilities are a copy: a requirement switches a capability on for
that instance only, never for the class or registry.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import torch

from attention.base import AttentionBackend, triton_missing

# name: "module:class"
BACKENDS = {
    "torch": "attention.torch_backend:TorchBackend",
    "triton": "attention.triton_backend:TritonBackend",
}
_REGISTRY: dict[str, type[AttentionBackend]] = {}  # the backends imported so far, by name


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
    """Import each backend of BACKENDS not imported yet; one whose triton package is missing is left out."""
    for name, path in BACKENDS.items():
        if name in _REGISTRY:
            continue
        module, _, cls = path.partition(":")
        try:
            _REGISTRY[name] = getattr(importlib.import_module(module), cls)
        except ModuleNotFoundError as err:
            if not triton_missing(err):
                raise
