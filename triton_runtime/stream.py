"""The raw handle of a device's current CUDA stream, read as Triton's launcher reads it: what every direct
launch (triton_runtime/launch.py) is given and what the eager workspace (triton_runtime/workspace.py) is
keyed by."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _stream_reader() -> Callable[[int], int]:
    """Triton's launcher reads the raw stream through its driver; torch's public API is the fallback."""
    try:
        import triton

        return triton.runtime.driver.active.get_current_stream
    except (ImportError, AttributeError, RuntimeError):  # no usable Triton driver: torch's public API
        return lambda index: torch.cuda.current_stream(index).cuda_stream


_read_stream: Callable[[int], int] | None = None


def current_stream(device: torch.device) -> int:
    """The raw handle of `device`'s current stream, as Triton launches on it; 0 off CUDA."""
    global _read_stream
    if device.type != "cuda":
        return 0
    if _read_stream is None:
        _read_stream = _stream_reader()
    return _read_stream(device.index)
