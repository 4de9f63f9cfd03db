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
with the unrotated query and the packed tiles with the rotated one ("both bases"). Decode rotates only the
packed share of the output back; prefill rotates the high-precision share into the packed basis and the sum
back, in the kernel.

Writing side rows before attending is safe: a request keeps the side blocks of its window at the step's
start during the step, so a new row never lands where a row the step still reads lies (cache/side_rows.py).

Under CUDA-graph capture (decode steps only) the plan is made on the device from the metadata tensors, which
are the graph's static buffers (`prepare_kvarn_graph_step`): each row's side row from its side table and
context length, and a pack of every row's newest tile, skipped by the kernel where that tile is not full
(its block is passed as -1). The eager plan packs the same tiles with the same kernel, so both modes store
the same bits.
"""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionMetadata
from attention.kernels.kvarn_decode import kvarn_decode
from attention.kernels.kvarn_prefill import kvarn_prefill
from attention.kernels.rotate import rotate_rows

# Queries per prefill program: a piece's dequantized codes serve them all. On sm_90 (k4v2) a 64-key piece
# takes 733 instructions a thread at 128 queries (8 warps) and 1,123 at 64 (4 warps), 1.5x more per query,
# but 64 fits two programs on an SM where 128 fits one (250 and 255 registers); not yet timed on a GPU
# (benchmarks/kvarn_kernels.py times both).
PREFILL_BLOCK_M = 128


@dataclasses.dataclass(slots=True)
class KVarNStep:
    """A step's decisions over a KVarN pool (made on the host, or on the device under capture), the same
    for every (loop, layer) call."""

    side_rows: torch.Tensor | None = None  # [M] int64: side block * G + offset of each new row kept there
    side_tokens: torch.Tensor | None = None  # [M] int64: the step token each comes from (None: token i)
    side_packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (side rows int64 [F, G], blocks int32)
    chunk_packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (token rows int64 [F, G], blocks int32)
    prefill_work: torch.Tensor | None = None  # [items, 2] int32 (row, first query) for the prefill kernel
    decode_tokens: torch.Tensor | None = None  # [R] int64: each decode row's token
    every_row_decodes: bool = False  # a decode step: row i's token is token i (no decode_tokens)
    block_tables: torch.Tensor | None = None  # [R, blocks] int32: the decode rows'
    side_tables: torch.Tensor | None = None  # [rows, blocks] int32 (-1: no side block), every row
    decode_side_tables: torch.Tensor | None = None  # [R, blocks] int32: the decode rows'
    context_lens: torch.Tensor | None = None  # [R] int32: the decode rows'
    max_context_len: int = 0


def prepare_kvarn_step(meta: AttentionMetadata, block_size: int, to_device) -> KVarNStep:
    """to_device(host tensor) -> device tensor (pinned and non-blocking on CUDA). meta.side_tables (the
    runner uploads it with the step) is what the kernels read; its host lists plan the step."""
    if meta.side_tables is None:
        raise ValueError("a KVarN step needs the side tables on the device (meta.side_tables)")
    g, step = block_size, KVarNStep(side_tables=meta.side_tables)
    starts, tables = meta.query_starts_cpu, meta.side_tables_cpu
    side_rows, side_tokens, side_packed, chunk_rows, chunk_packed = [], [], [], [], []
    decode, work = [], []
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
            work += [(row, m0) for m0 in range(0, num_new, PREFILL_BLOCK_M)]
    every_row_decodes = bool(decode) and len(decode) == len(tables)  # row i is token i: side_tokens unneeded
    if side_rows:
        step.side_rows = to_device(torch.tensor(side_rows, dtype=torch.int64))
        if not every_row_decodes:
            step.side_tokens = to_device(torch.tensor(side_tokens, dtype=torch.int64))

    def blocks_of(entries: list[tuple[int, int]]) -> torch.Tensor:  # (row, tile) -> pool block, on the device
        rows, tiles = to_device(torch.tensor(entries, dtype=torch.int64)).unbind(1)
        return meta.block_tables[rows, tiles].to(torch.int32)

    if side_packed:
        rows = [list(range(side * g, (side + 1) * g)) for side, _, _ in side_packed]
        step.side_packed = (to_device(torch.tensor(rows, dtype=torch.int64)),
                            blocks_of([(row, tile) for _, row, tile in side_packed]))
    if chunk_packed:
        step.chunk_packed = (to_device(torch.tensor([list(r) for r in chunk_rows], dtype=torch.int64)),
                             blocks_of(chunk_packed))
    if work:
        step.prefill_work = to_device(torch.tensor(work, dtype=torch.int32))
    if every_row_decodes:
        step.every_row_decodes = True
        step.block_tables, step.decode_side_tables = meta.block_tables, step.side_tables
        step.context_lens = meta.context_lens
        step.max_context_len = max(meta.context_lens_cpu, default=0)
    elif decode:
        index = to_device(torch.tensor(decode, dtype=torch.int64))
        step.decode_tokens = to_device(torch.tensor([starts[row] for row in decode], dtype=torch.int64))
        step.block_tables = meta.block_tables.index_select(0, index)
        step.decode_side_tables = step.side_tables.index_select(0, index)
        step.context_lens = meta.context_lens.index_select(0, index)
        step.max_context_len = max(meta.context_lens_cpu[row] for row in decode)
    return step


def prepare_kvarn_graph_step(meta: AttentionMetadata, block_size: int) -> KVarNStep:
    """A decode step's plan made on the device from the metadata tensors (meta.side_tables included), for a
    CUDA-graph capture: the graph then follows the metadata of each step it replays. Each row's new token
    goes to side row side_tables[r, p // G] * G + p % G of its position p; each row's newest tile is packed
    from its side block when the token completes it (its block passed as -1 otherwise, which the pack kernel
    skips)."""
    if meta.side_tables is None:
        raise ValueError("a captured KVarN decode step needs the side tables on the device "
                         "(meta.side_tables)")
    g = block_size
    context = meta.context_lens.long()
    position = context - 1
    tile = (position // g)[:, None]
    sides = meta.side_tables.gather(1, tile).squeeze(1).long()
    blocks = meta.block_tables.gather(1, tile).squeeze(1)
    offsets = torch.arange(g, dtype=torch.int64, device=sides.device)
    return KVarNStep(side_rows=sides * g + position % g,
                     side_packed=(sides[:, None] * g + offsets, torch.where(context % g == 0, blocks, -1)),
                     block_tables=meta.block_tables, side_tables=meta.side_tables,
                     decode_side_tables=meta.side_tables, context_lens=meta.context_lens,
                     max_context_len=meta.block_tables.shape[1] * g, every_row_decodes=True)


def kvarn_forward(step: KVarNStep, meta: AttentionMetadata, pool, slot: int, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, scale: float, split_cap: int,
                  split_min_keys: int) -> torch.Tensor:
    """One (loop, layer) call over the pool: stores the new K/V (packing the blocks they complete) and
    returns attention's output [N, heads, D] in q's dtype."""
    rotation, fmt = pool.rotation, pool.fmt
    if step.side_rows is not None:
        tokens = step.side_tokens
        pool.write_side_rows(slot, step.side_rows, k if tokens is None else k[tokens],
                             v if tokens is None else v[tokens])
    if step.side_packed is not None:
        pool.pack_side_blocks(slot, *step.side_packed)
    if step.chunk_packed is not None:
        pool.pack_rows(slot, k.float() @ rotation, v.float() @ rotation, *step.chunk_packed)
    key_codes, value_codes = pool.key_codes[slot], pool.value_codes[slot]
    key_scales, value_scales = pool.key_scales[slot], pool.value_scales[slot]
    side_k, side_v = pool.side_keys[slot], pool.side_values[slot]
    if step.every_row_decodes:
        return _decode(step, pool, slot, q.float(), scale, split_cap, split_min_keys).to(q.dtype)
    out = torch.empty_like(q)
    if step.prefill_work is not None:
        kvarn_prefill(q, k, v, key_codes, value_codes, key_scales, value_scales, side_k, side_v,
                      meta.block_tables, step.side_tables, meta.query_start_loc, meta.context_lens,
                      step.prefill_work, fmt.key_bits, fmt.value_bits, rotation, pool.sink, pool.tail, scale,
                      PREFILL_BLOCK_M, out=out)
    if step.decode_tokens is not None:
        attended = _decode(step, pool, slot, q[step.decode_tokens].float(), scale, split_cap, split_min_keys)
        out[step.decode_tokens] = attended.to(q.dtype)
    return out


def decode_maxnreg(key_bits: int, value_bits: int) -> int | None:
    """The register cap the engine gives ptxas for the KVarN decode kernel: 255 (none to speak of) where a
    plane is 5-bit, else no directive. Without a .maxnreg directive ptxas (CUDA 12.8, sm_90, 2 warps) holds
    the engine's k5v5 variant to 128 registers and issues its value loads some 170 instructions into the
    tile loop; with one it takes 168 and issues them at the top, as the one-basis variant that ran 194 µs a
    call at 16 x 8K (167 registers) does, where the engine's took 231 µs (docs/low_bit_kv.md). k4v2 and k4v4
    issue every load at the top without it."""
    return 255 if 5 in (key_bits, value_bits) else None


def _decode(step: KVarNStep, pool, slot: int, query: torch.Tensor, scale: float, split_cap: int,
            split_min_keys: int) -> torch.Tensor:
    """The decode rows' attention (query fp32 [R, heads, D], unrotated): the unrotated output, fp32."""
    fmt, rotation, query = pool.fmt, pool.rotation, query.contiguous()
    # 2 warps: 170.1 against 226.0 µs at 16 x 8K for k4v2 on an H200 (kvarn_kernels-mma-2026-12-03-1d0806f,
    # its lane rows), 231.3 against 303.6 for k5v5 (kvarn_kernels-k5v5-2026-12-03-74b4895)
    num_warps = 2
    return kvarn_decode(rotate_rows(query, rotation), pool.key_codes[slot], pool.value_codes[slot],
                        pool.key_scales[slot], pool.value_scales[slot], pool.side_keys[slot],
                        pool.side_values[slot], step.block_tables, step.decode_side_tables, step.context_lens,
                        fmt.key_bits, fmt.value_bits, pool.sink, pool.tail, scale, split_cap, split_min_keys,
                        step.max_context_len, num_warps=num_warps, q=query, rotation=rotation,
                        maxnreg=decode_maxnreg(fmt.key_bits, fmt.value_bits))

