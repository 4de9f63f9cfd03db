"""Attention over a history that is read two ways: as stored where a position is high precision for the
query, else through its packed (low-bit) tile. The rule of which is which is KVarN's side pool
(docs/low_bit_kv.md), stated by position only, so a prompt read in one call or in chunks reads the same
values. Plain torch, fp32: the reference path (cache/packed_sequence.py, and the torch backend over a KVarN
pool, kv_sharing="last" included); with batch_invariant (Engine(deterministic=True)), in the fixed key
tiles of attention/tiled_reference.py.
"""

from __future__ import annotations

import torch

from attention.tiled_reference import causal_weights, tile_scores, tile_weighted_sums


def high_precision(query_positions: torch.Tensor, key_positions: torch.Tensor, group: int, sink: int,
                   tail: int, prompt_len: int | None = None) -> torch.Tensor:
    """[queries, keys] bool: does the query at position i read key position p in high precision? p < sink,
    p >= (i + 1) - tail (the newest `tail` of its i + 1 positions), or p's tile is not full within them.
    Tiles of `group` positions start at 0. Under kv_sharing="last" (prompt_len = P) the prompt's tiles start
    at 0 and the generated ones at P, and the prompt's last tile, short when P is not a multiple of `group`,
    is full once the prompt is (docs/low_bit_kv.md)."""
    length = query_positions[:, None] + 1
    p = key_positions[None, :]
    filled = length - length % group  # positions below it lie in full tiles
    if prompt_len is not None:
        prompt_filled = torch.where(length >= prompt_len, prompt_len, filled)
        filled = torch.where(p < prompt_len, prompt_filled, length - (length - prompt_len) % group)
    return (p < sink) | (p >= length - tail) | (p >= filled)


def attend_two_ways(q: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor],
                    packed: tuple[torch.Tensor, torch.Tensor], first_query: int, hp: torch.Tensor,
                    scale: float, batch_invariant: bool = False) -> torch.Tensor:
    """Causal attention of q [n, heads, D] (positions first_query..) over keys 0..L-1 read two ways: as stored
    (exact: keys, values [L, kv_heads, D]) where hp [n, L] says so, else through their packed tile. fp32.
    batch_invariant: through attention/tiled_reference.py's fixed key tiles, so that a query's output has the
    same bits in a prompt chunk of any length and decoded alone."""
    n, heads = q.shape[:2]
    group = heads // exact[0].shape[1]

    def expand(x: torch.Tensor) -> torch.Tensor:
        return x.float().repeat_interleave(group, 1)  # [L, heads, D]

    (k_exact, v_exact), (k_packed, v_packed) = (tuple(map(expand, pair)) for pair in (exact, packed))
    if batch_invariant:
        return _attend_two_ways_in_tiles(q, (k_exact, v_exact), (k_packed, v_packed), first_query, hp, scale)
    qf = q.float()
    scores = torch.where(hp[None], torch.einsum("nhd,lhd->hnl", qf, k_exact),
                         torch.einsum("nhd,lhd->hnl", qf, k_packed)) * scale
    length = k_exact.shape[0]
    causal = torch.arange(length, device=q.device)[None, :] <= (first_query + torch.arange(n, device=q.device)
                                                               )[:, None]
    weights = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), -1)
    return (torch.einsum("hnl,lhd->nhd", weights * hp[None], v_exact)
            + torch.einsum("hnl,lhd->nhd", weights * ~hp[None], v_packed))


def _attend_two_ways_in_tiles(q: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor],
                              packed: tuple[torch.Tensor, torch.Tensor], first_query: int, hp: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """attend_two_ways in fixed key tiles (keys and values [L, heads, D] fp32 here): each key's score read its
    hp way, the softmax's numerators as tiled_attention's, and the output the two reads' tiled weighted sums
    added, over the sum of their weights."""
    scores = torch.where(hp[None], tile_scores(q, exact[0]), tile_scores(q, packed[0])) * scale
    weights = causal_weights(scores, first_query)  # [H, n, L]
    exact_sum, exact_norm = tile_weighted_sums(weights * hp[None], exact[1])
    packed_sum, packed_norm = tile_weighted_sums(weights * ~hp[None], packed[1])
    return ((exact_sum + packed_sum) / (exact_norm + packed_norm)).transpose(0, 1)


def attend_row_through_pool(pool, slot: int, side_table: list[int], table: torch.Tensor, first: int,
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            prompt_len: int | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """One row of a step over a KVarN pool (cache/kvarn_pool.py), the reference way: pack the blocks its
    new tokens (positions first..) fill, attend over its history read two ways, then keep the new rows that
    stay high precision (after the reads: a ring entry may pass to a newer block). fp32 [n, heads, D].
    prompt_len: under kv_sharing="last", a prompt row's prompt length (its last tile, maybe short).
    batch_invariant: attend_two_ways in fixed key tiles; over a pool made batch_invariant too (its codec row
    by row), a query's output then has the same bits alone, in a batch and in a prompt chunk of any length."""
    pool.pack_filled(slot, side_table, table, first, k, v, prompt_len)
    exact, packed = pool.read(slot, side_table, table, first, k, v, prompt_len)
    positions = torch.arange(first + k.shape[0], device=q.device)
    hp = high_precision(positions[first:], positions, pool.block_size, pool.sink, pool.tail, prompt_len)
    out = attend_two_ways(q, exact, packed, first, hp, scale, batch_invariant)
    pool.write_side(slot, side_table, first, k, v)
    return out


def attend_generated_row_through_pool(pool, slot: int, prompt: tuple[list[int], torch.Tensor],
                                      generated: tuple[list[int], torch.Tensor], prompt_len: int, index: int,
                                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                      batch_invariant: bool = False) -> torch.Tensor:
    """kv_sharing="last": a generated row's one new token (generated token `index`, at position
    prompt_len + index) over a KVarN pool, the reference way. Its prompt is read from plane `slot` (prompt:
    its side table and block table), its generated tokens from their tiles at the slot's layer (generated:
    its generated side table and page table; cache/kvarn_pool.py). The tile it completes is packed first
    (with this loop's row), and its row is kept after the reads. fp32 [1, heads, D]. batch_invariant: as
    attend_row_through_pool's."""
    layer = pool.slot_map.physical_layer(slot)
    side_table, pages = generated
    pool.pack_generated(layer, side_table, pages, index, k, v)
    prompt_exact, prompt_packed = pool.read(slot, *prompt, prompt_len, k[:0], v[:0], prompt_len)
    generated_exact, generated_packed = pool.read_generated(layer, side_table, pages, index, k, v)
    exact = tuple(torch.cat(pair) for pair in zip(prompt_exact, generated_exact))
    packed = tuple(torch.cat(pair) for pair in zip(prompt_packed, generated_packed))
    positions = torch.arange(prompt_len + index + 1, device=q.device)
    hp = high_precision(positions[-1:], positions, pool.block_size, pool.sink, pool.tail, prompt_len)
    out = attend_two_ways(q, exact, packed, prompt_len + index, hp, scale, batch_invariant)
    pool.write_generated_side(layer, side_table, index, k, v)
    return out
