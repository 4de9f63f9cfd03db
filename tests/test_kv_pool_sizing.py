"""How big the KV pool is (cache/pool_sizing.py: PoolSizer): on CPU from max_model_len, max_num_seqs and the
memory available; on CUDA by vLLM's rule, which its own check before allocating agrees with (the CUDA memory
calls stood in for); kv_cache_gib or num_kv_blocks when given. A pool smaller than max_model_len warns, and a
sequence that fills it says so (finish_reason "length", stop_reason "kv_pool_full")."""

import types
import warnings

import pytest
import torch

from cache import pool_sizing
from cache.pool_sizing import CPU_KV_BYTES, CPU_KV_MEMORY_FRACTION
from engine import Engine, SamplingParams
from scheduler.scheduler import KV_POOL_FULL


def blocks(checkpoint, **options) -> int:
    with Engine(checkpoint, device="cpu", verbose=False, **options) as engine:
        return engine.block_manager.num_blocks


def block_bytes(checkpoint) -> int:
    with Engine(checkpoint, device="cpu", verbose=False, num_kv_blocks=1, max_model_len=16) as engine:
        return engine.kv_pool.bytes_per_block


def test_cpu_pool_holds_max_num_seqs_sequences_of_max_model_len_when_memory_allows(tiny_checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it holds max_model_len: no warning
        assert blocks(tiny_checkpoint, max_model_len=64, max_num_seqs=4) == 4 * 64 // 16


def test_cpu_pool_stops_at_the_floor_when_many_sequences_would_fit(tiny_checkpoint, monkeypatch):
    """max_num_seqs x max_model_len is more than CPU_KV_BYTES, one sequence is less: the floor decides."""
    monkeypatch.setattr(pool_sizing, "available_memory_bytes", lambda: 2**40)
    per_block = block_bytes(tiny_checkpoint)
    assert 256 * 4096 // 16 * per_block > CPU_KV_BYTES > 4096 // 16 * per_block
    assert blocks(tiny_checkpoint, max_model_len=4096, max_num_seqs=256) == CPU_KV_BYTES // per_block


def test_cpu_pool_is_capped_by_available_memory_and_warns_below_max_model_len(tiny_checkpoint, monkeypatch):
    per_block = block_bytes(tiny_checkpoint)
    monkeypatch.setattr(pool_sizing, "available_memory_bytes", lambda: 20 * per_block)
    expected = int(CPU_KV_MEMORY_FRACTION * 20)  # blocks of the capped budget, the scratch block aside
    with pytest.warns(UserWarning, match=f"holds {expected * 16} tokens, less than max_model_len 4096"):
        assert blocks(tiny_checkpoint) == expected


def test_cuda_pool_sized_beside_cached_blocks_passes_its_own_check(monkeypatch):
    """On CUDA the budget is vLLM's rule, in which every byte this process's allocator reserves is its own
    (what else is used belongs to others), so blocks it caches unused (tensors freed in a notebook before an
    Engine) are in the budget: the check before allocating counts them as available too, as the allocator
    hands them out first. (80 GiB card, 10 free; 30 reserved, 5 of them allocated; an 8 GiB peak.)"""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 8 * gib)
    sizer = pool_sizing.PoolSizer(None, None, torch.device("cuda"), None, None, 0.9, 4096)
    probe = types.SimpleNamespace(bytes_per_block=gib // 64)
    blocks = sizer.blocks_for_memory(probe, 0, profile=lambda: None)
    assert blocks == int(0.9 * 80 - 8 - (80 - 10 - 30)) * 64 - 1  # the scratch block aside
    assert pool_sizing.device_memory_available(torch.device("cuda")) == (10 + 25) * gib
    sizer.check_fits(probe, blocks + 1, 0, "loops or block_size")  # raised before cached blocks counted


def test_kv_cache_gib_sizes_the_pool(tiny_checkpoint):
    per_block = block_bytes(tiny_checkpoint)
    gib = 10.5 * per_block / 2**30
    assert blocks(tiny_checkpoint, kv_cache_gib=gib, max_model_len=64) == 10 - 1  # the scratch block


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "1", True])
def test_bad_kv_cache_gib_is_named(tiny_checkpoint, value):
    with pytest.raises(ValueError, match="kv_cache_gib"):
        Engine(tiny_checkpoint, device="cpu", verbose=False, kv_cache_gib=value)


def test_kv_cache_gib_and_num_kv_blocks_are_exclusive(tiny_checkpoint):
    with pytest.raises(ValueError, match="num_kv_blocks or kv_cache_gib, not both"):
        Engine(tiny_checkpoint, device="cpu", verbose=False, kv_cache_gib=1.0, num_kv_blocks=4)


def test_a_sequence_that_fills_the_pool_ends_with_length_and_says_the_pool_was_full(tiny_checkpoint):
    with pytest.warns(UserWarning, match="holds 32 tokens"):
        engine = Engine(tiny_checkpoint, device="cpu", verbose=False, num_kv_blocks=2)
    with engine:
        full, short = engine.generate(["hello there", "hello"], [
            SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)], use_tqdm=False)
        assert engine.block_manager.num_free_blocks == 2
    completion = full.outputs[0]
    assert completion.finish_reason == "length" and completion.stop_reason == KV_POOL_FULL
    assert len(full.prompt_token_ids) + len(completion.token_ids) == 32
    assert (short.outputs[0].finish_reason, short.outputs[0].stop_reason) == ("length", None)
