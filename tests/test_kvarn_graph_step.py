"""A KVarN decode step as a CUDA graph captures it (attention/triton_kvarn.py: prepare_kvarn_graph_step): the
plan made on the device from the metadata tensors stores, packs and attends exactly as the eager plan made on
the host; and the pack kernel's two features that plan needs, rotating unrotated side rows itself and
skipping tiles whose block is negative. Under the Triton interpreter on CPU (conftest), at small tiles."""

import math

import pytest
import torch

from attention.base import AttentionMetadata, side_table_tensor
from attention.triton_kvarn import kvarn_forward, prepare_kvarn_graph_step, prepare_kvarn_step
from cache import kvarn
from cache.kvarn_format import KVarNFormat
from cache.kvarn_pack_kernel import pack_tiles, rotate
from cache.kvarn_pool import KVarNPool
from model.looped import SlotMap

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMT = KVarNFormat("kvarn_k4v2_g16", 4, 2, 16)  # a 16-token tile, to stay small
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def pool_tensors(num_blocks: int, fmt: KVarNFormat = FMT, kv_heads: int = KV_HEADS,
                 head_dim: int = HEAD_DIM) -> list[torch.Tensor]:
    g, d = fmt.group, head_dim
    return [torch.randint(0, 256, (num_blocks, kv_heads, g, d * fmt.key_bits // 8), dtype=torch.uint8),
            torch.randint(0, 256, (num_blocks, kv_heads, g, d * fmt.value_bits // 8), dtype=torch.uint8),
            torch.full((num_blocks, kv_heads, 2 * d + g), float("nan"), dtype=torch.float16),
            torch.full((num_blocks, kv_heads, d + 2 * g), float("nan"), dtype=torch.float16)]


def check_rotating_pack(fmt: KVarNFormat, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Unrotated rows with rotation=H pack as well as the same rows rotated by the caller: each tile decodes
    to the rotated rows with about the same error. Not bit for bit: the two rotations sum in different
    orders, and on the H200 at Ouro's shape a third of the scales came out up to 1.6% apart (likely the
    Sinkhorn normalization's pick of its best-balanced iterate, which a last-bit difference can flip). A tile
    whose block is -1 writes nothing."""
    g = torch.Generator().manual_seed(0)
    shape = (3 * fmt.group, kv_heads, head_dim)
    src_k = (torch.randn(shape, generator=g) * torch.exp(torch.randn(head_dim, generator=g))).to(dtype)
    src_v = torch.randn(shape, generator=g).to(dtype)
    rows = torch.arange(3 * fmt.group).view(3, fmt.group)
    blocks = torch.tensor([2, -1, 0], dtype=torch.int32)
    untouched = pool_tensors(3, fmt, kv_heads, head_dim)
    by_caller, by_kernel = ([t.clone().to(DEVICE) for t in untouched] for _ in range(2))
    args = (rows.to(DEVICE), blocks.to(DEVICE))
    bits = (fmt.key_bits, fmt.value_bits)
    rotated = [rotate(src.to(DEVICE)) for src in (src_k, src_v)]
    pack_tiles(*rotated, *args, *by_caller, *bits)
    pack_tiles(src_k.to(DEVICE), src_v.to(DEVICE), *args, *by_kernel, *bits,
               rotation=kvarn.hadamard(head_dim, device=DEVICE))
    for got, before in zip(by_kernel, untouched):
        got = got[1].cpu()
        assert got.isnan().all() if got.is_floating_point() else torch.equal(got, before[1]), \
            "the skipped tile's block was written"
    for tile, block in ((0, 2), (2, 0)):
        for keys, (codes, scales), exact in ((True, (0, 2), rotated[0]), (False, (1, 3), rotated[1])):
            want = exact[rows[tile]].transpose(0, 1).float()  # [kv_heads, G, D], rotated
            error = []
            for pool in (by_caller, by_kernel):
                bits = fmt.key_bits if keys else fmt.value_bits
                decoded = kvarn.decode_tiles(kvarn.row_codes(pool[codes][block], bits), pool[scales][block],
                                             bits, keys, None)
                error.append(float((decoded - want).abs().mean()))
            assert error[1] <= 1.05 * error[0] + 1e-6, (keys, error)


def test_pack_rotates_in_the_kernel_and_skips_negative_blocks():
    check_rotating_pack(FMT, KV_HEADS, HEAD_DIM, torch.float32)


@pytest.mark.gpu
def test_pack_rotates_in_the_kernel_at_ouro_shape():
    """Ouro-1.4B's attention shape (16 kv heads, head_dim 128) in a 64-token tile, bf16 rows: the fp32 dot
    of a [64, 128] tile by the [128, 128] rotation compiles and agrees."""
    check_rotating_pack(KVarNFormat("kvarn_k4v2_g64", 4, 2, 64), 16, 128, torch.bfloat16)


def decode_step(pool: KVarNPool, lengths: list[int], width: int) -> tuple[AttentionMetadata, list]:
    """Rows of context `lengths` after this step's token, every tile with a block and a side block (both
    shuffled), the full tiles before the newest packed from random side rows. Block tables are `width`
    wide (a graph's are as wide as the longest context they can hold)."""
    g = FMT.group
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(pool.num_blocks, generator=gen).tolist()
    sides = torch.randperm(pool.side_keys.shape[1], generator=gen).tolist()
    tables, side_tables = [], []
    for length in lengths:
        tiles = math.ceil(length / g)
        tables.append([blocks.pop() for _ in range(tiles)])
        side_tables.append([sides.pop() for _ in range(tiles)])
    pool.side_keys.copy_(torch.randn(pool.side_keys.shape, generator=gen))
    pool.side_values.copy_(torch.randn(pool.side_values.shape, generator=gen))
    done = [(side, block) for length, table, side_table in zip(lengths, tables, side_tables)
            for side, block in list(zip(side_table, table))[:(length - 1) // g]]
    rows = torch.tensor([list(range(side * g, (side + 1) * g)) for side, _ in done], dtype=torch.int64)
    done_blocks = torch.tensor([block for _, block in done], dtype=torch.int32)
    pool.pack_side_blocks(0, rows.to(DEVICE), done_blocks.to(DEVICE))
    block_tables = torch.full((len(lengths), width), 0, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    n = len(lengths)
    meta = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32).to(DEVICE),
                             torch.tensor(lengths, dtype=torch.int32).to(DEVICE), block_tables.to(DEVICE),
                             torch.zeros(n, dtype=torch.int64).to(DEVICE), [1] * n, lengths, g,
                             side_tables_cpu=side_tables,
                             side_tables=side_table_tensor(side_tables, width).to(DEVICE))
    return meta, tables


def test_a_captured_decode_plan_stores_packs_and_attends_as_the_eager_plan():
    """Rows whose token completes a tile (16, 48: packed in the step), rows inside one (37, 5), with sink and
    tail rows; the device plan (block tables wider than any row, as a graph's) against the host plan, on two
    copies of one pool: the same pool bits after the step and the same output bits."""
    lengths, sink, tail = [16, 37, 48, 5], 4, 20
    pools = [KVarNPool(FMT, SlotMap(1, 1), 12, KV_HEADS, HEAD_DIM, torch.float32, torch.device(DEVICE), sink,
                       tail, 12) for _ in range(2)]
    for pool in pools:  # the same bits in both before the step (the pool's tensors start uninitialized)
        for tensor in (pool.key_codes, pool.value_codes, pool.key_scales, pool.value_scales):
            tensor.zero_()
    metas = [decode_step(pool, lengths, width)[0] for pool, width in zip(pools, (3, 6))]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(len(lengths), n, HEAD_DIM, generator=gen).to(DEVICE)
               for n in (HEADS, KV_HEADS, KV_HEADS))
    eager = prepare_kvarn_step(metas[0], FMT.group, lambda t: t.to(DEVICE))
    graph = prepare_kvarn_graph_step(metas[1], FMT.group)
    assert eager.every_row_decodes and graph.every_row_decodes
    assert eager.side_packed[0].shape[0] == 2 and int((graph.side_packed[1] >= 0).sum()) == 2
    outs = [kvarn_forward(step, meta, pool, 0, q, k, v, HEAD_DIM ** -0.5, 4, FMT.group)
            for step, meta, pool in ((eager, metas[0], pools[0]), (graph, metas[1], pools[1]))]
    assert torch.equal(outs[0], outs[1])
    for name in ("key_codes", "value_codes", "key_scales", "value_scales", "side_keys", "side_values"):
        a, b = getattr(pools[0], name), getattr(pools[1], name)
        assert torch.equal(a, b), name
