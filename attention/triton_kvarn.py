"""The Triton backend's path over a KVarN pool (cache/kvarn_pool.py; docs/low_bit_kv.md).

Each (loop, layer) call, every row of the step at once, in this order:
1. The new tokens' K/V go to their blocks' side blocks, where they have one (a decode row's block is its
   newest, which always has one; a prefill chunk's blocks have one where they lie in the request's window).
2. The blocks the new tokens complete are packed by the Triton pack kernel (cache/kvarn_pack_kernel.py),
   their rows rotated first as the codec rotates them: a block that began before the step from its side
   block (which holds all its rows after 1.), a block wholly inside a prefill chunk from the chunk's K/V.
3. Prefill rows attend through attention/kernels/kvarn_prefill.py (each query by KVarN's per-query rule),
   decode rows through attention/kernels/kvarn_decode.py (split-KV), both dequantizing in registers.

The side pool keeps rows as the model made them, unrotated, as the reference does; the kernels read them
with the unrotated query and the packed tiles with the rotated one, and only the packed share of the output
is rotated back ("both bases").

Writing side rows before attending is safe: a request keeps the side blocks of its window at the step's
start during the step, so a new row never lands where a row the step still reads lies (cache/side_rows.py).
"""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionMetadata
from attention.kernels.kvarn_decode import kvarn_decode
from attention.kernels.kvarn_prefill import kvarn_prefill

PREFILL_BLOCK_M = 16  # queries per program (tl.dot needs 16)


@dataclasses.dataclass(slots=True)
class KVarNStep:
    """A step's host decisions over a KVarN pool, the same for every (loop, layer) call."""

    side_rows: torch.Tensor | None = None  # [M] int64: side block * G + offset of each new row kept there
    side_tokens: torch.Tensor | None = None  # [M] int64: the step token each comes from
    side_packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (side blocks int64, blocks int32) to pack
    chunk_packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (token rows int64 [F, G], blocks int32)
    prefill_work: torch.Tensor | None = None  # [items, 2] int32 (row, first query) for the prefill kernel
    prefill_tokens: torch.Tensor | None = None  # [P] int64: the step tokens of the prefill rows
    decode_tokens: torch.Tensor | None = None  # [R] int64: each decode row's token
    block_tables: torch.Tensor | None = None  # [R, blocks] int32: the decode rows'
    side_tables: torch.Tensor | None = None  # [rows, blocks] int32 (-1: no side block), every row
    decode_side_tables: torch.Tensor | None = None  # [R, blocks] int32: the decode rows'
    context_lens: torch.Tensor | None = None  # [R] int32: the decode rows'
    max_context_len: int = 0


