"""EngineConfig: every Engine option, resolved and validated once, at construction, then frozen. The
components are built from it and read it; none sets attributes on another.

It imports the checkpoint's own config (model/config.py) and the shared request types (request.py) only.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from model.config import OuroConfig
from request import ExitPolicy, parse_exit_policy

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
KV_SHARING = ("none", "last")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: Path
    model: OuroConfig  # the checkpoint's config, with the loop-count override applied
    device: torch.device
    dtype: torch.dtype
    attention: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory at start-up
    kv_cache_gib: float | None = None  # the KV pool's size in GiB instead of the memory rule
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048  # at most the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    packed_prefill: bool = False
    enforce_eager: bool = False
    exit_policy: ExitPolicy = ExitPolicy("full")
    kv_sharing: str = "none"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _check_positive(name, getattr(self, name))
        if self.num_kv_blocks is not None:
            _check_positive("num_kv_blocks", self.num_kv_blocks)
        gib = self.kv_cache_gib
        if gib is not None:
            if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < math.inf:
                raise ValueError(f"kv_cache_gib must be a positive number of GiB, got {gib!r}")
            if self.num_kv_blocks is not None:
                raise ValueError("pass num_kv_blocks or kv_cache_gib, not both")
        if self.max_model_len > self.model.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings {self.model.max_position_embeddings}")
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if self.kv_sharing not in KV_SHARING:
            raise ValueError(f"kv_sharing must be 'none' or 'last', got {self.kv_sharing!r}")
        # step:K is range-checked against this engine's loop count.
        parse_exit_policy(self.exit_policy, self.model.total_ut_steps)

    @property
    def loops(self) -> int:
        return self.model.total_ut_steps

    @property
    def generated_kv_exact(self) -> bool:
        """Does every generated token keep the K/V the model computes for it at every loop? Not under
        early:Q, whose exited tokens leave copies in their deeper slots."""
        return not self.exit_policy.can_exit

    @classmethod
    def resolve(cls, model_dir: Path, device: str | torch.device | None = None,
                dtype: str | torch.dtype = "auto", loops: int | None = None,
                exit_threshold: float | None = None, exit_policy: str | None = None,
                **options) -> EngineConfig:
        """The config of an Engine: the device and dtype resolved ("auto"), the checkpoint's config read
        with the loop override, and the exit policy parsed. `options` are the remaining fields."""
        device = resolve_device(device)
        model = OuroConfig.from_file(model_dir / "config.json").with_overrides(loops, exit_threshold)
        if exit_policy is not None and exit_threshold is not None:
            raise ValueError("pass exit_policy or exit_threshold (= exit_policy='threshold:Q'), not both")
        if exit_policy is None:
            exit_policy = "full" if exit_threshold is None else f"threshold:{exit_threshold}"
        policy = parse_exit_policy(exit_policy, model.total_ut_steps)
        # As before this config existed: no max_model_len, or a larger one, means the checkpoint's limit.
        limit, given = model.max_position_embeddings, options.get("max_model_len")
        if given is None or (isinstance(given, int) and given > limit):
            options["max_model_len"] = limit
        return cls(model_dir, model, device, resolve_dtype(dtype, model, device), exit_policy=policy,
                   **options)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (try 'cpu' or 'cuda')") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device.type!r} is not supported; use 'cpu' or 'cuda'")
    return device


def resolve_dtype(dtype: str | torch.dtype, config: OuroConfig, device: torch.device) -> torch.dtype:
    """"auto": the checkpoint's half dtype on CUDA, float32 on CPU (where bf16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if config.torch_dtype == "float32" else DTYPES[config.torch_dtype]
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, float16 or bfloat16")
    return DTYPES[dtype]


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
