"""The reference backend: gathers each row's pages and runs plain torch math. Runs on CPU and CUDA.

It is slow and obviously right; every other backend is tested against it.
"""

from __future__ import annotations

import torch

from attention.base import AttentionBackend, Capabilities, SharedKVMetadata, register


def store_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V into one slot's pages. key_cache: [num_blocks, block_size, kv_heads, D]."""
    key_cache.view(-1, *key_cache.shape[2:])[slot_mapping] = k
    value_cache.view(-1, *value_cache.shape[2:])[slot_mapping] = v


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One row's context from one slot's pages: [context_len, kv_heads, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:context_len]


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


@register
class TorchBackend(AttentionBackend):
    name = "torch"
    default_capabilities = Capabilities(kv_formats=("paged", "shared-last"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        meta = self.meta
        if meta.shared_kv is not None:
            return self._forward_shared(q, k, v, slot)
        key_cache, value_cache = self.key_cache[slot], self.value_cache[slot]
        store_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for row, (num_new, context_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            table = meta.block_tables[row]
            keys = gather_context(key_cache, table, context_len)
            values = gather_context(value_cache, table, context_len)
            out[start:start + num_new] = paged_attention_row(q[start:start + num_new], keys, values,
                                                             self.scale)
            start += num_new
        return out

    def _forward_shared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """kv_sharing="last" (attention/base.py SharedKVMetadata): a prompt row stores into and reads from
        plane `slot`; a generated row stores its one token in its generated page at this layer, and reads its
        prompt from plane `slot` and its generated tokens from their pages."""
        meta, shared = self.meta, self.meta.shared_kv
        key_cache, value_cache = self.key_cache[slot], self.value_cache[slot]
        key_flat = self.key_cache.view(-1, *self.key_cache.shape[3:])
        value_flat = self.value_cache.view(-1, *self.value_cache.shape[3:])
        out = torch.empty_like(q)
        start = 0
        for row, (num_new, context_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            new = slice(start, start + num_new)
            prompt_len = min(context_len, shared.prompt_lens_cpu[row])
            generated = generated_flat_index(shared, row, context_len - prompt_len, slot, key_cache.shape[0],
                                             key_cache.shape[1])
            if len(generated):  # a generated row: one new token, the last generated position
                assert num_new == 1, "a row with generated context computes one token"
                key_flat[generated[-1:]] = k[new]
                value_flat[generated[-1:]] = v[new]
            else:
                store_kv(key_cache, value_cache, k[new], v[new], meta.slot_mapping[new])
            table = meta.block_tables[row]
            keys = torch.cat([gather_context(key_cache, table, prompt_len), key_flat[generated]])
            values = torch.cat([gather_context(value_cache, table, prompt_len), value_flat[generated]])
            out[new] = paged_attention_row(q[new], keys, values, self.scale)
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
