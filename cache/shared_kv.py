"""Decode-time KV sharing, kv_sharing="last" (the paper's §5.4.2 approximation; docs/looped_controls.md):
prompt tokens keep one K/V per (loop, layer); a generated token keeps only its last loop's K/V per layer,
which every loop of later tokens reads.

Memory: one pool, one free list. A block is either a prompt block (block_size tokens in all T x L planes,
as without sharing, prefix-cached) or a generated page: the same bytes regrouped as T groups of L planes
hold T x block_size generated tokens, one K/V per layer each. Token g of a request's generated part lives in
page generated_block_table[g // (T * bs)], planes (g % (T * bs)) // bs * L + layer, offset g % bs. So a
generated token costs 1/T of a prompt token, and the split between the two adapts to the workload.
"""

from __future__ import annotations

import torch

from attention.base import SharedKVMetadata
from cache.blocks import BlockManager
from model.config import OuroConfig
from scheduler.request import Request
from scheduler.scheduler import ScheduledBatch

KV_SHARING = ("none", "last")


def check_kv_sharing(kv_sharing: str) -> str:
    if kv_sharing not in KV_SHARING:
        raise ValueError(f"kv_sharing must be 'none' or 'last', got {kv_sharing!r}")
    return kv_sharing


def kv_bytes_per_token(config: OuroConfig, dtype: torch.dtype, generated: bool, kv_sharing: str) -> int:
    """K + V bytes one token holds: T x L planes, or L for a generated token under kv_sharing="last"."""
    element = torch.empty((), dtype=dtype).element_size()
    planes = config.num_hidden_layers if generated and kv_sharing == "last" else config.num_slots
    return planes * 2 * config.kv_size * element


def blocks_per_sequence(prompt_tokens: int, generated_tokens: int, block_size: int, loops: int,
                        kv_sharing: str) -> int:
    """Blocks one sequence holds at its full length."""
    if kv_sharing == "none":
        return -(-(prompt_tokens + generated_tokens) // block_size)
    return -(-prompt_tokens // block_size) + -(-generated_tokens // (loops * block_size))


def max_concurrent_sequences(num_blocks: int, prompt_tokens: int, generated_tokens: int, block_size: int,
                             loops: int, kv_sharing: str) -> int:
    return num_blocks // blocks_per_sequence(prompt_tokens, generated_tokens, block_size, loops, kv_sharing)


class SharedKVBlockManager(BlockManager):
    """BlockManager whose requests hold two tables: block_table (prompt blocks, prefix-cached) and
    generated_block_table (pages of loops x block_size generated tokens)."""

    def __init__(self, num_blocks: int, block_size: int, loops: int,
                 enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, cache_generated=False)
        self.page_tokens = loops * block_size

    def append_slots(self, request: Request, num_new_tokens: int) -> None:
        prompt, generated = self._missing(request, num_new_tokens)
        assert prompt + generated <= self.num_free_blocks, "append_slots without can_append"
        for table, count in ((request.block_table, prompt), (request.generated_block_table, generated)):
            for _ in range(count):
                block_id = next(iter(self.free_block_ids))
                self._forget_hash(block_id)
                self._take(block_id)
                table.append(block_id)

    def free(self, request: Request) -> None:
        for block_id in reversed(request.generated_block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"page {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:  # pages carry no hash: reuse them before cached prompt blocks
                self.free_block_ids[block_id] = None
                self.free_block_ids.move_to_end(block_id, last=False)
        request.generated_block_table = []
        super().free(request)

    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        return sum(self._missing(request, num_new_tokens))

    def _missing(self, request: Request, num_new_tokens: int) -> tuple[int, int]:
        """(prompt blocks, generated pages) the request lacks to cover num_new_tokens more tokens."""
        end = request.num_computed_tokens + num_new_tokens
        num_prompt = request.num_prompt_tokens
        prompt = self.num_blocks_for(min(end, num_prompt)) - len(request.block_table)
        pages = -(-max(0, end - num_prompt) // self.page_tokens) - len(request.generated_block_table)
        return max(0, prompt), max(0, pages)


class SharedKVLayout:
    """Where the runner finds each token's K/V under kv_sharing="last": slot mapping and SharedKVMetadata."""

    def __init__(self, loops: int, num_layers: int, block_size: int, pool_blocks: int,
                 device: torch.device) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.page_tokens = loops * block_size
        self.plane = pool_blocks * block_size  # flat distance between two planes of the pool
        self.device = device

    def shared_index(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Layer-0 flat indices of generated positions start..end-1 (all >= the prompt length)."""
        g = torch.arange(start - request.num_prompt_tokens, end - request.num_prompt_tokens)
        pages = torch.tensor(request.generated_block_table, dtype=torch.int64)[g // self.page_tokens]
        group = g % self.page_tokens // self.block_size
        return group * self.num_layers * self.plane + pages * self.block_size + g % self.block_size

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Prompt positions: block * block_size + offset in their plane; generated: their shared index."""
        bs, table, num_prompt = self.block_size, request.block_table, request.num_prompt_tokens
        slots = [table[p // bs] * bs + p % bs for p in range(start, min(end, num_prompt))]
        if end > num_prompt:
            slots += self.shared_index(request, max(start, num_prompt), end).tolist()
        return slots

    def metadata(self, batch: ScheduledBatch) -> SharedKVMetadata:
        main_lens, indices = [], []
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            end = request.num_computed_tokens + num_new
            num_prompt = request.num_prompt_tokens
            main_lens.append(min(end, num_prompt))
            index = self.shared_index(request, num_prompt, max(end, num_prompt))
            indices.append(index.to(self.device, non_blocking=True))
        return SharedKVMetadata(main_lens, indices, self.num_layers)


def kv_report(config: OuroConfig, dtype: torch.dtype, num_blocks: int, block_size: int, kv_sharing: str,
              sequence_tokens: int = 4096) -> str:
    """The start-up line: bytes per prompt and generated token, and how many sequences fit."""
    prompt_bytes = kv_bytes_per_token(config, dtype, False, kv_sharing)
    generated_bytes = kv_bytes_per_token(config, dtype, True, kv_sharing)
    half = sequence_tokens // 2
    loops = config.total_ut_steps
    mixed = max_concurrent_sequences(num_blocks, half, sequence_tokens - half, block_size, loops, kv_sharing)
    prompt_only = max_concurrent_sequences(num_blocks, sequence_tokens, 0, block_size, loops, kv_sharing)
    return (f"KV {prompt_bytes / 1024:.1f} KiB/prompt token, {generated_bytes / 1024:.1f} KiB/generated "
            f"token (kv_sharing={kv_sharing}), {num_blocks} blocks of {block_size}; max concurrent "
            f"{sequence_tokens}-token sequences: {mixed} at half prompt, half generated "
            f"({prompt_only} all prompt)")
