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

Under kv_sharing="last" (generated_apart) a generated tile's rows, one per layer, sit in a side tile that the
request owns alone (generated pages never enter the prefix cache): taken when the tile enters the window,
with its first row, and given back when it leaves. Once a request generates, its window holds the prompt's
sink blocks and the prompt blocks its tail still reaches, and the generated tiles of its sink, its tail and
its newest tile.

Sizing. The pool holds, per sequence, the most that a decoding sequence holds at a step, and one request's
largest need (two windows: a prefill chunk's) on top. Without kv_sharing a decode step holds its window before
and after the token: its sink blocks and ring blocks, and one block more when the token starts a block.
Under kv_sharing="last" a generating sequence keeps its sink blocks and the side tiles of its tail. What a
prefill takes beyond that (its windows, a tail that still reaches into the prompt) is transient, so
admission checks it (`fits`) as it checks blocks, and the scheduler waits or preempts when it runs short.
Sized this way, kvarn_k4v2_g64 with 64 sink and 64 tail tokens holds 74 sequences of 4K tokens where bf16
holds 21 (two windows a sequence held 67).
"""

from __future__ import annotations

import collections

from request import Request


def keeps_side_rows(index: int, length: int, block_size: int, sink_blocks: int, ring_blocks: int) -> bool:
    """Is block `index` in the window of a sequence of `length` tokens?"""
    return index < sink_blocks or index > (length - 1) // block_size - ring_blocks


class SideRows:
    def __init__(self, sequences: int, block_size: int, sink: int, tail: int,
                 generated_apart: bool = False) -> None:
        """Side blocks (and, generated_apart: side tiles) for `sequences` running requests (module
        docstring); the ones they do not hold keep cached blocks' rows until needed."""
        self.block_size, self.sink, self.tail = block_size, sink, tail
        self.generated_apart = generated_apart
        self.sink_blocks = -(-sink // block_size)
        self.ring_blocks = -(-tail // block_size) + 1
        if generated_apart:
            self.capacity = sequences * self.sink_blocks + self.per_request
            self.generated_capacity = sequences * self.generated_ring + self.sink_blocks
        else:
            self.capacity, self.generated_capacity = sequences * self.decode_hold + self.per_request, 0
        self.free = list(range(self.capacity - 1, -1, -1))
        self.generated_free = list(range(self.generated_capacity - 1, -1, -1))
        self.side_of: dict[int, int] = {}  # block id -> its side block
        self.users: collections.Counter[int] = collections.Counter()  # block id -> requests holding it
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by none: LRU

    @property
    def per_request(self) -> int:
        """The most side blocks one request holds at once (two windows)."""
        return 2 * (self.sink_blocks + self.ring_blocks)

    @property
    def decode_hold(self) -> int:
        """The most side blocks a request holds in a step of one new token (without kv_sharing): its window
        before and after the token, one block more than a window where the token starts a block."""
        return self.sink_blocks + self.ring_blocks + 1

    @property
    def generated_ring(self) -> int:
        """The most side tiles a generating request's tail and newest tile take at once (two windows: the
        max(tail, 1) + 1 positions before a step's end)."""
        return -(-max(self.tail, 1) // self.block_size) + 1

    def window(self, length: int, prompt_len: int | None = None) -> set[int]:
        """Block indices (under kv_sharing="last": of prompt blocks, prompt_len tokens) whose rows a query of
        a sequence of `length` tokens may read in high precision."""
        if length <= 0:
            return set()
        size = self.block_size
        if prompt_len is None or length <= prompt_len:
            count = (length - 1) // size + 1  # blocks so far
            ring = range(max(0, count - self.ring_blocks), count)
            return set(range(min(self.sink_blocks, count))) | set(ring)
        blocks = -(-prompt_len // size)
        reach = max(0, length - self.tail)  # the tail's first position
        return set(range(min(self.sink_blocks, blocks))) | set(range(reach // size if reach < prompt_len
                                                                     else blocks, blocks))

    def generated_window(self, length: int, prompt_len: int) -> set[int]:
        """Generated tile indices (tile j: positions prompt_len + j * G..) whose rows a query of a sequence of
        `length` tokens may read in high precision: its sink's, its tail's and its newest tile."""
        if length <= prompt_len:
            return set()
        size = self.block_size
        first = max(prompt_len, length - max(self.tail, 1))
        tiles = set(range((first - prompt_len) // size, (length - 1 - prompt_len) // size + 1))
        return tiles | set(range(-(-(min(self.sink, length) - prompt_len) // size)))

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

    def fits(self, request: Request, start: int, end: int) -> bool:
        """Would hold(request, start, end) find every side block and side tile it takes, free or idle? (Its
        block table may still lack the blocks it is about to get; each of those takes a new side block.)"""
        table, size = request.block_table, self.block_size
        kept, new = set(), 0
        for i in self._windows(request, start, end):
            if i < len(table) and table[i] in self.side_of:
                kept.add(table[i])
            elif (i + 1) * size > start:
                new += 1
        let_go = sum(self.users[b] == 1 for b in set(request.side_held) - kept)
        evictable = len(self.idle) - sum(b in self.idle for b in kept) + let_go
        if new > len(self.free) + evictable:
            return False
        if not self.generated_apart:
            return True
        wanted = self._generated_wanted(request, start, end)
        held = [j for j, tile in enumerate(request.generated_side_table) if tile >= 0]
        new_tiles = sum(j not in held for j in wanted)
        return new_tiles <= len(self.generated_free) + sum(j not in wanted for j in held)

    def hold(self, request: Request, start: int, end: int) -> None:
        """The request computes positions start..end-1 this step: hold its windows at start and end (giving
        each new window block a side block), and let go of those it held for earlier steps only."""
        table, size = request.block_table, self.block_size
        # A full block below `start` without a side block never gets its rows (nothing new is stored in it)
        # and no query reads it so (usable_hit, and a request's own blocks have theirs since they began).
        wanted = {table[i] for i in self._windows(request, start, end)
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
        if self.generated_apart:
            self._hold_generated(request, start, end)

    def _windows(self, request: Request, start: int, end: int) -> set[int]:
        prompt_len = request.num_prompt_tokens if self.generated_apart else None
        return self.window(start, prompt_len) | self.window(end, prompt_len)

    def _generated_wanted(self, request: Request, start: int, end: int) -> set[int]:
        """The generated tiles whose side tiles the request holds for this step: those of its windows that
        have one, or that get rows now."""
        prompt_len, table = request.num_prompt_tokens, request.generated_side_table
        return {j for j in self.generated_window(start, prompt_len) | self.generated_window(end, prompt_len)
                if (j < len(table) and table[j] >= 0) or prompt_len + (j + 1) * self.block_size > start}

    def _hold_generated(self, request: Request, start: int, end: int) -> None:
        wanted = self._generated_wanted(request, start, end)
        table = [-1] * -(-max(0, end - request.num_prompt_tokens) // self.block_size)
        for j, tile in enumerate(request.generated_side_table):
            if tile < 0:
                continue
            if j in wanted:
                table[j] = tile
            else:
                self.generated_free.append(tile)
        for j in sorted(wanted):
            if table[j] < 0:
                assert self.generated_free, "no generated side tile is free: hold() without fits()"
                table[j] = self.generated_free.pop()
        request.generated_side_table = table

    def release(self, request: Request) -> None:
        """The request freed its blocks (finished or preempted)."""
        for block_id in request.side_held:
            self._let_go(block_id)
        self.generated_free += [tile for tile in request.generated_side_table if tile >= 0]
        request.side_held, request.side_table, request.generated_side_table = [], [], []

    def sequences_held(self, prompt_tokens: int, generated_tokens: int) -> int | None:
        """How many sequences of this shape the side pool holds at their full length, each with the windows
        of its last step (one token); None where such a sequence holds none."""
        prompt_len = prompt_tokens if self.generated_apart else None
        end = prompt_tokens + generated_tokens
        blocks = len(self.window(end - 1, prompt_len) | self.window(end, prompt_len))
        tiles = 0
        if self.generated_apart:
            tiles = len(self.generated_window(end - 1, prompt_tokens)
                        | self.generated_window(end, prompt_tokens))
        counts = [capacity // need for capacity, need in ((self.capacity, blocks),
                                                          (self.generated_capacity, tiles)) if need]
        return min(counts) if counts else None

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
            assert self.idle, "every side block is held: hold() without fits()"
            evicted, _ = self.idle.popitem(last=False)
            self.free.append(self.side_of.pop(evicted))
        return self.free.pop()
