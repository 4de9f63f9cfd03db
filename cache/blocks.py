"""The block allocator: fixed-size blocks, a free list, ref counts, per-request block tables and the
prefix cache. It owns block ownership; it never touches KV tensors or decides what runs next.

One block table per request covers all T x L slots: a block id names the same token range in every
(loop, layer) plane, so one allocation here reserves that range in all of them. How many blocks a request
needs, in which of its two tables, and whether generated tokens may be prefix-cached, the KV layout says
(cache/layout.py).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib

from cache.layout import KVLayout, PagedLayout
from cache.side_rows import SideRows
from model.looped import SlotMap
from request import Request


@dataclasses.dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and computed; kept after free until reuse
    token_ids: tuple[int, ...] = ()


def block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained hash of one full block: the parent block's hash mixed with this block's token ids."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def _root_hash(request: Request) -> bytes | None:
    """The first block's parent: what a request's K/V depends on besides its tokens, so that only requests
    that agree on it share cached blocks: its state seed (drawn initial states) and its own loop count
    (SamplingParams.loops, None where it runs the engine's)."""
    seed, loops = request.state_seed, request.params.loops
    if seed is None and loops is None:
        return None
    salt = b"" if seed is None else seed.to_bytes(8, "little")
    return salt if loops is None else salt + b"loops" + loops.to_bytes(4, "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 layout: KVLayout | None = None, side_rows: SideRows | None = None) -> None:
        """layout: the KV layout whose blocks this manager hands out (default: paged, one loop). side_rows: a
        KVarN pool's side-row ownership (cache/side_rows.py), kept in step with the blocks."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockManager.num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"BlockManager.block_size must be an integer >= 1, got {block_size!r}")
        self.layout = layout if layout is not None else PagedLayout(SlotMap(1, 1), block_size)
        if self.layout.block_size != block_size:
            raise ValueError(f"BlockManager.block_size {block_size} differs from the layout's "
                             f"{self.layout.block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: new blocks come from the front, freed ones join the back.
        self.free_block_ids: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_blocks)
        )
        self.hash_to_block_id: dict[bytes, int] = {}
        self.side_rows = side_rows

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request: Request) -> int:
        """Give a newly admitted request the cached blocks of its longest cached prefix; return how many
        tokens they hold. At least one token is left uncached so that the step still yields logits."""
        assert not request.block_table, f"request {request.request_id} already holds blocks"
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return 0  # as vLLM: prompt logprobs need the logits of every prompt token, so none is cached
        token_ids = request.token_ids
        parent, hit = _root_hash(request), []
        for i in range(self._cacheable_tokens(request, len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = block_hash(parent, chunk)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hit.append(block_id)
        if self.side_rows is not None:  # a KVarN pool: only as far as the hit's side rows reach
            hit = hit[:self.side_rows.usable_hit(hit)]
        for block_id in hit:
            self._take(block_id)
        request.block_table.extend(hit)
        return len(request.block_table) * self.block_size

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """Do the free blocks (and a KVarN pool's side rows) cover num_new_tokens more tokens?"""
        if sum(self.layout.missing_blocks(request, num_new_tokens)) > self.num_free_blocks:
            return False
        start = request.num_computed_tokens
        return self.side_rows is None or self.side_rows.fits(request, start, start + num_new_tokens)

    def append_slots(self, request: Request, num_new_tokens: int) -> None:
        """Grow the request's tables to cover num_computed_tokens + num_new_tokens tokens."""
        missing = self.layout.missing_blocks(request, num_new_tokens)
        assert sum(missing) <= self.num_free_blocks, "append_slots without can_append"
        for table, count in zip((request.block_table, request.generated_block_table), missing):
            for _ in range(count):
                block_id = next(iter(self.free_block_ids))
                self._forget_hash(block_id)
                if self.side_rows is not None:
                    self.side_rows.drop(block_id)
                self._take(block_id)
                table.append(block_id)
        if self.side_rows is not None:
            start = request.num_computed_tokens
            self.side_rows.hold(request, start, start + num_new_tokens)

    def free(self, request: Request) -> None:
        """Drop the request's references. Blocks that reach ref 0 become free but keep their hash, so a
        later request with the same prefix still finds them until they are reused. Generated pages carry no
        hash: they are reused before cached prompt blocks."""
        for block_id in reversed(request.generated_block_table):
            self._release(block_id, findable=False)
        request.generated_block_table = []
        for block_id in reversed(request.block_table):  # tail blocks are the least shareable: evict first
            self._release(block_id, findable=self._findable(self.blocks[block_id]))
        request.block_table = []
        if self.side_rows is not None:
            self.side_rows.release(request)

    def _release(self, block_id: int, findable: bool) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if not findable:  # reuse blocks the cache cannot hand out before cached ones
                self.free_block_ids.move_to_end(block_id, last=False)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        table, size = request.block_table, self.block_size
        num_full = self._cacheable_tokens(request, request.num_computed_tokens) // size
        first = num_full
        while first > 0 and self.blocks[table[first - 1]].hash is None:
            first -= 1
        if first == num_full:
            return
        parent = self.blocks[table[first - 1]].hash if first > 0 else _root_hash(request)
        token_ids = request.token_ids
        for i in range(first, num_full):
            block = self.blocks[table[i]]
            block.token_ids = tuple(token_ids[i * size : (i + 1) * size])
            block.hash = parent = block_hash(parent, block.token_ids)
            # An identical block computed by another request keeps the entry; this one still carries its
            # hash so that the chain continues through it.
            self.hash_to_block_id.setdefault(block.hash, block.block_id)

    def _cacheable_tokens(self, request: Request, num_tokens: int) -> int:
        return num_tokens if self.layout.cache_generated else min(num_tokens, request.num_prompt_tokens)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _findable(self, block: Block) -> bool:
        return block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id

    def _forget_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if self._findable(block):
            del self.hash_to_block_id[block.hash]
        block.hash = None
        block.token_ids = ()
