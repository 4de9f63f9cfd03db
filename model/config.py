"""The Ouro config, read from a checkpoint's config.json and validated once, at construction.

Every value comes from config.json (docs/ouro.md §1). Nothing falls back to another model's defaults:
a missing or malformed field raises ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

from model.looped import ModelShape


@dataclasses.dataclass(frozen=True, slots=True)
class OuroConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    total_ut_steps: int
    early_exit_threshold: float | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    trained_ut_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "total_ut_steps"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config field 'num_attention_heads' ({self.num_attention_heads}) must be a multiple "
                f"of 'num_key_value_heads' ({self.num_key_value_heads})")
        if self.head_dim % 2:  # RoPE rotates the two halves of every head
            raise ValueError(f"config field 'head_dim' must be even (RoPE rotates its two halves), "
                             f"got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' must be 'silu' (Ouro's SwiGLU), "
                             f"got {self.hidden_act!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ValueError(f"config field {name!r} must be a finite positive number, got {value!r}")
        threshold = self.early_exit_threshold
        if threshold is not None and (not _is_number(threshold) or not 0 <= threshold < math.inf):
            raise ValueError(f"config field 'early_exit_threshold' must be a finite number >= 0 or null, "
                             f"got {threshold!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"config field 'tie_word_embeddings' must be true or false, "
                             f"got {self.tie_word_embeddings!r}")
        for i in self.eos_token_ids:
            if not _is_int(i) or not 0 <= i < self.vocab_size:
                raise ValueError(f"config field 'eos_token_id' must be token ids below vocab_size "
                                 f"({self.vocab_size}), got {i!r}")
        bos = self.bos_token_id
        if bos is not None and (not _is_int(bos) or not 0 <= bos < self.vocab_size):
            raise ValueError(f"config field 'bos_token_id' must be a token id below vocab_size "
                             f"({self.vocab_size}) or null, got {bos!r}")
        if self.torch_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"config field 'torch_dtype' must be float32, float16 or bfloat16, "
                             f"got {self.torch_dtype!r}")

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                          self.vocab_size, self.total_ut_steps)

    @property
    def init_scale(self) -> None:
        return None  # loop 0 starts from the embedding: no initial state to draw

    @property
    def num_slots(self) -> int:
        """KV planes: one per (loop, layer), slot = loop * num_hidden_layers + layer."""
        return self.total_ut_steps * self.num_hidden_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def with_overrides(self, loops: int | None = None, exit_threshold: float | None = None) -> OuroConfig:
        """The loop count (total_ut_steps) and exit threshold, overridden; the rest unchanged."""
        changes: dict[str, Any] = {}
        if loops is not None:
            if not isinstance(loops, int) or isinstance(loops, bool) or loops < 1:
                raise ValueError(f"loops must be an integer >= 1, got {loops!r}")
            if loops > self.trained_ut_steps:
                warnings.warn(f"loops={loops} exceeds the {self.trained_ut_steps} loops this checkpoint "
                              "was trained with; quality is unvalidated there (docs/ouro.md §3)",
                              stacklevel=2)
            changes["total_ut_steps"] = loops
        if exit_threshold is not None:
            changes["early_exit_threshold"] = exit_threshold
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OuroConfig:
        return cls(**_fields_from_hf(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> OuroConfig:
        """The config in a config.json; every error names the file."""
        raw = read_config_json(path)
        try:
            return cls.from_dict(raw)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json as a dict; FileNotFoundError or ValueError naming the file otherwise."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "total_ut_steps")


def _fields_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """Map HF config.json keys onto OuroConfig fields, rejecting what the engine cannot run."""
    for name in _REQUIRED:
        if name not in raw:
            raise ValueError(f"config is missing the required field {name!r}")
    model_type = raw.get("model_type")
    if model_type != "ouro":
        raise ValueError(f"config field 'model_type' must be 'ouro', got {model_type!r}")
    if raw.get("rope_scaling") not in (None, {}):
        raise ValueError(f"config field 'rope_scaling' is not supported (Ouro uses default RoPE), "
                         f"got {raw['rope_scaling']!r}")
    if raw.get("use_sliding_window", False) is not False:
        raise ValueError(f"config field 'use_sliding_window' must be false: Ouro uses full attention, "
                         f"got {raw['use_sliding_window']!r}")
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name, False) is not False:
            raise ValueError(f"config field {name!r} must be false: Ouro's projections have no bias, "
                             f"got {raw[name]!r}")
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    head_dim = raw.get("head_dim")
    if head_dim is None:  # Qwen2's definition, which Ouro's config class inherits
        if not _is_int(heads) or not _is_int(hidden) or heads < 1 or hidden % heads:
            raise ValueError("config field 'head_dim' is absent and hidden_size / num_attention_heads "
                             "is not a whole number")
        head_dim = hidden // heads
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(_is_int(i) for i in eos_ids):
        raise ValueError(f"config field 'eos_token_id' must be a token id or a list of them, got {eos!r}")
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=head_dim,
        hidden_act=raw["hidden_act"],
        max_position_embeddings=raw["max_position_embeddings"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw["rope_theta"],
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        total_ut_steps=raw["total_ut_steps"],
        trained_ut_steps=raw["total_ut_steps"] if _is_int(raw["total_ut_steps"]) else 0,
        early_exit_threshold=raw.get("early_exit_threshold", 1.0),  # the HF config class's default
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=raw.get("torch_dtype", raw.get("dtype", "bfloat16")),
    )


def _is_int(value: Any) -> bool:
    """JSON true/false are Python bools, which are ints; a config integer is never one."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
