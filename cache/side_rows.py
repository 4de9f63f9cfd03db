"""Who owns a KVarN pool's high-precision side rows (cache/kvarn_pool.py), and for how long.

A side block holds one pool block's rows as stored, in every (loop, layer) slot. It belongs to the block id:
it follows the block through prefix-cache hits and frees, and is released when the block is reused for other
tokens, or, under pressure, evicted while no running request needs it (LRU). A request holds the side blocks
of its `window`: its first ceil(sink / G) blocks and its newest ceil(tail / G) + 1, the blocks whose rows a
query of the request may read in high precision (attention/packed_attention.py: high_precision). During a
step it holds the windows at the step's start and end (a chunk's early queries read the first; the new rows
are kept for the second), and it lets the older blocks go at its next step. A block gets its side block when
it enters a window, always with its first new row, and keeps every row from then on: a side block that
outlives its window is complete, so a later prefix hit may read it. A hit is cut back to the longest prefix
whose window blocks all still have their side blocks; the rest is recomputed, so a cached run reads what an
uncached one reads.
"""

from __future__ import annotations

import collections

from request import Request


def keeps_side_rows(index: int, length: int, block_size: int, sink_blocks: int, ring_blocks: int) -> bool:
    """Is block `index` in the window of a sequence of `length` tokens?"""
    return index < sink_blocks or index > (length - 1) // block_size - ring_blocks


class SideRows:
    def __init__(self, sequences: int, block_size: int, sink: int, tail: int) -> None:
        """Side blocks for `sequences` running requests at their largest (two windows each); the ones they
        do not hold keep cached blocks' rows until needed."""
        self.block_size, self.tail = block_size, tail
        self.sink_blocks = -(-sink // block_size)
        self.ring_blocks = -(-tail // block_size) + 1
        self.capacity = capacity = sequences * self.per_request
        self.free = list(range(capacity - 1, -1, -1))
        self.side_of: dict[int, int] = {}  # block id -> its side block
        self.users: collections.Counter[int] = collections.Counter()  # block id -> requests holding it
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by none: LRU

    @property
    def per_request(self) -> int:
        """The most side blocks one request holds at once (two windows)."""
        return 2 * (self.sink_blocks + self.ring_blocks)

    def window(self, length: int) -> set[int]:
        if length <= 0:
            return set()
        last = (length - 1) // self.block_size
        return set(range(min(self.sink_blocks, last + 1))) | set(range(max(0, last - self.ring_blocks + 1),
                                                                       last + 1))

    def usable_hit(self, block_ids: list[int]) -> int:
        """How many of a prefix hit's blocks a request may take: the most whose rows that the request's
        queries read in high precision all have their side blocks. Queries from position c on read, before c,
        the sink positions and positions from c + 1 - tail (attention/packed_attention.py)."""
        count = len(block_ids)
        while count and any(block_ids[i] not in self.side_of
                            for i in self.read_before(count * self.block_size)):
            count -= 1
        return count

    def read_before(self, start: int) -> set[int]:
        """Blocks below `start` whose rows queries at positions >= start may read in high precision."""
        first = start + 1 - self.tail if self.tail else start
        blocks = set(range(max(0, first) // self.block_size, -(-start // self.block_size)))
        return blocks | set(range(min(self.sink_blocks, -(-start // self.block_size))))

    def hold(self, request: Request, start: int, end: int) -> None:
        """The request computes positions start..end-1 this step: hold its windows at start and end (giving
        each new window block a side block), and let go of those it held for earlier steps only."""
        table, size = request.block_table, self.block_size
        # A full block below `start` without a side block never gets its rows (nothing new is stored in it)
        # and no query reads it so (usable_hit, and a request's own blocks have theirs since they began).
        wanted = {table[i] for i in self.window(start) | self.window(end)
                  if table[i] in self.side_of or (i + 1) * size > start}
        for block_id in set(request.side_held) - wanted:
            self._let_go(block_id)
        new = wanted - set(request.side_held)
        for block_id in new & self.side_of.keys():  # first, so that no eviction below takes their rows
            self.users[block_id] += 1
            self.idle.pop(block_id, None)
        for block_id in new - self.side_of.keys():  # it enters a window with its first new row
            self.side_of[block_id] = self._take_free()
            self.users[block_id] += 1
        request.side_held = sorted(wanted)
        request.side_table = [self.side_of[b] if b in wanted else -1 for b in table]

    def release(self, request: Request) -> None:
        """The request freed its blocks (finished or preempted)."""
        for block_id in request.side_held:
            self._let_go(block_id)
        request.side_held, request.side_table = [], []

    def drop(self, block_id: int) -> None:
        """The block is reused for other tokens: its side rows are no longer its own."""
        side = self.side_of.pop(block_id, None)
        if side is not None:
            assert not self.users[block_id], f"block {block_id} is reused while a request holds its side rows"
            self.idle.pop(block_id, None)
            self.free.append(side)

    def _let_go(self, block_id: int) -> None:
        self.users[block_id] -= 1
        if not self.users[block_id]:
            del self.users[block_id]
            self.idle[block_id] = None

    def _take_free(self) -> int:
        if not self.free:
            assert self.idle, "every side block is held: the side pool is smaller than max_num_seqs needs"
            evicted, _ = self.idle.popitem(last=False)
            self.free.append(self.side_of.pop(evicted))
        return self.free.pop()
