"""Attention in fixed key tiles, so that a query's output has the same bits whatever else the call holds: the
other queries of its row, how its prompt was chunked, and whether it is a prompt token or a generated one.
The torch backend's path for batch-invariant instances (Engine(deterministic=True)), plain torch in fp32.

Every product is a matrix-vector product of one fixed shape, which MKL computes the same way at any batch
count (model/batch_invariant.py says what torch's CPU ops allow): a query's scores against a tile of KEY_TILE
keys, [1, D] x [D, KEY_TILE], and a tile's weighted values, [1, KEY_TILE] x [KEY_TILE, D + 1], whose extra
column of ones sums the weights. Tiles start at position 0, so a key always sits at the same place in its
tile. The softmax's max is exact in any order; the tiles' sums are added in position order, and a tile the
query may not see adds exact zeros. A query's output is then the same in a prefill chunk of any length and
when it is decoded alone.
"""

from __future__ import annotations

import torch

KEY_TILE = 64
# Bounds the keys a bmm call expands (heads x queries x padded keys x head_dim elements).
_EXPANDED_ELEMENTS = 1 << 22


def tile_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] . keys [L, H, D] -> [H, n, L] fp32 dot products, each tile of KEY_TILE keys by itself."""
    n, heads, dim = q.shape
    length = keys.shape[0]
    tiles = _tiles(keys.float())  # [H, T, KEY_TILE, D]
    count = tiles.shape[1]
    out = q.new_empty((heads, n, count * KEY_TILE), dtype=torch.float32)
    for start, stop in _query_chunks(n, heads * count * KEY_TILE * dim):
        rows = q[start:stop].float().transpose(0, 1)[:, :, None, :].expand(-1, -1, count, -1)  # [H, m, T, D]
        products = _row_products(rows.reshape(-1, dim), tiles[:, None].expand(-1, stop - start, -1, -1, -1))
        out[:, start:stop] = products.view(heads, stop - start, count * KEY_TILE)
    return out[..., :length]


def tile_weighted_sums(weights: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [H, n, L] (zero where a query may not look) and values [L, H, D] -> (sum_l w v [H, n, D],
    sum_l w [H, n, 1]), fp32: each tile of KEY_TILE keys by itself, the tiles added in position order."""
    heads, n, length = weights.shape
    dim = values.shape[-1]
    ones = values.new_ones(length, heads, 1, dtype=torch.float32)
    tiles = _tiles(torch.cat([values.float(), ones], -1)).transpose(2, 3)  # [H, T, D + 1, KEY_TILE]
    count = tiles.shape[1]
    padded = torch.nn.functional.pad(weights.float(), (0, count * KEY_TILE - length))
    total = weights.new_empty((heads, n, dim + 1), dtype=torch.float32)
    for start, stop in _query_chunks(n, heads * count * KEY_TILE * (dim + 1)):
        rows = padded[:, start:stop].reshape(-1, KEY_TILE)
        parts = _row_products(rows, tiles[:, None].expand(-1, stop - start, -1, -1, -1))
        parts = parts.view(heads, stop - start, count, dim + 1)
        acc = parts[:, :, 0]
        for tile in range(1, count):
            acc = acc + parts[:, :, tile]
        total[:, start:stop] = acc
    return total[..., :dim], total[..., dim:]


def _row_products(rows: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """rows [B, K] and matrices [..., N, K] (B of them) -> [B, N]: row b times matrix b transposed, one
    [1, K] x [K, N] product each, its operands always in the same memory layout (a contiguous row, and the
    matrix's transpose as a view, as linear() takes a weight): MKL's choice of kernel, and so the sum order,
    follows the layout too."""
    mats = matrices.reshape(-1, *matrices.shape[-2:]).contiguous()
    return torch.bmm(rows.contiguous()[:, None, :], mats.transpose(1, 2))[:, 0]


def causal_weights(scores: torch.Tensor, first_query: int) -> torch.Tensor:
    """exp(score - the row's max) over each query's visible keys (positions up to its own; queries at
    first_query ..), zero elsewhere: the softmax's numerators. scores [H, n, L]."""
    n, length = scores.shape[1:]
    positions = torch.arange(length, device=scores.device)[None, :]
    visible = positions <= first_query + torch.arange(n, device=scores.device)[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    return torch.exp(masked - masked.amax(-1, keepdim=True))


def tiled_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a row's new queries q [n, heads, D] (the last n of its L positions) over its
    context keys, values [L, kv_heads, D]; returns [n, heads, D] in q's dtype."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    weights = causal_weights(tile_scores(q, keys) * scale, keys.shape[0] - n)
    total, norm = tile_weighted_sums(weights, values)
    return (total / norm).transpose(0, 1).to(q.dtype)


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [H, T, KEY_TILE, D]: T tiles of KEY_TILE positions, zero past L."""
    length = x.shape[0]
    count = max(1, -(-length // KEY_TILE))
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, count * KEY_TILE - length))
    return padded.view(count, KEY_TILE, *x.shape[1:]).permute(2, 0, 1, 3).contiguous()


def _query_chunks(n: int, per_query: int) -> list[tuple[int, int]]:
    size = max(1, _EXPANDED_ELEMENTS // per_query)
    return [(start, min(n, start + size)) for start in range(0, n, size)]