def prepare_kvarn_step(meta: AttentionMetadata, block_size: int, to_device) -> KVarNStep:
    """to_device(host tensor) -> device tensor (pinned and non-blocking on CUDA)."""
    g, step = block_size, KVarNStep()
    starts, tables = meta.query_starts_cpu, meta.side_tables_cpu
    side_rows, side_tokens, side_packed, chunk_rows, chunk_packed = [], [], [], [], []
    decode, prefill, work = [], [], []
    for row, (num_new, end) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        first, table = end - num_new, tables[row]
        for tile in range(first // g, -(-end // g)):  # the blocks the new rows land in, a run per block
            side = table[tile] if tile < len(table) else -1
            lo, hi = max(first, tile * g), min(end, (tile + 1) * g)
            if side >= 0:
                side_rows += range(side * g + lo % g, side * g + (hi - 1) % g + 1)
                side_tokens += range(starts[row] + lo - first, starts[row] + hi - first)
            elif num_new == 1:
                raise RuntimeError(f"decode row {row} (position {lo}) has no side block for its newest "
                                   "block; the side-row windows (cache/side_rows.py) should give it one")
        for tile in range(first // g, end // g):  # the tiles this step completes
            if tile * g < first:  # begun before the step: every row is in its side block now
                if table[tile] < 0:
                    raise RuntimeError(f"row {row}'s tile {tile}, begun before this step, has no side block")
                side_packed.append((table[tile], row, tile))
            else:
                chunk_packed.append((row, tile))
                chunk_rows.append(range(starts[row] + tile * g - first, starts[row] + (tile + 1) * g - first))
        if num_new == 1:
            decode.append(row)
        else:
            prefill.append(row)
            work += [(row, m0) for m0 in range(0, num_new, PREFILL_BLOCK_M)]
    if side_rows:
        step.side_rows = to_device(torch.tensor(side_rows, dtype=torch.int64))
        step.side_tokens = to_device(torch.tensor(side_tokens, dtype=torch.int64))

    def blocks_of(entries: list[tuple[int, int]]) -> torch.Tensor:  # (row, tile) -> pool block, on the device
        rows, tiles = to_device(torch.tensor(entries, dtype=torch.int64)).unbind(1)
        return meta.block_tables[rows, tiles].to(torch.int32)

    if side_packed:
        step.side_packed = (to_device(torch.tensor([side for side, _, _ in side_packed], dtype=torch.int64)),
                            blocks_of([(row, tile) for _, row, tile in side_packed]))
    if chunk_packed:
        step.chunk_packed = (to_device(torch.tensor([list(r) for r in chunk_rows], dtype=torch.int64)),
                             blocks_of(chunk_packed))
    width = max((len(t) for t in tables), default=0) or 1
    side_tables = torch.full((len(tables), width), -1, dtype=torch.int32)
    for row, table in enumerate(tables):
        side_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    step.side_tables = to_device(side_tables)
    if prefill:
        step.prefill_work = to_device(torch.tensor(work, dtype=torch.int32))
        step.prefill_tokens = to_device(torch.tensor([t for row in prefill for t in range(starts[row],
                                                                                           starts[row + 1])],
                                                     dtype=torch.int64))
    if decode:
        index = to_device(torch.tensor(decode, dtype=torch.int64))
        step.decode_tokens = to_device(torch.tensor([starts[row] for row in decode], dtype=torch.int64))
        step.block_tables = meta.block_tables.index_select(0, index)
        step.decode_side_tables = step.side_tables.index_select(0, index)
        step.context_lens = meta.context_lens.index_select(0, index)
        step.max_context_len = max(meta.context_lens_cpu[row] for row in decode)
    return step


def kvarn_forward(step: KVarNStep, meta: AttentionMetadata, pool, slot: int, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, scale: float, split_cap: int,
                  split_min_keys: int) -> torch.Tensor:
    """One (loop, layer) call over the pool: stores the new K/V (packing the blocks they complete) and
    returns attention's output [N, heads, D] in q's dtype."""
    rotation, fmt = pool.rotation, pool.fmt
    if step.side_rows is not None:
        pool.write_side_rows(slot, step.side_rows, k[step.side_tokens], v[step.side_tokens])
    if step.side_packed is not None:
        pool.pack_side_blocks(slot, *step.side_packed)
    if step.chunk_packed is not None:
        pool.pack_rows(slot, k.float() @ rotation, v.float() @ rotation, *step.chunk_packed)
    out = torch.empty_like(q)
    key_codes, value_codes = pool.key_codes[slot], pool.value_codes[slot]
    key_scales, value_scales = pool.key_scales[slot], pool.value_scales[slot]
    side_k, side_v = pool.side_keys[slot], pool.side_values[slot]
    if step.prefill_work is not None:
        attended = kvarn_prefill(q, k, v, key_codes, value_codes, key_scales, value_scales, side_k, side_v,
                                 meta.block_tables, step.side_tables, meta.query_start_loc, meta.context_lens,
                                 step.prefill_work, fmt.key_bits, fmt.value_bits, rotation, pool.sink,
                                 pool.tail, scale, PREFILL_BLOCK_M)
        out[step.prefill_tokens] = attended[step.prefill_tokens].to(q.dtype)
    if step.decode_tokens is not None:
        query = q[step.decode_tokens].float()
        attended = kvarn_decode(query @ rotation, key_codes, value_codes, key_scales, value_scales, side_k,
                                side_v, step.block_tables, step.decode_side_tables, step.context_lens,
                                fmt.key_bits, fmt.value_bits, pool.sink, pool.tail, scale, split_cap,
                                split_min_keys, step.max_context_len, q=query, rotation=rotation)
        out[step.decode_tokens] = attended.to(q.dtype)
    return out

