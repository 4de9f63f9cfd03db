"""The reference backend: gathers each row's pages and runs plain torch math. Runs on CPU and CUDA.

It is slow and obviously right; every other backend is tested against it. An fp8 pool is stored and read
through attention/fp8.py with the slot's scales. A KVarN pool (bind_packed) stores and reads through the
pool itself, and each query attends over its history read two ways (attention/packed_attention.py). A
batch_invariant instance (Engine(deterministic=True)) attends in fixed key tiles
(attention/tiled_reference.py), over a KVarN pool too.
"""

from __future__ import annotations

import dataclasses

import torch

from attention import fp8
from attention.base import AttentionBackend, Capabilities, SharedKVMetadata
from attention.packed_attention import attend_generated_row_through_pool, attend_row_through_pool
from attention.tiled_reference import tiled_attention


def encode(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """x [..., kv_heads, D] as `cache` stores it; scales [kv_heads] for an fp8 cache (else None)."""
    return fp8.quantize(x, scales[:, None]) if scales is not None else x.to(cache.dtype)


def decode(x: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Stored K/V [..., kv_heads, D] as attention reads it."""
    return fp8.dequantize(x, scales[:, None]) if scales is not None else x


def store_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """Write new tokens' K/V into one slot's pages. key_cache: [num_blocks, block_size, kv_heads, D];
    scales: the slot's [2, kv_heads] fp8 scales (None for other dtypes)."""
    key_scales, value_scales = (None, None) if scales is None else scales
    key_cache.view(-1, *key_cache.shape[2:])[slot_mapping] = encode(k, key_cache, key_scales)
    value_cache.view(-1, *value_cache.shape[2:])[slot_mapping] = encode(v, value_cache, value_scales)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """One row's context from one slot's pages, as attention reads it: [context_len, kv_heads, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    return decode(cache[block_table[:num_blocks].long()].flatten(0, 1)[:context_len], scales)


def paged_attention_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal attention of a row's new queries (the last len(q) positions) over its context, in fp32."""
    num_new, heads, _ = q.shape
    context_len, kv_heads, _ = keys.shape
    group = heads // kv_heads
    qf = q.float().transpose(0, 1)  # [H, n, D]
    kf = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    vf = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, n, ctx]
    query_pos = torch.arange(context_len - num_new, context_len, device=q.device)[:, None]
    key_pos = torch.arange(context_len, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [H, n, D]
    return out.transpose(0, 1).to(q.dtype)


class TorchBackend(AttentionBackend):
    name = "torch"
    default_capabilities = Capabilities(kv_formats=("paged", "shared-last"), kvarn=True)
    # batch_invariant: every query through attention/tiled_reference.py's fixed key tiles, which give a prompt
    # token what decoding it gives.
    optional_capabilities = frozenset({"batch_invariant"})

    def __init__(self, capabilities: Capabilities) -> None:
        if capabilities.batch_invariant:
            capabilities = dataclasses.replace(capabilities, prefill_matches_decode=True)
        super().__init__(capabilities)
        self.attend_row = tiled_attention if capabilities.batch_invariant else paged_attention_row

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        meta = self.meta
        if meta.slot_offsets is not None and self.packed_pool is not None:
            raise ValueError("rows at their own loops (depth batching) need a dense KV pool, not a KVarN "
                             "pool")
        if self.packed_pool is not None:
            return self._forward_kvarn(q, k, v, slot)
        if meta.shared_kv is not None:
            return self._forward_shared(q, k, v, slot)
        row_slots = meta.row_slots(slot)
        self._store(k, v, row_slots)
        out = torch.empty_like(q)
        start = 0
        for row, (num_new, context_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            row_slot = row_slots[row]
            scales = self._slot_scales(row_slot)
            key_scales, value_scales = (None, None) if scales is None else scales
            table = meta.block_tables[row]
            keys = gather_context(self.key_cache[row_slot], table, context_len, key_scales)
            values = gather_context(self.value_cache[row_slot], table, context_len, value_scales)
            out[start:start + num_new] = self.attend_row(q[start:start + num_new], keys, values, self.scale)
            start += num_new
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, row_slots: list[int]) -> None:
        """Every new token's K/V into its row's slot, all before any row attends (rows of one request, as a
        speculative verify's, see each other's)."""
        meta = self.meta
        if len(set(row_slots)) <= 1:
            slot = row_slots[0] if row_slots else 0
            store_kv(self.key_cache[slot], self.value_cache[slot], k, v, meta.slot_mapping,
                     self._slot_scales(slot))
            return
        starts = meta.query_starts_cpu
        for slot in sorted(set(row_slots)):
            tokens = [t for row, s in enumerate(row_slots) if s == slot
                      for t in range(starts[row], starts[row + 1])]
            index = torch.tensor(tokens, dtype=torch.int64, device=k.device)
            store_kv(self.key_cache[slot], self.value_cache[slot], k[index], v[index],
                     meta.slot_mapping[index], self._slot_scales(slot))

    def _forward_kvarn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """Per row: pack the blocks its new tokens fill, attend over its history read two ways, then keep
        the new rows that stay high precision (after the reads: a ring entry may pass to a newer block).
        Under kv_sharing="last" a generated row's token goes through its generated tiles instead."""
        meta, shared = self.meta, self.meta.shared_kv
        invariant = self.capabilities.batch_invariant
        out = torch.empty_like(q)
        starts = meta.query_starts_cpu
        for row, side_table in enumerate(meta.side_tables_cpu):
            new = slice(starts[row], starts[row + 1])
            first = meta.context_lens_cpu[row] - meta.query_lens_cpu[row]
            prompt = (side_table, meta.block_tables[row])
            prompt_len = shared.prompt_lens_cpu[row] if shared is not None else None
            if prompt_len is not None and first >= prompt_len:
                assert meta.query_lens_cpu[row] == 1, "a row with generated context computes one token"
                generated = (shared.generated_side_tables_cpu[row], shared.generated_block_tables[row])
                out[new] = attend_generated_row_through_pool(
                    self.packed_pool, slot, prompt, generated, prompt_len, first - prompt_len, q[new], k[new],
                    v[new], self.scale, invariant).to(q.dtype)
            else:
                out[new] = attend_row_through_pool(self.packed_pool, slot, *prompt, first, q[new], k[new],
                                                   v[new], self.scale, prompt_len, invariant).to(q.dtype)
        return out

    def bind_packed(self, pool, scale: float) -> None:
        """As the base class's; a batch_invariant instance needs a pool made batch_invariant (its tiles'
        rotation row by row), and the other way round, so that the two read a tile alike."""
        if pool.batch_invariant != self.capabilities.batch_invariant:
            raise ValueError(f"a KVarN pool made with batch_invariant={pool.batch_invariant} cannot serve a "
                             f"torch backend with batch_invariant={self.capabilities.batch_invariant}: make "
                             "both with Engine(deterministic=...)'s choice")
        super().bind_packed(pool, scale)

    def _slot_scales(self, slot: int) -> torch.Tensor | None:
        """The slot's [2, kv_heads] fp8 scales; None for a pool of another dtype."""
        return None if self.kv_scales is None else self.kv_scales[slot]

    def _forward_shared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """kv_sharing="last" (attention/base.py SharedKVMetadata): a prompt row stores into and reads from
        plane `slot`; a generated row stores its one token in its generated page at this layer, and reads its
        prompt from plane `slot` and its generated tokens from their pages. An fp8 pool's scales are the
        same in every loop of a layer here (KVPool.set_kv_scales), so the call's slot scales serve all."""
        meta, shared = self.meta, self.meta.shared_kv
        key_flat = self.key_cache.view(-1, *self.key_cache.shape[3:])
        value_flat = self.value_cache.view(-1, *self.value_cache.shape[3:])
        out = torch.empty_like(q)
        start = 0
        row_slots = meta.row_slots(slot)  # depth batching: each row's own loop, at the call's layer
        for row, (num_new, context_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            slot = row_slots[row]
            key_cache, value_cache = self.key_cache[slot], self.value_cache[slot]
            scales = self._slot_scales(slot)
            key_scales, value_scales = (None, None) if scales is None else scales
            new = slice(start, start + num_new)
            prompt_len = min(context_len, shared.prompt_lens_cpu[row])
            generated = generated_flat_index(shared, row, context_len - prompt_len, slot, key_cache.shape[0],
                                             key_cache.shape[1])
            if len(generated):  # a generated row: one new token, the last generated position
                assert num_new == 1, "a row with generated context computes one token"
                key_flat[generated[-1:]] = encode(k[new], key_flat, key_scales)
                value_flat[generated[-1:]] = encode(v[new], value_flat, value_scales)
            else:
                store_kv(key_cache, value_cache, k[new], v[new], meta.slot_mapping[new], scales)
            table = meta.block_tables[row]
            keys = torch.cat([gather_context(key_cache, table, prompt_len, key_scales),
                              decode(key_flat[generated], key_scales)])
            values = torch.cat([gather_context(value_cache, table, prompt_len, value_scales),
                                decode(value_flat[generated], value_scales)])
            out[new] = self.attend_row(q[new], keys, values, self.scale)
            start += num_new
        return out


def generated_flat_index(shared: SharedKVMetadata, row: int, count: int, slot: int, num_blocks: int,
                         block_size: int) -> torch.Tensor:
    """Flat indices, into the pool viewed as [-1, kv_heads, D], of row `row`'s first `count` generated tokens
    at the layer of `slot`."""
    page_tokens = shared.loops * block_size
    g = torch.arange(count, device=shared.generated_block_tables.device)
    pages = shared.generated_block_tables[row, g // page_tokens].long()
    planes = g % page_tokens // block_size * shared.num_layers + slot % shared.num_layers
    return (planes * num_blocks + pages) * block_size + g % block_size
