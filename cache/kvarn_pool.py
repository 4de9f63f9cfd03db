"""The KVarN paged pool (kv_cache_dtype="kvarn_*"): per (loop, layer) slot, a packed tile per
(block, kv head) at the block's id, and side blocks of high-precision rows. The reference path, in plain
torch (cache/kvarn.py's codec), which the torch attention backend stores and reads through; and, for the
Triton backend's decode rows, `write_side_rows` and `pack_side_blocks` (the Triton pack kernel).

    key_codes    uint8 [T*L, blocks, kv_heads, G, D * key_bits / 8]    (cache/kvarn.py: encode_tiles)
    value_codes  uint8 [T*L, blocks, kv_heads, G, D * value_bits / 8]
    key_scales   fp16  [T*L, blocks, kv_heads, 2 D + G]
    value_scales fp16  [T*L, blocks, kv_heads, D + 2 G]
    side_keys, side_values  [T*L, side blocks, G, kv_heads, D]  the model's dtype, as the model made them

Block size = G, the tile. A block is packed when its last position is stored, from its side rows and the
call's new K/V. Which positions a query reads in high precision is attention/packed_attention.py's rule; which
side block holds a block's rows, and for how long, is cache/side_rows.py's (each row of a step carries its
request's side table: block index -> side block, -1 where it has none to read).
"""

from __future__ import annotations

import torch

from cache import kvarn
from cache.kv_format import KVFormat, check_tile_dims


