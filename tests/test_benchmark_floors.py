"""The byte floors the benchmarks hold decode steps against (benchmarks/common.py): the KV a full-depth step
reads per context token is one slot's K and V for every layer it applies, whatever the layout stores."""

from benchmarks.common import kv_bytes_read_per_token, weight_bytes_per_step
from engine import Engine
from tests.conftest import ROOT

HUGINN = ROOT / "model" / "checkpoints" / "tiny-huginn"


def test_the_full_layout_reads_what_it_stores_per_token(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", verbose=False, num_kv_blocks=8, max_model_len=128) as engine:
        assert kv_bytes_read_per_token(engine) == engine.kv_pool.bytes_per_token


def test_a_ring_reads_a_whole_slot_for_every_layer_a_step_applies():
    with Engine(HUGINN, device="cpu", verbose=False, num_kv_blocks=8, max_model_len=128, loops=8,
                kv_layout="compress:4") as ring:
        slots = ring.kv_pool.slot_map
        applied = slots.prelude_layers + 8 * slots.loop_layers + slots.coda_layers
        assert slots.num_slots < applied
        assert kv_bytes_read_per_token(ring) == ring.kv_pool.slot_token_bytes * applied
        with Engine(HUGINN, device="cpu", verbose=False, num_kv_blocks=8, max_model_len=128, loops=8) as full:
            assert kv_bytes_read_per_token(ring) == full.kv_pool.bytes_per_token
            assert weight_bytes_per_step(ring) == weight_bytes_per_step(full)
