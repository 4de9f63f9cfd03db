"""One sequence's K/V history in a low-bit format, in plain torch: the reference that a paged packed pool and
its kernels must match, usable as the model's attention callable (model/ouro.py: Attention) on any device.

Per (loop, layer) slot the history grows token by token. Under a KVarN format a tile of `group` tokens is
packed (cache/kvarn.py: rotation, variance normalization, codes packed into bit planes) as soon as its last
token is stored. A query at position i then reads position p from its packed tile unless p is high precision
for it (`high_precision`): among the first `sink` positions, the `tail` newest of the query's own causal
history (i + 1 positions), or in its unfilled tile. The rule depends on the positions only, so a prompt read
in one call or in chunks reads the same bytes. Under fp8_e4m3 every position is read through fp8
(attention/fp8.py) with one scale per (slot, kv head): `fp8_scale` for every one (the engine's default,
1.0), or with fp8_scale=None the scale that maps the first K/V the slot stores (the prompt) onto fp8's range.
The dense formats read the history as stored.
"""

from __future__ import annotations

import torch

from attention import fp8
from attention.packed_attention import attend_two_ways, high_precision
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
        # As attention reads them: every position under dense and fp8 formats; under KVarN the decoded rows of
        # each packed tile, read where a position is not high precision for the query
        self.read_keys, self.read_values = zeros[2], zeros[3]
        self.lengths = [0] * num_slots
        self.packed_tiles = [0] * num_slots
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
        positions = torch.arange(length, device=q.device)
        read = (self.read_keys[slot, :length], self.read_values[slot, :length])
        if self.fmt.kind == "kvarn":
            self._pack_full_tiles(slot, length)
            hp = high_precision(positions[start:], positions, self.fmt.group, self.sink, self.tail)
            exact = (self.keys[slot, :length], self.values[slot, :length])
            return attend_two_ways(q, exact, read, start, hp, self.scale).to(q.dtype)
        self._update_reads(slot, start, length)
        every = torch.ones(n, length, dtype=torch.bool, device=q.device)
        return attend_two_ways(q, read, read, start, every, self.scale).to(q.dtype)

    def _update_reads(self, slot: int, start: int, length: int) -> None:
        """The dense and fp8 formats: positions start..length-1 as attention reads them."""
        if self.fmt.kind == "fp8":
            if self.fp8_scales[slot] is None:  # one scale per kv head, from the first store (the prompt)
                self.fp8_scales[slot] = (kvarn.fp8_scale(self.keys[slot, :length], (0, 2))[0],
                                         kvarn.fp8_scale(self.values[slot, :length], (0, 2))[0])
            k_scale, v_scale = self.fp8_scales[slot]
            for stored, read, scale in ((self.keys, self.read_keys, k_scale),
                                        (self.values, self.read_values, v_scale)):
                read[slot, start:length] = fp8.dequantize(fp8.quantize(stored[slot, start:length], scale),
                                                          scale)
            return
        self.read_keys[slot, start:length] = self.keys[slot, start:length]
        self.read_values[slot, start:length] = self.values[slot, start:length]

    def _pack_full_tiles(self, slot: int, length: int) -> None:
        """Pack every tile that filled (kvarn.roundtrip: codes in bit planes and fp16 scales, as a pool block
        keeps them); a packed tile is immutable, so it is decoded once, into the rows that attention reads
        where a position is not high precision."""
        fmt, g = self.fmt, self.fmt.group
        while (self.packed_tiles[slot] + 1) * g <= length:
            rows = slice(self.packed_tiles[slot] * g, (self.packed_tiles[slot] + 1) * g)
            for stored, read, bits, keys in ((self.keys, self.read_keys, fmt.key_bits, True),
                                             (self.values, self.read_values, fmt.value_bits, False)):
                tile = kvarn.roundtrip(stored[slot, rows].transpose(0, 1), bits, keys, self.rotation,
                                       self.iterations)  # [kvh, G, D]
                read[slot, rows] = tile.transpose(0, 1)
            self.packed_tiles[slot] += 1
