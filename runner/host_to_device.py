"""A step's integer arrays reach the device in one copy per dtype. Each host-to-device copy from pageable
memory costs the host a driver call and a staging copy (several µs) and the stream one more operation, so a
decode step's five to seven small arrays cost more as separate copies than the bytes they hold. `upload` packs
them into one buffer, copies it once, and hands back device views in each array's own shape.

The buffer is pinned on CUDA, so the copy is queued behind the running step instead of waiting for it
(async scheduling prepares a step while the previous one runs).

Each view starts 16 bytes into the buffer or a multiple of that, as a tensor of its own would: Triton
specializes kernels on 16-byte pointer alignment, so an unaligned view would compile a second variant.
"""

from __future__ import annotations

import torch

ALIGN_BYTES = 16


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device's queued work: from pinned memory
    on CUDA the copy is queued, where one from pageable memory can wait for the GPU."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def upload(parts: list[list[int] | torch.Tensor], dtype: torch.dtype, device: torch.device
           ) -> list[torch.Tensor]:
    """parts: lists (1-D) or CPU tensors of any shape, of `dtype`'s values. One device buffer holds them all;
    the result is a view of it per part, in the part's shape (a list's is [len]), in order. The lists come
    first in the buffer, as one Python list; the tensors follow, each copied in whole."""
    align = ALIGN_BYTES // dtype.itemsize
    flat: list[int] = []
    sizes: list[int] = []  # the buffer's segments: each part's, and the padding between them
    tensors = [part for part in parts if isinstance(part, torch.Tensor)]
    for part in parts:
        if not isinstance(part, torch.Tensor):
            flat += part
            pad = -len(part) % align
            flat += [0] * pad
            sizes += [len(part), pad]
    host = torch.tensor(flat, dtype=dtype)
    if tensors:
        pieces = [host]
        for tensor in tensors:
            pad = -tensor.numel() % align
            pieces += [tensor.reshape(-1), host.new_zeros(pad)]
            sizes += [tensor.numel(), pad]
        host = torch.cat(pieces)
    segments = to_device(host, device).split_with_sizes(sizes)[::2]
    num_lists = len(parts) - len(tensors)
    lists, tensor_views = iter(segments[:num_lists]), iter(segments[num_lists:])
    return [next(tensor_views).view(part.shape) if isinstance(part, torch.Tensor) else next(lists)
            for part in parts]
