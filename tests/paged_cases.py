"""Random paged-attention steps for backend tests: a KV pool with shuffled block tables padded with
wrong-but-valid block ids, q/k/v as views of one projection output (as the model makes them), and the
torch reference backend's answer."""

from __future__ import annotations

import dataclasses

import torch

from attention.base import AttentionBackend, AttentionMetadata
from attention.registry import select
from attention.torch_backend import gather_context, store_kv
from tests.numerics import FLOOR_ULPS, NOISE_FACTOR, unit_roundoff


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


def exact_attention(case: PagedCase, slot: int = 1, absolute_values: bool = False) -> torch.Tensor:
    """The answer every backend rounds: the reference's math in fp64, [N, heads, D]. absolute_values puts |v|
    for v, which gives sum_j p_j |v_j|: the scale of the error that rounding P before P @ V makes."""
    def widen(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        return x.abs() if absolute_values else x

    meta = case.meta
    key_cache, value_cache = case.key_cache[slot].double(), widen(case.value_cache[slot])
    store_kv(key_cache, value_cache, case.k.double(), widen(case.v), meta.slot_mapping)
    q = case.q.double()
    out = torch.empty_like(q)
    for row, (num_new, context_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        start = meta.query_starts_cpu[row]
        keys = gather_context(key_cache, meta.block_tables[row], context_len)
        values = gather_context(value_cache, meta.block_tables[row], context_len)
        group = q.shape[1] // keys.shape[1]
        qh = q[start:start + num_new].transpose(0, 1)
        kh, vh = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (keys, values))
        scores = (qh @ kh.transpose(1, 2)) * case.scale
        key_pos = torch.arange(context_len, device=q.device)[None, :]
        query_pos = torch.arange(context_len - num_new, context_len, device=q.device)[:, None]
        weights = scores.masked_fill(key_pos > query_pos, float("-inf")).softmax(-1)
        out[start:start + num_new] = (weights @ vh).transpose(0, 1)
    return out


def attention_bound(case: PagedCase, expected: torch.Tensor, slot: int = 1) -> torch.Tensor:
    """Per element, how far a backend may be from the exact answer (tests/numerics.py): NOISE_FACTOR x the
    torch reference's own largest error (fp32 arithmetic, then one rounding to the input dtype), plus u x
    sum_j p_j |v_j| where the prefill kernels round P to the input dtype before P @ V (u: the dtype's unit
    roundoff, doubled for bf16 under the interpreter, whose fp32 -> bf16 cast truncates), plus on CUDA the
    relative error of the hardware exp2 (ex2.approx.f32: under 2^-22) on every weight."""
    exact = exact_attention(case, slot)
    spread = exact_attention(case, slot, absolute_values=True)
    dtype = expected.dtype
    u = unit_roundoff(dtype) * (2 if dtype == torch.bfloat16 and expected.device.type == "cpu" else 1)
    exp2 = 2.0**-22 if expected.device.type == "cuda" else 0.0
    oracle = (expected.double() - exact).abs().max().item()
    return NOISE_FACTOR * oracle + (u + 2 * exp2) * spread + FLOOR_ULPS * torch.finfo(dtype).eps * exact.abs()


# The GPU tests, which run against the reference only (no case at hand): max |triton - reference| per dtype
# for outputs of O(1), one or two output ulps plus P rounded to the input dtype before P @ V in prefill.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_matches(out: torch.Tensor, expected: torch.Tensor, case: PagedCase | None = None,
                   slot: int = 1) -> None:
    """out within attention_bound of the exact answer when the case is given, else within TOLERANCE of
    the reference's `expected`."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert not out.isnan().any()
    if case is not None:
        excess = (out.double() - exact_attention(case, slot)).abs() - attention_bound(case, expected, slot)
        assert excess.max().item() <= 0, f"{out.dtype}: {excess.max().item():.3g} past the derived bound"
        return
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[out.dtype], f"max |triton - reference| = {err} > {TOLERANCE[out.dtype]}"
