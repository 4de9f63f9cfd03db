"""Random paged-attention steps for backend tests: a KV pool with shuffled block tables padded with
wrong-but-valid block ids, q/k/v as views of one projection output (as the model makes them), and the
torch reference backend's answer."""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionBackend, AttentionMetadata, select


@dataclasses.dataclass
class PagedCase:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(query_lens: list[int], context_lens: list[int], *, dtype: torch.dtype = torch.float32,
              heads: int = 2, kv_heads: int = 2, head_dim: int = 64, block_size: int = 4, num_slots: int = 2,
              spare_blocks: int = 3, spare_columns: int = 2, device: str | torch.device = "cpu",
              seed: int = 0) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).int()
    # Past a row's blocks the table holds wrong block ids: a kernel that reads them gets wrong answers.
    tables = torch.randint(0, num_blocks, (len(blocks), max(blocks, default=0) + spare_columns), generator=g,
                           dtype=torch.int32)
    used = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = order[used:used + n]
        used += n
    cache_shape = (num_slots, num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=g).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g).to(dtype)
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    slot_mapping = [int(tables[row, p // block_size]) * block_size + p % block_size
                    for row, (n, c) in enumerate(zip(query_lens, context_lens)) for p in range(c - n, c)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens), context_lens_cpu=list(context_lens), block_size=block_size)
    return PagedCase(key_cache.to(device), value_cache.to(device), q, k, v, meta, head_dim ** -0.5)


def bound(name: str, case: PagedCase, requirements: dict[str, bool] | None = None) -> AttentionBackend:
    backend = select(name, case.key_cache.device, requirements)
    backend.bind(case.key_cache.clone(), case.value_cache.clone(), case.scale)
    return backend


def run(backend: AttentionBackend, case: PagedCase, slot: int = 1) -> torch.Tensor:
    backend.prepare(case.meta)
    return backend.forward(case.q, case.k, case.v, slot).clone()


def reference(case: PagedCase, slot: int = 1) -> tuple[torch.Tensor, AttentionBackend]:
    backend = bound("torch", case)
    return run(backend, case, slot), backend


# Max |triton - reference| per dtype, for outputs of O(1): one or two output ulps, plus P rounded to
# the input dtype before P @ V in prefill.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert not out.isnan().any()
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[out.dtype], f"max |triton - reference| = {err} > {TOLERANCE[out.dtype]}"
