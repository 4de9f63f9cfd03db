"""The Triton backend's path over a KVarN pool (cache/kvarn_pool.py; docs/low_bit_kv.md).

Decode rows (one new token) take the kernels, every decode row of a step in one launch per kernel and slot:
the new token's K/V go to its block's side block (a decode row's block is its newest, which always has
one), the blocks those tokens complete are packed from their side blocks by the Triton pack kernel
(cache/kvarn_pack_kernel.py, after the rows are rotated as the codec rotates them), and split-KV decode
attends over the packed tiles and the side rows, dequantizing in registers
(attention/kernels/kvarn_decode.py). The side pool keeps rows as the model made them, unrotated, as the
reference does; the decode kernel reads them with the unrotated query and the packed tiles with the
rotated one, and rotates only the packed share of the output back ("both bases").

Prefill rows still take the reference path row by row (attention/packed_attention.py:
attend_row_through_pool): a Triton prefill over a packed history, with the per-query rule of which positions
are high precision, is not written yet.

Writing a decode row's side row before attending is safe: the blocks of a request's window (its first
ceil(sink / G) blocks and its newest ceil(tail / G) + 1) hold distinct side blocks, and a position the query
reads in high precision always lies in the window (cache/side_rows.py).
"""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionMetadata
from attention.kernels.kvarn_decode import kvarn_decode
from attention.packed_attention import attend_row_through_pool


@dataclasses.dataclass(slots=True)
class KVarNStep:
    """A step's decode rows over a KVarN pool, the same for every (loop, layer) call."""

    prefill_rows: list[int]
    tokens: torch.Tensor | None = None  # [R] int64: each decode row's token in the step
    side_rows: torch.Tensor | None = None  # [R] int64: side block * G + offset of each new token
    block_tables: torch.Tensor | None = None  # [R, blocks] int32
    side_tables: torch.Tensor | None = None  # [R, blocks] int32 (-1: no side block)
    context_lens: torch.Tensor | None = None  # [R] int32
    max_context_len: int = 0
    filled_side_blocks: torch.Tensor | None = None  # [F] int64: side blocks of the blocks this step completes
    filled_blocks: torch.Tensor | None = None  # [F] int32: the pool blocks they pack into


def prepare_kvarn_step(meta: AttentionMetadata, block_size: int, to_device) -> KVarNStep:
    """The step's host decisions: which rows decode, where their new rows go, which blocks they fill.
    to_device(host tensor) -> device tensor (pinned and non-blocking on CUDA)."""
    decode = [row for row, n in enumerate(meta.query_lens_cpu) if n == 1]
    step = KVarNStep([row for row, n in enumerate(meta.query_lens_cpu) if n > 1])
    if not decode:
        return step
    starts, tables = meta.query_starts_cpu, meta.side_tables_cpu
    side_rows, filled_side, filled_rows = [], [], []
    for row in decode:
        position = meta.context_lens_cpu[row] - 1
        side = tables[row][position // block_size] if position // block_size < len(tables[row]) else -1
        if side < 0:
            raise RuntimeError(f"decode row {row} (position {position}) has no side block for its newest "
                               "block; the side-row windows (cache/side_rows.py) should give it one")
        side_rows.append(side * block_size + position % block_size)
        if (position + 1) % block_size == 0:
            filled_side.append(side)
            filled_rows.append((row, position // block_size))
    width = max(len(tables[row]) for row in decode)
    side_tables = torch.full((len(decode), width), -1, dtype=torch.int32)
    for i, row in enumerate(decode):
        side_tables[i, :len(tables[row])] = torch.tensor(tables[row], dtype=torch.int32)
    index = to_device(torch.tensor(decode, dtype=torch.int64))
    step.tokens = to_device(torch.tensor([starts[row] for row in decode], dtype=torch.int64))
    step.side_rows = to_device(torch.tensor(side_rows, dtype=torch.int64))
    step.block_tables = meta.block_tables.index_select(0, index)
    step.side_tables = to_device(side_tables)
    step.context_lens = meta.context_lens.index_select(0, index)
    step.max_context_len = max(meta.context_lens_cpu[row] for row in decode)
    if filled_side:
        step.filled_side_blocks = to_device(torch.tensor(filled_side, dtype=torch.int64))
        blocks = torch.stack([meta.block_tables[row, tile] for row, tile in filled_rows])
        step.filled_blocks = blocks.to(torch.int32)
    return step


def kvarn_forward(step: KVarNStep, meta: AttentionMetadata, pool, slot: int, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, scale: float, split_cap: int,
                  split_min_keys: int) -> torch.Tensor:
    """One (loop, layer) call over the pool: stores the new K/V (packing the blocks they fill) and returns
    attention's output [N, heads, D] in q's dtype."""
    out = torch.empty_like(q)
    starts = meta.query_starts_cpu
    for row in step.prefill_rows:
        new = slice(starts[row], starts[row + 1])
        first = meta.context_lens_cpu[row] - meta.query_lens_cpu[row]
        out[new] = attend_row_through_pool(pool, slot, meta.side_tables_cpu[row], meta.block_tables[row],
                                           first, q[new], k[new], v[new], scale).to(q.dtype)
    if step.tokens is None:
        return out
    pool.write_side_rows(slot, step.side_rows, k[step.tokens], v[step.tokens])
    if step.filled_blocks is not None:
        pool.pack_side_blocks(slot, step.filled_side_blocks, step.filled_blocks)
    query = q[step.tokens].float()
    fmt = pool.fmt
    attended = kvarn_decode(query @ pool.rotation, pool.key_codes[slot], pool.value_codes[slot],
                            pool.key_scales[slot], pool.value_scales[slot], pool.side_keys[slot],
                            pool.side_values[slot], step.block_tables, step.side_tables, step.context_lens,
                            fmt.key_bits, fmt.value_bits, pool.sink, pool.tail, scale, split_cap,
                            split_min_keys, step.max_context_len, q=query, rotation=pool.rotation)
    out[step.tokens] = attended.to(q.dtype)
    return out
