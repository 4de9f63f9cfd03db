"""A pytest plugin for running the gpu tests in several xdist workers on one GPU (benchmarks/run_gpu.sh's
`tests` part: `-n 4 -p tests.gpu_share`): each worker's view of the card's memory (torch.cuda.mem_get_info,
which the KV pool sizing reads) is its share, 1/workers of the card, less what it holds, so one worker's
engine cannot size its pool into the others' memory."""

import os

import torch

_device_mem_get_info = torch.cuda.mem_get_info


def worker_share_mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of this worker's share: total/workers, free of what its tensors hold (its
    allocator's cached blocks count as free, as they are to it), never more than the card has free."""
    free, total = _device_mem_get_info(device)
    share = total // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    return max(0, min(free + cached, share - allocated)), share


torch.cuda.mem_get_info = worker_share_mem_get_info
