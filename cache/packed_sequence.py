"""One sequence's K/V history in a low-bit format, in plain torch: the reference that a paged packed pool and
its kernels must match, usable as the model's attention callable (model/ouro.py: Attention) on any device.

Per (loop, layer) slot the history grows token by token. Under a KVarN format a tile of `group` tokens is
packed (cache/kvarn.py: rotation, variance normalization, codes packed into bit planes) as soon as its last
token is stored. Attention then reads a position from its packed tile unless the side pool holds it in high
precision: the first `sink` positions, the newest `tail` positions (counted from the sequence's length after
the call's store) and the unfilled tile. Under fp8_e4m3 every position is read through fp8 with one scale per
(slot, kv head), taken from the first K/V the slot stores (the prompt). The dense formats read the history
as stored.
"""

from __future__ import annotations

import torch

from cache import kvarn
from cache.kv_format import KVFormat, check_tile_dims


class PackedSequence:
    def __init__(self, fmt: KVFormat, num_slots: int, num_heads: int, kv_heads: int, head_dim: int,
                 sink: int = 0, tail: int = 0, iterations: int = 8, rotate: bool = True) -> None:
        if fmt.kind == "kvarn":
            check_tile_dims(fmt.group, head_dim)
        self.fmt, self.sink, self.tail, self.iterations = fmt, sink, tail, iterations
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.rotation = kvarn.hadamard(head_dim) if rotate and fmt.kind == "kvarn" else None
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]  # high precision, per call
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]
        self.tiles: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_slots)]  # decoded
        self.fp8_scales: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots

    def length(self, slot: int) -> int:
        return sum(k.shape[0] for k in self.keys[slot])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """q [n, heads, D], k and v [n, kv_heads, D]: the n new tokens of this sequence, stored, then attended
        causally over the history. Returns [n, heads, D] in q's dtype."""
        start = self.length(slot)
        self.keys[slot].append(k.detach().float())
        self.values[slot].append(v.detach().float())
        keys, values = torch.cat(self.keys[slot]), torch.cat(self.values[slot])  # [L, kvh, D]
        length = keys.shape[0]
        if self.fmt.kind == "kvarn":
            self._pack_full_tiles(slot, keys, values)
            keys, values = self._read_kvarn(slot, keys, values, length)
        elif self.fmt.kind == "fp8":
            keys, values = self._read_fp8(slot, keys, values)
        group = self.num_heads // self.kv_heads
        keys = keys.repeat_interleave(group, 1)  # [L, heads, D]
        values = values.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * self.scale
        positions = torch.arange(length, device=q.device)
        causal = positions[None, :] <= (start + torch.arange(q.shape[0], device=q.device))[:, None]
        weights = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), -1)
        return torch.einsum("hnl,lhd->nhd", weights, values).to(q.dtype)

    def _pack_full_tiles(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Pack every tile that filled: codes into bit planes and fp16 scales, as a pool block keeps them;
        a packed tile is immutable, so it is decoded once, from its planes, for the reads that follow."""
        g, tiles = self.fmt.group, self.tiles[slot]
        while (len(tiles) + 1) * g <= keys.shape[0]:
            rows = slice(len(tiles) * g, (len(tiles) + 1) * g)
            k, v = keys[rows].transpose(0, 1), values[rows].transpose(0, 1)  # [kvh, G, D]
            if self.rotation is not None:
                k, v = k @ self.rotation, v @ self.rotation
            qk = kvarn.quantize_keys(k, self.fmt.key_bits, self.iterations)
            qv = kvarn.quantize_values(v, self.fmt.value_bits, self.iterations)
            k_planes = kvarn.pack_codes(qk.codes, self.fmt.key_bits)
            v_planes = kvarn.pack_codes(qv.codes, self.fmt.value_bits)
            qk.codes = kvarn.unpack_codes(k_planes, self.fmt.key_bits)
            qv.codes = kvarn.unpack_codes(v_planes, self.fmt.value_bits)
            k, v = kvarn.dequantize_keys(qk), kvarn.dequantize_values(qv)
            if self.rotation is not None:
                k, v = k @ self.rotation.T, v @ self.rotation.T
            tiles.append((k.transpose(0, 1), v.transpose(0, 1)))  # [G, kvh, D]

    def _read_kvarn(self, slot: int, keys: torch.Tensor, values: torch.Tensor,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The history as attention sees it: positions of packed tiles decoded, the side pool's rows (sink,
        tail, unfilled tile) in high precision."""
        out_k, out_v = keys.clone(), values.clone()
        g = self.fmt.group
        high = torch.zeros(length, dtype=torch.bool)
        high[:self.sink] = True
        high[max(0, length - max(self.tail, length % g)):] = True
        for index, (k, v) in enumerate(self.tiles[slot]):
            rows = slice(index * g, (index + 1) * g)
            packed = ~high[rows]
            out_k[rows][packed] = k[packed]
            out_v[rows][packed] = v[packed]
        return out_k, out_v

    def _read_fp8(self, slot: int, keys: torch.Tensor,
                  values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fp8_scales[slot] is None:  # one scale per kv head, from the first store (the prompt)
            self.fp8_scales[slot] = (kvarn.fp8_scale(keys, (0, 2)), kvarn.fp8_scale(values, (0, 2)))
        k_scale, v_scale = self.fp8_scales[slot]
        return (kvarn.fp8_dequantize(kvarn.fp8_quantize(keys, k_scale), k_scale),
                kvarn.fp8_dequantize(kvarn.fp8_quantize(values, v_scale), v_scale))
