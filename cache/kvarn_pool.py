"""The KVarN paged pool (kv_cache_dtype="kvarn_*"): per slot (model/looped.py: SlotMap), a packed tile per
(block, kv head) at the block's id, and side blocks of high-precision rows. The reference path, in plain
torch (cache/kvarn.py's codec), which the torch attention backend stores and reads through; and, for the
Triton backend's decode rows, `write_side_rows` and `pack_side_blocks` (the Triton pack kernel).

    key_codes    uint8 [slots, blocks, kv_heads, G, D * key_bits / 8]    (cache/kvarn.py: record_codes)
    value_codes  uint8 [slots, blocks, kv_heads, G, D * value_bits / 8]
    key_scales   fp16  [slots, blocks, kv_heads, 2 D + G]
    value_scales fp16  [slots, blocks, kv_heads, D + 2 G]
    side_keys, side_values  [slots, side blocks, G, kv_heads, D]  the model's dtype, as the model made them
    generated_side_keys, generated_side_values  [L, side tiles, G, kv_heads, D]  (kv_sharing="last")

Block size = G, the tile. A block is packed when its last position is stored, from its side rows and the
call's new K/V. Which positions a query reads in high precision is attention/packed_attention.py's rule; which
side block holds a block's rows, and for how long, is cache/side_rows.py's (each row of a step carries its
request's side table: block index -> side block, -1 where it has none to read).

Under kv_sharing="last" a generated page (cache/layout.py) holds T generated tiles per layer: generated tile j
of a layer is the record at plane (j % T) * L + layer of page generated_block_table[j // T]. Its rows, while
high precision, sit in a side tile of one layer's rows (a request's generated side table: tile -> side tile).
"""

from __future__ import annotations

import torch

from cache import kvarn
from cache.kv_format import KVFormat, check_tile_dims
from model.looped import SlotMap


