"""A pytest plugin for running the gpu tests in several xdist workers on one GPU (benchmarks/run_gpu.sh's
`tests` part: `-n 4 -p tests.gpu_share`): each worker's view of the card's memory (torch.cuda.mem_get_info,
which the KV pool sizing reads) is its share, 1/workers of the card, so one worker's engine cannot size its
pool into the others' memory. Within the share it reads as CUDA's own does: what the worker's allocator
reserves (its cached blocks too) is used, the rest of the share free where the card has it."""

import os

import torch

_device_mem_get_info = torch.cuda.mem_get_info


def worker_share_mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of this worker's share: total/workers, free of what its allocator reserves, never
    more than the card has free."""
    free, total = _device_mem_get_info(device)
    share = total // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    return max(0, min(free, share - torch.cuda.memory_reserved(device))), share


torch.cuda.mem_get_info = worker_share_mem_get_info
