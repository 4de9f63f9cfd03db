"""One sequence's K/V history in a low-bit format, in plain torch: the reference that a paged packed pool and
its kernels must match, usable as the model's attention callable (model/ouro.py: Attention) on any device.

Per (loop, layer) slot the history grows token by token. Under a KVarN format a tile of `group` tokens is
packed (cache/kvarn.py: rotation, variance normalization, codes packed into bit planes) as soon as its last
token is stored. Attention then reads a position from its packed tile unless the side pool holds it in high
precision: the first `sink` positions, the newest `tail` positions (counted from the sequence's length after
the call's store) and the unfilled tile. Under fp8_e4m3 every position is read through fp8 (attention/fp8.py)
with one scale per (slot, kv head): `fp8_scale` for every one (the engine's default, 1.0), or with
fp8_scale=None the scale that maps the first K/V the slot stores (the prompt) onto fp8's range. The dense
formats read the history as stored.
"""

from __future__ import annotations

import torch

from attention import fp8
from cache import kvarn
from cache.kv_format import KVFormat, check_tile_dims


class PackedSequence:
    def __init__(self, fmt: KVFormat, num_slots: int, num_heads: int, kv_heads: int, head_dim: int,
                 sink: int = 0, tail: int = 0, iterations: int = 8, rotate: bool = True,
                 capacity: int = 1024, device: torch.device | str = "cpu", fp8_scale: float | None = 1.0,
                 ) -> None:
        """The history is kept in fp32 on `device`, up to `capacity` tokens per slot."""
        if fmt.kind == "kvarn":
            check_tile_dims(fmt.group, head_dim)
        self.fmt, self.sink, self.tail, self.iterations = fmt, sink, tail, iterations
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.rotation = kvarn.hadamard(head_dim, device=device) if rotate and fmt.kind == "kvarn" else None
        shape = (num_slots, capacity, kv_heads, head_dim)
        zeros = [torch.zeros(shape, device=device) for _ in range(4)]
        self.keys, self.values = zeros[0], zeros[1]  # as stored, high precision
        self.read_keys, self.read_values = zeros[2], zeros[3]  # as attention reads them
        self.lengths = [0] * num_slots
        self.decoded: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_slots)]
        self.converted = [0] * num_slots  # positions below this (from `sink` on) read their decoded tile
        fixed = None if fp8_scale is None else (torch.tensor(float(fp8_scale)),) * 2
        self.fp8_scales: list[tuple[torch.Tensor, torch.Tensor] | None] = [fixed] * num_slots

    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """q [n, heads, D], k and v [n, kv_heads, D]: the n new tokens of this sequence, stored, then attended
        causally over the history. Returns [n, heads, D] in q's dtype."""
        start, n = self.lengths[slot], q.shape[0]
        length = start + n
        if length > self.keys.shape[1]:
            raise ValueError(f"PackedSequence holds {self.keys.shape[1]} tokens (its capacity); {length} "
                             "asked")
        self.keys[slot, start:length], self.values[slot, start:length] = k.float(), v.float()
        self.lengths[slot] = length
        self._update_reads(slot, start, length)
        keys, values = self.read_keys[slot, :length], self.read_values[slot, :length]
        group = self.num_heads // self.kv_heads
        keys = keys.repeat_interleave(group, 1)  # [L, heads, D]
        values = values.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * self.scale
        positions = torch.arange(length, device=q.device)
        causal = positions[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        weights = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), -1)
        return torch.einsum("hnl,lhd->nhd", weights, values).to(q.dtype)

    def _update_reads(self, slot: int, start: int, length: int) -> None:
        fmt = self.fmt
        if fmt.kind == "fp8":
            if self.fp8_scales[slot] is None:  # one scale per kv head, from the first store (the prompt)
                self.fp8_scales[slot] = (kvarn.fp8_scale(self.keys[slot, :length], (0, 2))[0],
                                         kvarn.fp8_scale(self.values[slot, :length], (0, 2))[0])
            k_scale, v_scale = self.fp8_scales[slot]
            for stored, read, scale in ((self.keys, self.read_keys, k_scale),
                                        (self.values, self.read_values, v_scale)):
                read[slot, start:length] = fp8.dequantize(fp8.quantize(stored[slot, start:length], scale),
                                                          scale)
            return
        # As stored: every position of a dense format, the side pool's rows of a KVarN one.
        self.read_keys[slot, start:length] = self.keys[slot, start:length]
        self.read_values[slot, start:length] = self.values[slot, start:length]
        if fmt.kind == "kvarn":
            self._pack_full_tiles(slot, length)
            # Positions from `sink` up to the high-precision tail, in packed tiles, read their decoded rows.
            g = fmt.group
            boundary = min(len(self.decoded[slot]) * g, length - max(self.tail, length % g))
            first = max(self.sink, self.converted[slot])
            for position in range(first, boundary):
                k, v = self.decoded[slot][position // g]
                self.read_keys[slot, position] = k[position % g]
                self.read_values[slot, position] = v[position % g]
            self.converted[slot] = max(self.converted[slot], boundary)

    def _pack_full_tiles(self, slot: int, length: int) -> None:
        """Pack every tile that filled (kvarn.roundtrip: codes in bit planes and fp16 scales, as a pool block
        keeps them); a packed tile is immutable, so it is decoded once, for the reads that follow."""
        fmt, g, tiles = self.fmt, self.fmt.group, self.decoded[slot]
        while (len(tiles) + 1) * g <= length:
            rows = slice(len(tiles) * g, (len(tiles) + 1) * g)
            k = kvarn.roundtrip(self.keys[slot, rows].transpose(0, 1), fmt.key_bits, True, self.rotation,
                                self.iterations)  # [kvh, G, D]
            v = kvarn.roundtrip(self.values[slot, rows].transpose(0, 1), fmt.value_bits, False,
                                self.rotation, self.iterations)
            tiles.append((k.transpose(0, 1), v.transpose(0, 1)))  # [G, kvh, D]
