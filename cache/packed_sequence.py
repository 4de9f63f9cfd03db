"""One sequence's K/V history in a low-bit format, in plain torch: the reference that a paged packed pool and
its kernels must match, usable as the model's attention callable (model/looped.py: Attention) on any device.

Per (loop, layer) slot the history grows token by token. Under a KVarN format a tile of `group` tokens is
packed (cache/kvarn.py: rotation, variance normalization, codes packed into bit planes) as soon as its last
token is stored. A query at position i then reads position p from its packed tile unless p is high precision
for it (`high_precision`): among the first `sink` positions, the `tail` newest of the query's own causal
history (i + 1 positions), or in its unfilled tile. The rule depends on the positions only, so a prompt read
in one call or in chunks reads the same bytes. Under fp8_e4m3 every position is read through fp8
(attention/fp8.py) with one scale per (slot, kv head): `fp8_scale` for every one (the engine's default,
1.0), or with fp8_scale=None the scale that maps the first K/V the slot stores (the prompt) onto fp8's range.
The dense formats read the history as stored.

Under kv_sharing="last" (prompt_len given; docs/looped_controls.md) a generated position keeps one K/V per
layer, the last loop's, which every loop of later tokens reads; at loop t a generated token reads its own
loop-t K/V. Generated tiles start at the prompt's end, and the prompt's last tile, short when the prompt
ends inside it, is packed once the prompt is stored (attention/packed_attention.py: high_precision). The tile
a generated token completes is packed at each of its loops, from that loop's row and the others' last.
With batch_invariant it runs Engine(deterministic=True)'s math, and a KVarN pool's tokens and logprobs equal
its own bit for bit.
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
                 prompt_len: int | None = None, num_layers: int = 1, batch_invariant: bool = False) -> None:
        """The history is kept in fp32 on `device`, up to `capacity` tokens per slot. prompt_len: under
        kv_sharing="last", the prompt's length (stored in one or more calls before the first generated
        token); slot = loop * num_layers + layer. batch_invariant: the math of Engine(deterministic=True)'s
        torch backend (attention in fixed key tiles, the tiles' rotation row by row), which gives a paged
        KVarN pool's bits exactly."""
        if fmt.kind == "kvarn":
            check_tile_dims(fmt.group, head_dim)
        self.fmt, self.sink, self.tail, self.iterations = fmt, sink, tail, iterations
        self.prompt_len, self.num_layers = prompt_len, num_layers
        self.batch_invariant = batch_invariant
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.rotation = kvarn.hadamard(head_dim, device=device) if rotate and fmt.kind == "kvarn" else None
        shape = (num_slots, capacity, kv_heads, head_dim)
        zeros = [torch.zeros(shape, device=device) for _ in range(4)]
        self.keys, self.values = zeros[0], zeros[1]  # as stored, high precision
        # As attention reads them: every position under dense and fp8 formats; under KVarN the decoded rows of
        # each packed tile, read where a position is not high precision for the query
        self.read_keys, self.read_values = zeros[2], zeros[3]
        # kv_sharing="last": generated positions per layer, as stored and as read
        layer_shape = (num_layers if prompt_len is not None else 0, capacity, kv_heads, head_dim)
        self.generated = [torch.zeros(layer_shape, device=device) for _ in range(4)]
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
        if self.prompt_len is not None and length > self.prompt_len:
            return self._generated(q, k, v, slot)
        self.keys[slot, start:length], self.values[slot, start:length] = k.float(), v.float()
        self.lengths[slot] = length
        positions = torch.arange(length, device=q.device)
        read = (self.read_keys[slot, :length], self.read_values[slot, :length])
        if self.fmt.kind == "kvarn":
            self._pack_full_tiles(slot, length)
            hp = high_precision(positions[start:], positions, self.fmt.group, self.sink, self.tail,
                                self.prompt_len)
            exact = (self.keys[slot, :length], self.values[slot, :length])
            return attend_two_ways(q, exact, read, start, hp, self.scale, self.batch_invariant).to(q.dtype)
        self._update_reads(slot, start, length)
        every = torch.ones(n, length, dtype=torch.bool, device=q.device)
        return attend_two_ways(q, read, read, start, every, self.scale, self.batch_invariant).to(q.dtype)

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
        keeps them), and under kv_sharing="last" the prompt's last tile once the prompt is stored, short or
        not; a packed tile is immutable, so it is decoded once, into the rows that attention reads where a
        position is not high precision."""
        fmt, g = self.fmt, self.fmt.group
        end = -(-length // g) * g if length == self.prompt_len else length
        while (self.packed_tiles[slot] + 1) * g <= end:
            rows = slice(self.packed_tiles[slot] * g, min((self.packed_tiles[slot] + 1) * g, length))
            for stored, read, bits, keys in ((self.keys, self.read_keys, fmt.key_bits, True),
                                             (self.values, self.read_values, fmt.value_bits, False)):
                tile = kvarn.roundtrip(stored[slot, rows].transpose(0, 1), bits, keys, self.rotation,
                                       self.iterations, self.batch_invariant)  # [kvh, G, D]
                read[slot, rows] = tile.transpose(0, 1)
            self.packed_tiles[slot] += 1

    def _generated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """kv_sharing="last": one generated token, stored at its layer (over the loop before), attended over
        the prompt as this slot keeps it and the generated positions as their layer keeps them."""
        start, prompt_len = self.lengths[slot], self.prompt_len
        if q.shape[0] != 1 or start < prompt_len:
            raise ValueError(f"under kv_sharing='last' a call past the prompt ({prompt_len} tokens) stores "
                             f"one generated token; got {q.shape[0]} tokens from position {start}")
        layer, index = slot % self.num_layers, start - prompt_len
        stored_k, stored_v, read_k, read_v = self.generated
        stored_k[layer, index], stored_v[layer, index] = k[0].float(), v[0].float()
        self.lengths[slot] = length = start + 1
        count = index + 1
        exact = (torch.cat([self.keys[slot, :prompt_len], stored_k[layer, :count]]),
                 torch.cat([self.values[slot, :prompt_len], stored_v[layer, :count]]))
        if self.fmt.kind != "kvarn":
            self._update_generated_reads(layer, index, slot)
            read = (torch.cat([self.read_keys[slot, :prompt_len], read_k[layer, :count]]),
                    torch.cat([self.read_values[slot, :prompt_len], read_v[layer, :count]]))
            every = torch.ones(1, length, dtype=torch.bool, device=q.device)
            return attend_two_ways(q, read, read, start, every, self.scale, self.batch_invariant).to(q.dtype)
        g = self.fmt.group
        if count % g == 0:  # this token completes its tile: packed with its own loop's row
            rows = slice(count - g, count)
            for stored, read, bits, keys in ((stored_k, read_k, self.fmt.key_bits, True),
                                             (stored_v, read_v, self.fmt.value_bits, False)):
                tile = kvarn.roundtrip(stored[layer, rows].transpose(0, 1), bits, keys, self.rotation,
                                       self.iterations, self.batch_invariant)
                read[layer, rows] = tile.transpose(0, 1)
        read = (torch.cat([self.read_keys[slot, :prompt_len], read_k[layer, :count]]),
                torch.cat([self.read_values[slot, :prompt_len], read_v[layer, :count]]))
        positions = torch.arange(length, device=q.device)
        hp = high_precision(positions[start:], positions, g, self.sink, self.tail, prompt_len)
        return attend_two_ways(q, exact, read, start, hp, self.scale, self.batch_invariant).to(q.dtype)

    def _update_generated_reads(self, layer: int, index: int, slot: int) -> None:
        """The dense and fp8 formats: generated position `index` of `layer` as attention reads it (fp8
        through this slot's scales, the same in every loop of a layer under kv_sharing="last")."""
        stored_k, stored_v, read_k, read_v = self.generated
        if self.fmt.kind == "fp8":
            k_scale, v_scale = self.fp8_scales[slot]
            read_k[layer, index] = fp8.dequantize(fp8.quantize(stored_k[layer, index], k_scale), k_scale)
            read_v[layer, index] = fp8.dequantize(fp8.quantize(stored_v[layer, index], v_scale), v_scale)
            return
        read_k[layer, index], read_v[layer, index] = stored_k[layer, index], stored_v[layer, index]
