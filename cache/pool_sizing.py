"""How many blocks the KV pool gets, and the pool allocated at that size. num_kv_blocks or kv_cache_gib when
given; otherwise vLLM's rule on CUDA (what is left of gpu_memory_utilization x total after the weights and a
measured activation peak) and, on CPU, room for max_num_seqs sequences of max_model_len within a share of the
memory available. The pool's bytes are measured on the meta device and checked against the memory the device
has before anything is allocated; every error names the options that sized the pool and those to lower.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from cache.kv_format import KVFormat, Pool, PoolShape
from cache.kv_pool import KVPool
from cache.side_rows import SideRows

# The CPU KV pool (PoolSizer.cpu_budget): room for max_num_seqs sequences of max_model_len, but at most this
# share of the memory available once the weights are loaded (the rest is for activations and the machine's
# other work), and no more than the larger of one max_model_len sequence and CPU_KV_BYTES.
CPU_KV_BYTES = 4 * 2**30
CPU_KV_MEMORY_FRACTION = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSizer:
    """A KV pool of `fmt` and `shape` on `device`, sized by the options that size it."""

    fmt: KVFormat
    shape: PoolShape
    device: torch.device
    num_kv_blocks: int | None  # None: sized from memory
    kv_cache_gib: float | None
    gpu_memory_utilization: float
    max_model_len: int

    def build(self, side_rows: SideRows | None, profile: Callable[[], None]) -> tuple[Pool, int]:
        """The pool and the blocks the scheduler may hand out: one block more is allocated, the scratch block
        that graph padding rows write. `profile` (CUDA, no size given): run the largest step once, for its
        activation peak."""
        probe = self.fmt.make_pool(self.shape, 1, None, torch.device("meta"))  # bytes; nothing allocated
        reserved = self.fmt.side_bytes(probe, side_rows)
        # The pool asked for, or the smallest one (a block and the scratch block), before sizing it to memory
        self.check_fits(probe, (self.num_kv_blocks or 1) + 1, reserved,
                        "num_kv_blocks" if self.num_kv_blocks is not None else "loops or block_size")
        num_blocks = self.num_kv_blocks or self.blocks_for_memory(probe, reserved, profile)
        return self.allocate(probe, num_blocks + 1, reserved, side_rows), num_blocks

    def allocate(self, probe: Pool, num_blocks: int, reserved: int, side_rows: SideRows | None) -> Pool:
        """The KV pool of num_blocks blocks and `reserved` bytes of side rows, once check_fits; an allocation
        that fails all the same is a ValueError naming what sized the pool."""
        lower = "num_kv_blocks" if self.num_kv_blocks is not None else \
            "kv_cache_gib" if self.kv_cache_gib is not None else "loops or block_size"
        self.check_fits(probe, num_blocks, reserved, lower)
        try:
            return self.fmt.make_pool(self.shape, num_blocks, side_rows, self.device)
        except RuntimeError as err:  # the allocator's (torch's CUDA OutOfMemoryError is one)
            sized_by = self.sized_by(probe, num_blocks, reserved)
            raise ValueError(f"allocating the KV pool ({sized_by}) on {self.device} failed: {err}; lower "
                             f"{lower}") from None

    def check_fits(self, probe: Pool, num_blocks: int, reserved: int, lower: str) -> None:
        """A pool of num_blocks blocks and `reserved` bytes of side rows against the memory the device has
        now, before anything is allocated: ValueError naming the options that sized it and those to lower."""
        needed = num_blocks * probe.bytes_per_block + reserved
        available = device_memory_available(self.device)
        if available is None or needed <= available:
            return
        if reserved > num_blocks * probe.bytes_per_block:
            lower = "max_num_seqs, or kv_sink_tokens and kv_tail_tokens"
        raise ValueError(f"the KV pool would take {needed / 2**30:.3g} GiB "
                         f"({self.sized_by(probe, num_blocks, reserved)}), more than the "
                         f"{available / 2**30:.3g} GiB of memory available on {self.device}; lower {lower}")

    def sized_by(self, probe: Pool, num_blocks: int, reserved: int = 0) -> str:
        """The pool's size in the words of the options that set it."""
        asked = f"num_kv_blocks={self.num_kv_blocks}: " if self.num_kv_blocks is not None else \
            f"kv_cache_gib={self.kv_cache_gib}: " if self.kv_cache_gib is not None else ""
        side = (f", and {reserved / 2**30:.3g} GiB of KVarN side rows for "
                f"max_num_seqs={self.shape.max_num_seqs}" if reserved else "")
        slot_map = self.shape.slot_map
        ring = "" if slot_map.ring_loops is None else f" (a ring of {slot_map.ring_loops}, kv_layout)"
        return (f"{asked}{num_blocks} block(s) of {probe.bytes_per_block / 2**20:.3g} MiB, each "
                f"block_size={probe.block_size} tokens x {slot_map.num_slots} KV slots "
                f"(loops={slot_map.loops}{ring} x {slot_map.loop_layers} layers){side}")

    def blocks_for_memory(self, probe: Pool, reserved: int, profile: Callable[[], None]) -> int:
        """kv_cache_gib when given. Otherwise vLLM's rule on CUDA: what is left of utilization x total after
        the weights and the activation peak `profile` measures; on CPU, cpu_budget. `probe`: a one-block pool,
        for the bytes per block; `reserved`: bytes of the budget that are not blocks (a KVarN side pool)."""
        device = self.device
        if self.kv_cache_gib is not None:
            budget = self.kv_cache_gib * 2**30
        elif device.type != "cuda":  # sized for the blocks the sequences need; a side pool on top
            budget = self.cpu_budget(probe.bytes_per_block) + reserved
        else:
            torch.cuda.reset_peak_memory_stats(device)
            profile()
            peak = torch.cuda.max_memory_allocated(device)
            free, total = torch.cuda.mem_get_info(device)
            others = total - free - torch.cuda.memory_reserved(device)
            budget = total * self.gpu_memory_utilization - peak - others
        blocks = KVPool.blocks_for_budget(probe.bytes_per_block, budget - reserved) - 1  # - the scratch block
        if blocks < 1:
            side = (f"; the KVarN side pool takes {reserved / 2**30:.2f} GiB of it (lower max_num_seqs or "
                    "kv_sink_tokens / kv_tail_tokens)") if reserved else ""
            raise ValueError(f"no memory left for the KV cache: its budget of {max(budget, 0) / 2**30:.3g} "
                             "GiB holds no block besides the scratch block "
                             f"({self.sized_by(probe, 1)}); "
                             "raise kv_cache_gib, or on CUDA gpu_memory_utilization, or lower "
                             f"max_num_batched_tokens, loops or block_size{side}")
        return blocks

    def cpu_budget(self, bytes_per_block: int) -> float:
        """Bytes for the CPU KV pool: room for max_num_seqs sequences of max_model_len (more is never used),
        at most the larger of one such sequence and CPU_KV_BYTES, and at most CPU_KV_MEMORY_FRACTION of the
        memory available now (the weights are loaded; CPU_KV_BYTES where the OS does not say). The pool is
        allocated uninitialised, so its pages become resident only as tokens are written."""
        one_sequence = -(-self.max_model_len // self.shape.block_size) * bytes_per_block
        available = available_memory_bytes()
        cap = CPU_KV_MEMORY_FRACTION * available if available is not None else CPU_KV_BYTES
        return min(self.shape.max_num_seqs * one_sequence, max(one_sequence, CPU_KV_BYTES), cap) \
            + bytes_per_block  # the scratch block


def available_memory_bytes() -> int | None:
    """Host memory available to this process now: Linux's MemAvailable, within a cgroup v2 memory limit
    when one is set; where /proc is missing, the free pages the OS reports; None where it reports none."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    available = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                      if line.startswith("MemAvailable:")), None)
    if available is None:  # kernels before 3.14
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, max(0, int(limit) - used))


def device_memory_available(device: torch.device) -> int | None:
    """Bytes a new allocation may take on the device now: CUDA's free memory and the blocks this process's
    caching allocator holds unused (tensors freed before the engine was built: CUDA counts them as used, the
    allocator hands them out first, and the sizing rule counts them as this process's), or the host's
    available memory (available_memory_bytes); None where the OS does not say."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return available_memory_bytes()
