"""KV layouts: where each token's K/V lives in the pool, as strategies. A layout owns the blocks a sequence
needs, the slot mapping of new tokens, whether generated tokens' blocks may enter the prefix cache, what an
early exit does to the deeper slots (copy-forward), and the byte accounting. The block manager owns which
request holds which block; the layout only says how many and where.

    paged        one K/V per slot of the model's slot map (model/looped.py: SlotMap) for every token, as the
                 model defines it (the default)
    shared-last  kv_sharing="last", the paper's decode-time approximation (arXiv 2510.25741 §5.4.2): prompt
                 tokens keep one K/V per (loop, layer); a generated token keeps only its last loop's K/V per
                 layer, which every loop of later tokens reads

shared-last memory (a slot map of loops only, T loops of L layers, as Ouro's). One pool, one free list. A
block is either a prompt block (block_size tokens in all T x L planes, as paged, prefix-cached) or a generated
page: the same bytes regrouped as T groups of L planes hold T x block_size generated tokens, one K/V per layer
each. Generated token g of a request lives in page generated_block_table[g // (T * bs)], plane
(g % (T * bs)) // bs * L + layer, offset g % bs. So a generated token costs 1/T of a prompt token, and the
prompt/generated split adapts to the workload.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from cache.kv_pool import KVPool
from cache.side_rows import SideRows
from model.looped import SlotMap
from request import Request

KV_SHARING = {"none": "paged", "last": "shared-last"}


class KVLayout(ABC):
    name: ClassVar[str]
    # True when a generated token's K/V lives in generated_block_table's pages, not in block_table.
    stores_generated_apart: ClassVar[bool] = False
    # False when an early exit leaves nothing to copy into the deeper slots
    copies_forward: ClassVar[bool] = True

    def __init__(self, slot_map: SlotMap, block_size: int, generated_kv_exact: bool = True) -> None:
        """generated_kv_exact: False when a generated token's K/V is not what a prompt token's would be: the
        exit policy leaves its deeper slots holding copies (early:Q), or (deterministic mode) the attention
        backend sums a prompt's queries otherwise than a decoded token's, so a prompt token's bits differ."""
        self.slot_map, self.block_size = slot_map, block_size
        self.generated_kv_exact = generated_kv_exact

    @property
    def cache_generated(self) -> bool:
        """May blocks holding generated tokens enter the prefix cache? Only where their K/V is exactly
        what a prompt's would be."""
        return self.generated_kv_exact

    @property
    def replay_generated_singly(self) -> bool:
        """Must a recomputed request replay its generated tokens one per step (after its prompt)? Yes when a
        generated token's K/V depends on the loops the previous one finished: an early exit decided loop by
        loop, or a loop-0 read of the previous token's last-loop K/V."""
        return not self.cache_generated

    @abstractmethod
    def missing_blocks(self, request: Request, num_new_tokens: int) -> tuple[int, int]:
        """(block_table, generated_block_table) entries the request lacks to cover num_new_tokens more."""

    @abstractmethod
    def blocks_per_sequence(self, prompt_tokens: int, generated_tokens: int) -> int:
        """Blocks one sequence holds at its full length."""

    @abstractmethod
    def planes_per_token(self, generated: bool) -> int:
        """Slot planes that hold one prompt or generated token's K/V."""

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """In-plane index (block * block_size + offset) of positions start..end-1 of the request's prompt."""
        bs, table = self.block_size, request.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def copy_forward(self, pool: KVPool, slots, loop: int, mask=None) -> None:
        """Tokens that stopped looping after `loop` (those of `slots` where `mask`, if given): make the
        deeper slots hold what later tokens read."""
        pool.copy_forward(slots, loop, mask)

    def max_concurrent_sequences(self, num_blocks: int, prompt_tokens: int, generated_tokens: int,
                                 side_rows: SideRows | None = None) -> int:
        """Sequences of this shape that num_blocks blocks hold at once; with a KVarN pool's side rows, at
        most as many as those hold at their full length."""
        count = num_blocks // self.blocks_per_sequence(prompt_tokens, generated_tokens)
        held = side_rows.sequences_held(prompt_tokens, generated_tokens) if side_rows is not None else None
        return count if held is None else min(count, held)

    def token_bytes(self, slot_token_bytes: int, generated: bool) -> int:
        return self.planes_per_token(generated) * slot_token_bytes

    def report(self, pool: KVPool, num_blocks: int, sequence_tokens: int = 4096,
               side_rows: SideRows | None = None) -> str:
        """The start-up line: bytes per prompt and generated token (a KVarN pool's packed bytes), and how
        many sequences fit (in its blocks and side rows)."""
        prompt_bytes = self.token_bytes(pool.slot_token_bytes, False)
        generated_bytes = self.token_bytes(pool.slot_token_bytes, True)
        half = sequence_tokens // 2
        mixed = self.max_concurrent_sequences(num_blocks, half, sequence_tokens - half, side_rows)
        prompt_only = self.max_concurrent_sequences(num_blocks, sequence_tokens, 0, side_rows)
        sharing = {v: k for k, v in KV_SHARING.items()}[self.name]
        return (f"KV {prompt_bytes / 1024:.1f} KiB/prompt token, {generated_bytes / 1024:.1f} KiB/generated "
                f"token (kv_sharing={sharing}), {num_blocks} blocks of {self.block_size}; max concurrent "
                f"{sequence_tokens}-token sequences: {mixed} at half prompt, half generated "
                f"({prompt_only} all prompt)")


