"""KV layouts: where each token's K/V lives in the pool, as strategies. A layout owns the blocks a sequence
needs, the slot mapping of new tokens, whether generated tokens' blocks may enter the prefix cache, what an
early exit does to the deeper slots (copy-forward), and the byte accounting. The block manager owns which
request holds which block; the layout only says how many and where. By `kv_layout` name
(docs/looped_controls.md, "KV layouts"):

    full         one K/V per slot of the model's slot map (model/looped.py: SlotMap) for every token, as the
                 model defines it (the default where every token runs every loop)
    latest       full, and a token that stopped looping early leaves its last computed loop's K/V in its
                 deeper slots (copy-forward), so a later token's deeper loop reads that token's deepest K/V of
                 the same physical layer (Huginn's latest-m4, arXiv 2502.05171; the default for an exit policy
                 that stops loops)
    compress:k   a ring of k loop-layer slots (k a multiple of the C layers one loop runs: K = k / C loops):
                 loop t writes and reads ring loop t mod K, so the pool holds P + k + D slots per token, not
                 P + T * C + D (Huginn's compress-s{k}). Within one step every new token writes a loop's
                 slots and then reads them, so a prompt computed in one step is exact; a token of a later step
                 reads an earlier step's tokens at the last loop that wrote that ring slot
    latest-compress:k  both: over the ring, a token that stopped after loop t < K-1 leaves its loop-t K/V in
                 ring loops t+1..K-1, which it never wrote (Huginn's latest-m4-compress-s{k})
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

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

from cache.kv_pool import KVPool
from cache.side_rows import SideRows
from model.looped import SlotMap
from request import Request

KV_SHARING = {"none": "paged", "last": "shared-last"}
SHARED_LAST = "shared-last"


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutName:
    """A paged layout's `kv_layout` name, parsed: the latest lookup (copy-forward) or not, and the ring's
    loop-layer slots (None: one plane per loop)."""

    latest: bool
    compress: int | None = None

    def __str__(self) -> str:
        if self.compress is None:
            return "latest" if self.latest else "full"
        return f"latest-compress:{self.compress}" if self.latest else f"compress:{self.compress}"


def parse_kv_layout(name: object) -> LayoutName:
    """full, latest, compress:k or latest-compress:k (k a positive integer); ValueError naming kv_layout.
    k against the model's loops and layers is make_layout's check."""
    if isinstance(name, str):
        rest = name.removeprefix("latest-") if name.startswith("latest-compress:") else name
        if name in ("full", "latest"):
            return LayoutName(name == "latest")
        kind, _, value = rest.partition(":")
        if kind == "compress" and value.isdigit() and int(value) >= 1:
            return LayoutName(rest != name, int(value))
    raise ValueError(f"kv_layout must be 'full', 'latest', 'compress:k' or 'latest-compress:k' (k: the "
                     f"loop-layer slots a token keeps, a positive multiple of the layers one loop runs), got "
                     f"{name!r}")


def ring_slot_map(slot_map: SlotMap, compress: int, name: str) -> SlotMap:
    """The slot map of a ring of `compress` loop-layer slots: whole loops only, at most the T loops'."""
    layers, loops = slot_map.loop_layers, slot_map.loops
    if compress % layers:
        raise ValueError(f"kv_layout={name!r}: k={compress} must be a multiple of the {layers} layers one "
                         f"loop runs, so that every ring slot stays one physical layer (a ring that splits a "
                         f"loop would give one slot to different layers; compress:{layers}, "
                         f"compress:{2 * layers}, ... keep whole loops)")
    if compress > loops * layers:
        raise ValueError(f"kv_layout={name!r}: k={compress} exceeds the {loops * layers} loop-layer slots a "
                         f"token has ({loops} loops x {layers} layers); compress:{loops * layers} keeps "
                         f"them all (as full)")
    ring = compress // layers
    return dataclasses.replace(slot_map, ring_loops=None if ring == loops else ring)


@dataclasses.dataclass(frozen=True, slots=True)
class KVCapacity:
    """What a layout buys: bytes per token and tokens per GiB (a prompt token's, and a generated token's
    where they differ), against the full layout's (one plane per slot of the model's slot map)."""

    kv_layout: str
    prompt_token_bytes: float
    generated_token_bytes: float
    full_token_bytes: float
    pool_tokens: int  # prompt tokens the pool's blocks hold

    @property
    def tokens_per_gib(self) -> float:
        return 2**30 / self.prompt_token_bytes

    @property
    def generated_tokens_per_gib(self) -> float:
        return 2**30 / self.generated_token_bytes

    @property
    def gain(self) -> float:
        """Tokens per GiB against the full layout's (prompt tokens)."""
        return self.full_token_bytes / self.prompt_token_bytes


