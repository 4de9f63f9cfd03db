"""Adding a KV format or an attention backend is a file of its own and one entry in its registry
(docs/walkthrough.md, "Adding a KV format or an attention backend"). The walkthrough's two worked examples,
written here as their new files would be and registered as their registry lines would register them, serve
the engine with the tokens of the format and the backend they mirror; the options they do not take are
refused by name, and the registries name every format and backend they hold."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attention import registry
from attention.base import AttentionBackend, Capabilities
from attention.torch_backend import gather_context, store_kv
from cache.kv_format import KVFormat, PoolShape
from cache.kv_formats import FORMATS, parse_kv_cache_dtype
from cache.kv_pool import KVPool
from cache.side_rows import SideRows
from engine import Engine, SamplingParams

PROMPTS = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog"]


@dataclasses.dataclass(frozen=True)
class Float16Format(KVFormat):
    """K/V in float16 whatever the model's dtype."""

    def packed_token_bytes(self, kv_heads: int, head_dim: int) -> float:
        return 2 * kv_heads * head_dim * 2  # K and V, 2 bytes an element

    def make_pool(self, shape: PoolShape, num_blocks: int, side_rows: SideRows | None,
                  device: torch.device) -> KVPool:
        return KVPool(shape.slot_map, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim,
                      torch.float16, device)

    def bind(self, backend: AttentionBackend, pool: KVPool, scale: float) -> None:
        backend.bind(pool.key_cache, pool.value_cache, scale)


class SDPABackend(AttentionBackend):
    """Attention through torch's scaled_dot_product_attention, one row at a time."""

    name = "sdpa"
    default_capabilities = Capabilities(kv_cache_dtypes=(torch.float32, torch.float16, torch.bfloat16))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        meta, key_cache, value_cache = self.meta, self.key_cache[slot], self.value_cache[slot]
        store_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        out, start = torch.empty_like(q), 0
        for row, (new, context) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            table, group = meta.block_tables[row], q.shape[1] // k.shape[1]
            keys = gather_context(key_cache, table, context).repeat_interleave(group, 1)
            values = gather_context(value_cache, table, context).repeat_interleave(group, 1)
            causal = torch.ones(new, context, dtype=torch.bool, device=q.device).tril(context - new)
            rows = q[start:start + new].transpose(0, 1)  # [heads, new, D]
            out[start:start + new] = F.scaled_dot_product_attention(
                rows, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=causal, scale=self.scale
            ).transpose(0, 1)
            start += new
        return out


def greedy_tokens(checkpoint, **options) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with Engine(checkpoint, device="cpu", dtype="float32", verbose=False, **options) as engine:
        return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture
def with_float16_format(monkeypatch):
    monkeypatch.setitem(FORMATS, "fp16", Float16Format("fp16", 16, 16))  # its line in FORMATS


@pytest.fixture
def with_sdpa_backend(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # forgotten again after the test
    monkeypatch.setitem(registry.BUILTIN, "sdpa", (__name__, "SDPABackend"))  # its line in BUILTIN


def test_the_registries_name_every_format_and_backend():
    assert list(FORMATS) == ["auto", "bf16", "fp8_e4m3", "kvarn_k4v2_g64", "kvarn_k4v2_g128",
                             "kvarn_k4v4_g64", "kvarn_k4v4_g128", "kvarn_k5v5_g64"]
    assert all(parse_kv_cache_dtype(name) is fmt and fmt.name == name for name, fmt in FORMATS.items())
    assert set(registry.available()) <= set(registry.BUILTIN) and "torch" in registry.available()


def test_a_new_kv_format_serves_the_engine(tiny_checkpoint, with_float16_format):
    with Engine(tiny_checkpoint, device="cpu", kv_cache_dtype="fp16", verbose=False) as engine:
        assert engine.kv_pool.key_cache.dtype == torch.float16
    assert greedy_tokens(tiny_checkpoint, kv_cache_dtype="fp16") == greedy_tokens(tiny_checkpoint)


def test_a_new_kv_format_refuses_the_options_it_does_not_take(tiny_checkpoint, with_float16_format):
    with pytest.raises(ValueError, match="kv_sink_tokens=4 applies to the KVarN formats only, not "
                                         "kv_cache_dtype='fp16'"):
        Engine(tiny_checkpoint, device="cpu", kv_cache_dtype="fp16", kv_sink_tokens=4, verbose=False)


def test_a_new_attention_backend_serves_the_engine(tiny_checkpoint, with_sdpa_backend):
    assert "sdpa" in registry.available()
    assert greedy_tokens(tiny_checkpoint, attention="sdpa") == greedy_tokens(tiny_checkpoint)


def test_a_new_attention_backend_refuses_what_its_capabilities_lack(tiny_checkpoint, with_sdpa_backend):
    with pytest.raises(ValueError, match="kv_sharing='last' needs the 'shared-last' KV format, which "
                                         "attention='sdpa' does not provide"):
        Engine(tiny_checkpoint, device="cpu", attention="sdpa", kv_sharing="last", verbose=False)
    with pytest.raises(ValueError, match="kv_cache_dtype='kvarn_k4v2_g64' runs on attention='torch' or "
                                         "'triton', got attention='sdpa'"):
        Engine(tiny_checkpoint, device="cpu", attention="sdpa", kv_cache_dtype="kvarn_k4v2_g64",
               block_size=64, verbose=False)