class KVarNPool:
    def __init__(self, fmt: KVFormat, slot_map: SlotMap, num_blocks: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, sink: int = 0, tail: int = 0,
                 side_blocks: int = 0, iterations: int = 8, generated_side_tiles: int = 0,
                 rotate: bool = True, batch_invariant: bool = False) -> None:
        """batch_invariant (Engine(deterministic=True)): the tiles' rotation products row by row
        (kvarn.rotate), so a tile's decoded rows never depend on how many tiles a read decodes."""
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        check_tile_dims(fmt.group, head_dim)
        self.fmt, self.slot_map = fmt, slot_map
        # kv_sharing="last" (a slot map of loops only): a generated page's T groups of L planes
        self.loops, self.num_layers = slot_map.loops, slot_map.loop_layers
        self.num_blocks, self.block_size = num_blocks, fmt.group
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.sink, self.tail, self.iterations = sink, tail, iterations
        self.batch_invariant = batch_invariant
        g, d, slots = fmt.group, head_dim, slot_map.num_slots
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
        self.generated_side_keys = torch.empty(self.num_layers, generated_side_tiles, g, kv_heads, d,
                                               dtype=dtype, device=device)
        self.generated_side_values = torch.empty_like(self.generated_side_keys)
        # The tiles' Hadamard rotation (None: tiles are normalized as stored; the Triton kernels need it)
        self.rotation = kvarn.hadamard(d, device=device) if rotate else None
        self.slot_token_bytes = fmt.packed_token_bytes(kv_heads, d)

    @property
    def num_slots(self) -> int:
        return self.slot_map.num_slots

    @property
    def bytes_per_block(self) -> int:
        return self.num_slots * self.kv_heads * self.fmt.tile_bytes(self.head_dim)

    @property
    def bytes_per_token(self) -> float:
        return self.num_slots * self.slot_token_bytes

    @property
    def side_bytes(self) -> int:
        return self.side_bytes_for(self.side_keys.shape[1], self.generated_side_keys.shape[1])

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.side_bytes

    def side_bytes_for(self, side_blocks: int, generated_side_tiles: int = 0) -> int:
        """The bytes of `side_blocks` side blocks (num_slots planes of G rows each) and `generated_side_tiles`
        generated side tiles (L planes each): what a pool of this shape would allocate."""
        row = 2 * self.kv_heads * self.head_dim * self.side_keys.element_size()  # one token's K + V
        planes = side_blocks * self.num_slots + generated_side_tiles * self.num_layers
        return planes * self.block_size * row

    def pack_filled(self, slot: int, side_table: list[int], table: torch.Tensor, start: int, k: torch.Tensor,
                    v: torch.Tensor, prompt_len: int | None = None) -> None:
        """Pack every block that the call's new tokens (positions start.., k and v [n, kv_heads, D]) fill: its
        rows before `start` from its side block, the rest from k, v. prompt_len (kv_sharing="last"): a call
        that completes the prompt also packs its last tile, short when the prompt ends inside it."""
        g, end = self.block_size, start + k.shape[0]
        for index in range(start // g, -(-end // g) if end == prompt_len else end // g):
            first = index * g
            rows_k, rows_v = [], []
            if first < start:
                side = side_table[index]
                assert side >= 0, f"block {index} is filling but has no side block"
                rows_k.append(self.side_keys[slot, side, :start - first])
                rows_v.append(self.side_values[slot, side, :start - first])
            new = slice(max(first, start) - start, min(first + g, end) - start)
            rows_k.append(k[new])
            rows_v.append(v[new])
            self._pack(slot, int(table[index]), torch.cat(rows_k), torch.cat(rows_v))

    def _pack(self, plane: int, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One tile of rows (k, v [r, kv_heads, D], r <= G) into the record at (plane, block). A short tile
        (the prompt's last, under kv_sharing="last") is quantized over its r rows alone; its codes and
        per-token scales take the places of a full tile's first r rows (kvarn.record_codes)."""
        for rows, codes, scales, bits, keys in (
                (k, self.key_codes, self.key_scales, self.fmt.key_bits, True),
                (v, self.value_codes, self.value_scales, self.fmt.value_bits, False)):
            tile = rows.to(self.side_keys.dtype).transpose(0, 1)  # [kv_heads, r, D]
            tile_codes, tile_scales = kvarn.encode_tiles(tile, bits, keys, self.rotation, self.iterations,
                                                         self.batch_invariant)
            codes[plane, block] = kvarn.record_codes(tile_codes, bits, self.block_size)
            scales[plane, block, :, self._scale_columns(keys, tile.shape[1])] = tile_scales

    def _scale_columns(self, keys: bool, rows: int) -> list[int]:
        """The columns of a record's scale row that a tile of `rows` rows fills (encode_tiles' order): keys
        channel scale, zero, token scales; values channel scale, token scales, token zeros."""
        d, g = self.head_dim, self.block_size
        return list(range(2 * d + rows)) if keys else [*range(d + rows), *range(d + g, d + g + rows)]

    def read(self, slot: int, side_table: list[int], table: torch.Tensor, start: int, k: torch.Tensor,
             v: torch.Tensor, prompt_len: int | None = None
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """A row's history of start + n positions read two ways, [L, kv_heads, D] fp32 each: as stored (the
        side rows before `start`, zero where a block has none to read, then k, v) and through the packed tiles
        (zero past the last full tile; a whole prompt of prompt_len tokens, under kv_sharing="last", reads its
        short last tile too). Call after pack_filled and before write_side."""
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
        tiles = -(-length // g) if length == prompt_len else length // g
        planes = torch.full((tiles,), slot, dtype=torch.long, device=k.device)
        return (exact_k, exact_v), self._decode(planes, table[:tiles].long(), length)

    def _decode(self, planes: torch.Tensor, blocks: torch.Tensor,
                length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [length, kv_heads, D] fp32 of the records at (planes[i], blocks[i]), tile i at
        positions i * G.., zero past the last; the last may be short (it ends at `length`)."""
        g, shape = self.block_size, (length, self.kv_heads, self.head_dim)
        out_k = torch.zeros(shape, device=planes.device)
        out_v = torch.zeros(shape, device=planes.device)
        full = min(len(planes), length // g)
        for codes, scales, bits, keys, out in (
                (self.key_codes, self.key_scales, self.fmt.key_bits, True, out_k),
                (self.value_codes, self.value_scales, self.fmt.value_bits, False, out_v)):
            if full:
                records = (planes[:full], blocks[:full])
                tiles = kvarn.decode_tiles(kvarn.row_codes(codes[records], bits), scales[records], bits,
                                           keys, self.rotation,
                                           self.batch_invariant)  # [full, kv_heads, G, D]
                out[:full * g] = tiles.transpose(1, 2).flatten(0, 1)
            if len(planes) > full:  # a short last tile
                rows, record = length - full * g, (int(planes[full]), int(blocks[full]))
                columns = self._scale_columns(keys, rows)
                tile = kvarn.decode_tiles(kvarn.row_codes(codes[record], bits)[:, :rows],
                                          scales[record][:, columns], bits, keys, self.rotation,
                                          self.batch_invariant)  # [kv_heads, rows, D]
                out[full * g:] = tile.transpose(0, 1)
        return out_k, out_v

    # -- kv_sharing="last": a generated row's one new token, generated tile j at plane (j % T) * L + layer of
    # page pages[j // T], its rows in side tile side_table[j] while it has one

    def generated_tiles(self, layer: int, pages: torch.Tensor,
                        count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(planes, pages) of the first `count` generated tiles of `layer`, int64 each."""
        tiles = torch.arange(count, device=pages.device)
        return tiles % self.loops * self.num_layers + layer, pages[tiles // self.loops].long()

    def pack_generated(self, layer: int, side_table: list[int], pages: torch.Tensor, index: int,
                       k: torch.Tensor, v: torch.Tensor) -> None:
        """Generated token `index` (k, v [1, kv_heads, D]): pack its tile if it completes it, the other rows
        from the tile's side tile."""
        g = self.block_size
        if (index + 1) % g:
            return
        tile = index // g
        side = side_table[tile]
        assert side >= 0, f"generated tile {tile} is filling but has no side tile"
        self._pack(tile % self.loops * self.num_layers + layer, int(pages[tile // self.loops]),
                   torch.cat([self.generated_side_keys[layer, side, :g - 1], k]),
                   torch.cat([self.generated_side_values[layer, side, :g - 1], v]))

    def read_generated(self, layer: int, side_table: list[int], pages: torch.Tensor, index: int,
                       k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Generated positions 0..index read two ways, as `read` reads a prompt: as stored (side tiles, zero
        where a tile has none to read, then the new token's k, v) and through the packed tiles. Call after
        pack_generated and before write_generated_side."""
        g, length = self.block_size, index + 1
        shape = (length, self.kv_heads, self.head_dim)
        exact_k, exact_v = torch.zeros(shape, device=k.device), torch.zeros(shape, device=k.device)
        for tile in range(-(-index // g)):
            side = side_table[tile]
            if side >= 0:
                rows = slice(tile * g, min(index, (tile + 1) * g))
                exact_k[rows] = self.generated_side_keys[layer, side, :rows.stop - rows.start].float()
                exact_v[rows] = self.generated_side_values[layer, side, :rows.stop - rows.start].float()
        exact_k[index:] = k.to(self.side_keys.dtype).float()
        exact_v[index:] = v.to(self.side_keys.dtype).float()
        return (exact_k, exact_v), self._decode(*self.generated_tiles(layer, pages, length // g), length)

    def write_generated_side(self, layer: int, side_table: list[int], index: int, k: torch.Tensor,
                             v: torch.Tensor) -> None:
        """Keep generated token `index`'s row in its tile's side tile (each loop overwrites the last)."""
        g = self.block_size
        side = side_table[index // g]
        assert side >= 0, f"generated token {index} has no side tile"
        self.generated_side_keys[layer, side, index % g] = k[0]
        self.generated_side_values[layer, side, index % g] = v[0]

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