class KVLayout(ABC):
    name: ClassVar[str]  # the storage scheme an attention backend must provide (Capabilities.kv_formats)
    # True when a generated token's K/V lives in generated_block_table's pages, not in block_table.
    stores_generated_apart: ClassVar[bool] = False
    # False when an early exit leaves nothing to copy into the deeper slots
    copies_forward: bool = True

    def __init__(self, slot_map: SlotMap, block_size: int, generated_kv_exact: bool = True) -> None:
        """slot_map: the slots the pool holds (with a ring, model/looped.py: SlotMap.ring_loops; the model
        then calls attention with these). generated_kv_exact: False when a generated token's K/V is not what
        a prompt token's would be: the exit policy leaves its deeper slots holding copies (early:Q), or
        (deterministic mode) the attention backend sums a prompt's queries otherwise than a decoded token's,
        so a prompt token's bits differ."""
        self.slot_map, self.block_size = slot_map, block_size
        self.generated_kv_exact = generated_kv_exact
        self.kv_layout = self.name  # the layout's name (cache/layout.py's list)

    @property
    def option(self) -> str:
        """The Engine option that chose this layout, as the start-up line spells it."""
        return f"kv_layout={self.kv_layout}"

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

    def copy_forward(self, pool: KVPool, slots, loop, mask=None) -> None:
        """Tokens that stopped looping after `loop` (an int, or each row's, [n] on the device; those of
        `slots` where `mask`, if given): make the deeper slots hold what later tokens read."""
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

    def capacity(self, pool: KVPool, num_blocks: int) -> KVCapacity:
        """Bytes per token and tokens per GiB in this layout, against the full layout's."""
        full = dataclasses.replace(self.slot_map, ring_loops=None).num_slots * pool.slot_token_bytes
        return KVCapacity(self.kv_layout, self.token_bytes(pool.slot_token_bytes, False),
                          self.token_bytes(pool.slot_token_bytes, True), full, num_blocks * self.block_size)

    def report(self, pool: KVPool, num_blocks: int, sequence_tokens: int = 4096,
               side_rows: SideRows | None = None) -> str:
        """The start-up line: bytes per prompt and generated token (a KVarN pool's packed bytes), tokens per
        GiB against the full layout's, and how many sequences fit (in its blocks and side rows)."""
        capacity = self.capacity(pool, num_blocks)
        half = sequence_tokens // 2
        mixed = self.max_concurrent_sequences(num_blocks, half, sequence_tokens - half, side_rows)
        prompt_only = self.max_concurrent_sequences(num_blocks, sequence_tokens, 0, side_rows)
        return (f"KV {capacity.prompt_token_bytes / 1024:.1f} KiB/prompt token, "
                f"{capacity.generated_token_bytes / 1024:.1f} KiB/generated token ({self.option}: "
                f"{capacity.tokens_per_gib:,.0f} tokens/GiB, {capacity.gain:.2f}x full's), {num_blocks} "
                f"blocks of {self.block_size}; max concurrent {sequence_tokens}-token sequences: {mixed} at "
                f"half prompt, half generated ({prompt_only} all prompt)")


class PagedLayout(KVLayout):
    """full, latest, compress:k and latest-compress:k: every token in block_table, in every slot of
    `slot_map` (a ring's, for compress:k)."""

    name = "paged"

    def __init__(self, slot_map: SlotMap, block_size: int, generated_kv_exact: bool = True,
                 layout: LayoutName = LayoutName(latest=True)) -> None:
        super().__init__(slot_map, block_size, generated_kv_exact)
        self.copies_forward = layout.latest
        self.kv_layout = str(layout)

    @property
    def cache_generated(self) -> bool:
        """Not over a ring: a generated token's K/V read earlier steps' tokens at their last ring write,
        not at the loops a prompt computed in one step reads."""
        return self.generated_kv_exact and self.slot_map.ring_loops is None

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

    @property
    def option(self) -> str:
        return "kv_sharing=last"

    def copy_forward(self, pool: KVPool, slots, loop, mask=None) -> None:
        """Nothing to copy: an exited token's shared location already holds its last computed loop."""


def make_layout(kv_layout: str, slot_map: SlotMap, block_size: int,
                generated_kv_exact: bool = True) -> KVLayout:
    """The layout of a kv_layout name (parse_kv_layout's, or shared-last: kv_sharing="last") over the model's
    slot map; compress:k is checked against its loops and layers here."""
    if kv_layout == SHARED_LAST:
        return SharedLastLayout(slot_map, block_size, generated_kv_exact)
    layout = parse_kv_layout(kv_layout)
    if layout.compress is not None:
        slot_map = ring_slot_map(slot_map, layout.compress, kv_layout)
    return PagedLayout(slot_map, block_size, generated_kv_exact, layout)