class KVarNPool:
    def __init__(self, fmt: KVFormat, loops: int, num_layers: int, num_blocks: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, sink: int = 0, tail: int = 0,
                 side_blocks: int = 0, iterations: int = 8) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        check_tile_dims(fmt.group, head_dim)
        self.fmt, self.loops, self.num_layers = fmt, loops, num_layers
        self.num_blocks, self.block_size = num_blocks, fmt.group
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.sink, self.tail, self.iterations = sink, tail, iterations
        g, d, slots = fmt.group, head_dim, loops * num_layers
        # Unwritten records and rows are never read (a block is read packed once full and packed, a side row
        # once stored), so nothing is filled: pages become resident only as they are written.
        self.key_codes = torch.empty(slots, num_blocks, kv_heads, g, d * fmt.key_bits // 8, dtype=torch.uint8,
                                     device=device)
        self.value_codes = torch.empty(slots, num_blocks, kv_heads, g, d * fmt.value_bits // 8,
                                       dtype=torch.uint8, device=device)
        self.key_scales = torch.empty(slots, num_blocks, kv_heads, 2 * d + g, dtype=torch.float16,
                                      device=device)
        self.value_scales = torch.empty(slots, num_blocks, kv_heads, d + 2 * g, dtype=torch.float16,
                                        device=device)
        self.side_keys = torch.empty(slots, side_blocks, g, kv_heads, d, dtype=dtype, device=device)
        self.side_values = torch.empty_like(self.side_keys)
        self.rotation = kvarn.hadamard(d, device=device)
        self.slot_token_bytes = fmt.packed_token_bytes(kv_heads, d)

    @property
    def num_slots(self) -> int:
        return self.loops * self.num_layers

    @property
    def bytes_per_block(self) -> int:
        return self.num_slots * self.kv_heads * self.fmt.tile_bytes(self.head_dim)

    @property
    def bytes_per_token(self) -> float:
        return self.num_slots * self.slot_token_bytes

    @property
    def side_bytes(self) -> int:
        return 2 * self.side_keys.numel() * self.side_keys.element_size()

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.side_bytes

    def side_bytes_for(self, side_blocks: int) -> int:
        """The bytes of `side_blocks` side blocks (what a pool of this shape would allocate)."""
        per_block = 2 * self.num_slots * self.block_size * self.kv_heads * self.head_dim
        return side_blocks * per_block * self.side_keys.element_size()

    def pack_filled(self, slot: int, side_table: list[int], table: torch.Tensor, start: int, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Pack every block that the call's new tokens (positions start.., k and v [n, kv_heads, D]) fill: its
        rows before `start` from its side block, the rest from k, v."""
        g, end = self.block_size, start + k.shape[0]
        for index in range(start // g, end // g):
            first = index * g
            rows_k, rows_v = [], []
            if first < start:
                side = side_table[index]
                assert side >= 0, f"block {index} is filling but has no side block"
                rows_k.append(self.side_keys[slot, side, :start - first])
                rows_v.append(self.side_values[slot, side, :start - first])
            new = slice(max(first, start) - start, first + g - start)
            rows_k.append(k[new])
            rows_v.append(v[new])
            block = int(table[index])
            for rows, codes, scales, bits, keys in (
                    (rows_k, self.key_codes, self.key_scales, self.fmt.key_bits, True),
                    (rows_v, self.value_codes, self.value_scales, self.fmt.value_bits, False)):
                tile = torch.cat(rows).to(self.side_keys.dtype).transpose(0, 1)  # [kv_heads, G, D]
                codes[slot, block], scales[slot, block] = kvarn.encode_tiles(tile, bits, keys, self.rotation,
                                                                             self.iterations)

    def read(self, slot: int, side_table: list[int], table: torch.Tensor, start: int, k: torch.Tensor,
             v: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """A row's history of start + n positions read two ways, [L, kv_heads, D] fp32 each: as stored (the
        side rows before `start`, zero where a block has none to read, then k, v) and through the packed tiles
        (zero past the last full tile). Call after pack_filled and before write_side."""
        g, length = self.block_size, start + k.shape[0]
        shape = (length, self.kv_heads, self.head_dim)
        exact_k, exact_v = torch.zeros(shape, device=k.device), torch.zeros(shape, device=k.device)
        for index in range(-(-start // g)):
            side = side_table[index]
            if side >= 0:
                rows = slice(index * g, min(start, (index + 1) * g))
                exact_k[rows] = self.side_keys[slot, side, :rows.stop - rows.start].float()
                exact_v[rows] = self.side_values[slot, side, :rows.stop - rows.start].float()
        exact_k[start:] = k.to(self.side_keys.dtype).float()
        exact_v[start:] = v.to(self.side_keys.dtype).float()
        packed_k, packed_v = torch.zeros(shape, device=k.device), torch.zeros(shape, device=k.device)
        full = length // g
        if full:
            blocks = table[:full].long()
            for codes, scales, bits, keys, out in (
                    (self.key_codes, self.key_scales, self.fmt.key_bits, True, packed_k),
                    (self.value_codes, self.value_scales, self.fmt.value_bits, False, packed_v)):
                tiles = kvarn.decode_tiles(codes[slot, blocks], scales[slot, blocks], bits, keys,
                                           self.rotation)  # [full, kv_heads, G, D]
                out[:full * g] = tiles.transpose(1, 2).flatten(0, 1)
        return (exact_k, exact_v), (packed_k, packed_v)

    # -- the Triton path (attention/triton_backend.py): one call per slot for a step's decode rows --------

    def write_side_rows(self, slot: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, kv_heads, D] into side rows `rows` (int64 [n], side block * G + offset)."""
        for side, new in ((self.side_keys[slot], k), (self.side_values[slot], v)):
            side.view(-1, self.kv_heads, self.head_dim).index_copy_(0, rows, new.to(side.dtype))

    def pack_side_blocks(self, slot: int, rows: torch.Tensor, blocks: torch.Tensor) -> None:
        """Pack tiles of side rows into pool blocks: tile f is side rows rows[f] (int64 [F, G], side block * G
        + offset, a whole side block in order), block blocks[f] (int32 [F]; a negative one: skipped). The pack
        kernel rotates the rows itself, as the codec does, so nothing rotated is materialized."""
        shape = (-1, self.kv_heads, self.head_dim)
        side_k, side_v = self.side_keys[slot].view(shape), self.side_values[slot].view(shape)
        self.pack_rows(slot, side_k, side_v, rows, blocks, rotated=False)

    def pack_rows(self, slot: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor,
                  rotated: bool = True) -> None:
        """Pack tiles of rows (k, v [n, kv_heads, D]; tile f is rows[f], int64 [F, G]) into pool blocks
        `blocks` (int32 [F]) with the Triton pack kernel (cache/kvarn_pack_kernel.py): rows rotated already,
        or (rotated=False) rotated by the kernel."""
        from cache.kvarn_pack_kernel import pack_tiles  # triton: only this path needs it

        pack_tiles(k, v, rows, blocks, self.key_codes[slot], self.value_codes[slot], self.key_scales[slot],
                   self.value_scales[slot], self.fmt.key_bits, self.fmt.value_bits, self.iterations,
                   rotation=None if rotated else self.rotation)

    def write_side(self, slot: int, side_table: list[int], start: int, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """Keep the new tokens' rows in their blocks' side blocks, where they have one."""
        g, end = self.block_size, start + k.shape[0]
        for index in range(start // g, -(-end // g)):
            side = side_table[index]
            if side >= 0:
                first, last = max(start, index * g), min(end, (index + 1) * g)
                rows, new = slice(first - index * g, last - index * g), slice(first - start, last - start)
                self.side_keys[slot, side, rows] = k[new]
                self.side_values[slot, side, rows] = v[new]
