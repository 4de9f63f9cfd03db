"""The KV cache formats by `kv_cache_dtype` name; cache/kv_format.py says what a format is. Parsing is
fail-closed: a name that is not here raises a ValueError naming `kv_cache_dtype` and the valid names.

Adding a format is a file with its KVFormat subclass and its line below (docs/walkthrough.md, "Adding a KV
format").
"""

from __future__ import annotations

import torch

from attention.fp8 import FP8_DTYPE
from cache.dense_format import DenseFormat, FP8Format
from cache.kv_format import KVFormat
from cache.kvarn_format import KVARN_PRESETS, KVarNFormat

FORMATS: dict[str, KVFormat] = {fmt.name: fmt for fmt in (
    DenseFormat("auto", 16, 16),
    DenseFormat("bf16", 16, 16, storage=torch.bfloat16),
    FP8Format("fp8_e4m3", 8, 8, storage=FP8_DTYPE),
    *(KVarNFormat(name, *bits_and_group) for name, bits_and_group in KVARN_PRESETS.items()),
)}


def parse_kv_cache_dtype(name: object) -> KVFormat:
    if isinstance(name, str) and name in FORMATS:
        return FORMATS[name]
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(FORMATS)}; got {name!r}")