class PagedLayout(KVLayout):
    name = "paged"

    def missing_blocks(self, request: Request, num_new_tokens: int) -> tuple[int, int]:
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(request.block_table)), 0

    def blocks_per_sequence(self, prompt_tokens: int, generated_tokens: int) -> int:
        return -(-(prompt_tokens + generated_tokens) // self.block_size)

    def planes_per_token(self, generated: bool) -> int:
        return self.slot_map.num_slots


class SharedLastLayout(KVLayout):
    name = "shared-last"
    stores_generated_apart = True

    def __init__(self, slot_map: SlotMap, block_size: int, generated_kv_exact: bool = True) -> None:
        if not slot_map.loops_only:
            raise ValueError("kv_sharing='last' needs a model whose slots all belong to its loops; this one "
                             f"has {slot_map.prelude_layers} prelude and {slot_map.coda_layers} coda slots")
        super().__init__(slot_map, block_size, generated_kv_exact)

    @property
    def page_tokens(self) -> int:
        return self.slot_map.loops * self.block_size

    @property
    def cache_generated(self) -> bool:
        return False  # a generated token's K/V is one loop's, not the T loops a prompt token keeps

    def missing_blocks(self, request: Request, num_new_tokens: int) -> tuple[int, int]:
        end = request.num_computed_tokens + num_new_tokens
        num_prompt = request.num_prompt_tokens
        prompt = -(-min(end, num_prompt) // self.block_size) - len(request.block_table)
        pages = -(-max(0, end - num_prompt) // self.page_tokens) - len(request.generated_block_table)
        return max(0, prompt), max(0, pages)

    def blocks_per_sequence(self, prompt_tokens: int, generated_tokens: int) -> int:
        return -(-prompt_tokens // self.block_size) + -(-generated_tokens // self.page_tokens)

    def planes_per_token(self, generated: bool) -> int:
        return self.slot_map.loop_layers if generated else self.slot_map.num_slots

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Prompt positions as paged; -1 for a generated position, which is in no per-loop plane: attention
        stores and reads it through generated_block_table (attention/base.py SharedKVMetadata)."""
        num_prompt = request.num_prompt_tokens
        slots = super().slot_mapping(request, start, min(end, num_prompt))
        return slots + [-1] * (end - max(start, num_prompt))

    copies_forward = False

    def copy_forward(self, pool: KVPool, slots, loop: int, mask=None) -> None:
        """Nothing to copy: an exited token's shared location already holds its last computed loop."""


def make_layout(kv_sharing: str, slot_map: SlotMap, block_size: int,
                generated_kv_exact: bool = True) -> KVLayout:
    if kv_sharing not in KV_SHARING:
        raise ValueError(f"kv_sharing must be 'none' or 'last', got {kv_sharing!r}")
    cls = SharedLastLayout if KV_SHARING[kv_sharing] == "shared-last" else PagedLayout
    return cls(slot_map, block_size, generated_kv_exact)
