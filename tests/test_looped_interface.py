"""The looped-model interface (model/looped.py): Ouro's slot map is slot = t * L + layer with physical layer
`layer`; the KV pool and copy-forward address slots through a slot map, prelude and coda slots included; the
loop driver over the interface gives, bit for bit, what the loop each path used to write out gave; the
piecewise chain calls attention in the slot map's order; and nothing in runner/, cache/ or engine.py names
Ouro."""

import ast
import json

import pytest
import torch

from cache.copy_forward import copy_forward
from cache.kv_pool import KVPool
from cache.layout import SharedLastLayout
from engine import Engine
from model.config import OuroConfig
from model.huginn import HuginnConfig
from model.loader import load_model
from model.looped import SlotMap
from model.tiny import HUGINN_PRESETS, huginn_hf_config
from runner.loop_driver import EagerLoops, StepInputs, run_loops
from runner.piecewise_graphs import PiecewiseGraphs
from tests.conftest import ROOT
from tests.test_fused_model import coarse_gemm_tiles  # noqa: F401 (a fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def dense_causal_attention(q, k, v, slot):
    """Causal attention over the call's own tokens (no KV kept), GQA by repeating the kv heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    config = OuroConfig.from_file(tiny_checkpoint / "config.json")
    return load_model(tiny_checkpoint, config, torch.device("cpu"), torch.float32)


def test_ouro_slot_map_is_t_times_layers_plus_l_with_physical_layer_l(model):
    config = model.config
    loops, layers = config.total_ut_steps, config.num_hidden_layers
    slot_map = model.slot_map
    assert slot_map == SlotMap(loops, layers) and slot_map.loops_only
    assert slot_map.num_slots == config.num_slots == loops * layers
    assert [[slot_map.slot(t, layer) for layer in range(layers)] for t in range(loops)] == \
        [[t * layers + layer for layer in range(layers)] for t in range(loops)]
    assert [list(slot_map.loop_slots(t)) for t in range(loops)] == \
        [list(range(t * layers, (t + 1) * layers)) for t in range(loops)]
    assert [slot_map.physical_layer(s) for s in range(slot_map.num_slots)] == \
        [s % layers for s in range(loops * layers)]
    assert [list(slot_map.deeper_slots(1, layer)) for layer in range(layers)] == \
        [[t * layers + layer for t in range(2, loops)] for layer in range(layers)]
    assert list(slot_map.deeper_slots(loops - 1, 0)) == []


def test_a_slot_map_with_prelude_and_coda_numbers_slots_as_huginn_does():
    """Huginn-0125's map at 32 recurrences (docs/huginn.md §4): its config's own numbering, slot by slot."""
    config = HuginnConfig.from_dict(huginn_hf_config(HUGINN_PRESETS["huginn-0125"]))
    slot_map = SlotMap(32, config.n_layers_in_recurrent_block, config.n_layers_in_prelude,
                       config.n_layers_in_coda)
    assert slot_map.num_slots == config.num_slots(32) == 132 and not slot_map.loops_only
    assert [slot_map.slot(i, layer) for i in range(32) for layer in range(4)] == \
        [config.core_slot(i, layer) for i in range(32) for layer in range(4)]
    assert [slot_map.physical_layer(s) for s in range(132)] == \
        [config.physical_layer(s, 32) for s in range(132)]
    assert list(slot_map.deeper_slots(29, 3)) == [config.core_slot(30, 3), config.core_slot(31, 3)]
    with pytest.raises(ValueError, match="slot 132 is outside 0..131"):
        slot_map.physical_layer(132)


@pytest.mark.parametrize("field, value", [("loops", 0), ("loop_layers", 2.0), ("prelude_layers", -1),
                                          ("coda_layers", True)])
def test_a_bad_slot_map_is_refused_by_field(field, value):
    fields = {"loops": 2, "loop_layers": 3, field: value}
    with pytest.raises(ValueError, match=f"SlotMap {field} must be an integer"):
        SlotMap(**fields)


@pytest.mark.parametrize("use_triton", [False, True])
def test_copy_forward_writes_exactly_the_slot_maps_deeper_slots(use_triton):
    """A map with a prelude slot and two coda slots: a token that stopped after loop 0 leaves slot(0, l)'s
    K/V in deeper_slots(0, l), and every other slot, prelude and coda included, and every other token keep
    theirs. The Triton kernel runs in the interpreter on CPU."""
    slot_map = SlotMap(loops=3, loop_layers=2, prelude_layers=1, coda_layers=2)
    pool = KVPool(slot_map, num_blocks=3, block_size=4, kv_heads=2, head_dim=4, dtype=torch.float32,
                  device=torch.device(DEVICE))
    assert pool.key_cache.shape[0] == pool.num_slots == 9
    generator = torch.Generator().manual_seed(0)
    for cache in (pool.key_cache, pool.value_cache):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    before = pool.key_cache.clone().flatten(1, 2)
    tokens = torch.tensor([2, 7], device=DEVICE)
    copy_forward(pool.key_cache, pool.value_cache, slot_map, tokens, 0, use_triton=use_triton)
    after = pool.key_cache.flatten(1, 2)
    source = {s: slot_map.slot(0, layer) for layer in range(2) for s in slot_map.deeper_slots(0, layer)}
    assert sorted(source) == [3, 4, 5, 6]  # slots: prelude 0, loops 1-2, 3-4, 5-6, coda 7-8
    for slot in range(pool.num_slots):
        for token in range(after.shape[1]):
            copied = slot in source and token in tokens.tolist()
            assert torch.equal(after[slot, token], before[source[slot] if copied else slot, token])


def test_fp8_scales_must_agree_over_a_layers_loop_slots_only():
    """loop_uniform_scales: scales may differ between physical layers (a prelude slot's from the loops'),
    not between the loop slots of one layer."""
    slot_map = SlotMap(loops=2, loop_layers=2, prelude_layers=1)
    pool = KVPool(slot_map, 2, 4, 1, 8, torch.float8_e4m3fn, torch.device("cpu"), loop_uniform_scales=True)
    scales = torch.tensor([[9.0], [1.0], [2.0], [1.0], [2.0]])  # prelude, then loop 0 and loop 1's layers
    pool.set_kv_scales(scales, scales)
    with pytest.raises(ValueError, match="differ between the loops of a layer"):
        pool.set_kv_scales(torch.tensor([[9.0], [1.0], [2.0], [1.0], [3.0]]), scales)


def test_shared_last_layout_refuses_a_slot_map_with_prelude_or_coda_slots():
    with pytest.raises(ValueError, match="kv_sharing='last' needs .* 2 prelude and 1 coda slots"):
        SharedLastLayout(SlotMap(4, 2, prelude_layers=2, coda_layers=1), 16)


def written_out_loops(model, input_ids, positions, attention):
    """The loop over loops as OuroForCausalLM.forward, PiecewiseGraphs and the eager executor each wrote it
    before run_loops was the only one: embed, the RoPE tables, then run_loop and the gate per loop."""
    h = model.embed_tokens(input_ids)
    cos, sin = model.rotary(positions, h.dtype)
    hidden, gates = [], []
    for t in range(model.config.total_ut_steps):
        h = model.run_loop(h, cos, sin, attention, t)
        hidden.append(h)
        gates.append(model.gate_logits(h))
    return torch.stack(hidden), torch.stack(gates)


def test_run_loops_and_every_path_through_it_give_the_written_out_loops_bitwise(model):
    ids = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11)
    with torch.inference_mode():
        hidden, gates = written_out_loops(model, ids, positions, dense_causal_attention)
        inputs = StepInputs(ids, positions, None, None, [])
        driven = run_loops(EagerLoops(model, None, dense_causal_attention), model, inputs, range(4))
        piecewise = PiecewiseGraphs(model, None, 16, torch.device("cpu"))
        piecewise.input_ids[:11], piecewise.positions[:11] = ids, positions
        chained = piecewise.run_model(11, dense_causal_attention)
        composed = model(ids, positions, dense_causal_attention)
    assert torch.equal(driven.hidden, hidden) and torch.equal(driven.gate_logits, gates)
    assert torch.equal(chained.hidden, hidden)
    assert torch.equal(composed.hidden, hidden) and torch.equal(composed.gate_logits, gates)


def test_loops_split_across_two_driver_calls_give_the_written_out_loops_bitwise(model):
    """Loops 0..1, then 2..3 from loop 1's state (a draft and its verify), with the readout of two tokens."""
    ids, positions = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)
    readout = torch.tensor([2, 4])
    executor = EagerLoops(model, None, dense_causal_attention)
    with torch.inference_mode():
        hidden, _ = written_out_loops(model, ids, positions, dense_causal_attention)
        gates = torch.stack([model.gate_logits(h[readout]) for h in hidden])  # the readout rows' own
        draft = run_loops(executor, model, StepInputs(ids, positions, None, readout, []), range(2))
        every = run_loops(executor, model, StepInputs(ids, positions, None, None, []), range(2))
        verify = StepInputs(ids, positions, None, readout, [], hidden=every.hidden[-1])
        rest = run_loops(executor, model, verify, range(2, 4))
    assert torch.equal(torch.cat([draft.hidden, rest.hidden]), hidden[:, readout])
    assert torch.equal(torch.cat([draft.gate_logits, rest.gate_logits]), gates)


def test_the_piecewise_chain_calls_attention_in_the_slot_maps_order(model):
    """What PiecewiseGraphs.capture_all records between its pieces is what its capture's run calls attention
    with: every loop's slots in order, which replay then hands the backend."""
    slots = []

    def recording(q, k, v, slot):
        slots.append(slot)
        return q.clone()

    piecewise = PiecewiseGraphs(model, None, 16, torch.device("cpu"))
    with torch.inference_mode():
        piecewise.run_model(16, recording)
    slot_map = model.slot_map
    assert slots == [s for t in range(slot_map.loops) for s in slot_map.loop_slots(t)]
    assert slots == list(range(slot_map.num_slots))


@pytest.mark.interpreter
@pytest.mark.usefixtures("coarse_gemm_tiles")
@pytest.mark.parametrize("epilogues", [True, False])
def test_the_fused_path_calls_attention_with_each_loops_slots(tiny_checkpoint, epilogues):
    """model/ouro_fused.py, on the epilogue GEMMs and on the unfused composition, in the Triton interpreter:
    loop t's layers attend on slot_map.loop_slots(t), in order."""
    config = OuroConfig.from_file(tiny_checkpoint / "config.json")
    fused = load_model(tiny_checkpoint, config, torch.device("cpu"), torch.float32, fused_kernels=True)
    fused.fused_epilogues = epilogues
    rows, slots = 1, []

    def recording(q, k, v, slot):
        slots.append(slot)
        return q.clone()

    with torch.inference_mode():
        state = fused.embed(torch.arange(rows))
        context = fused.step_context(torch.arange(rows), state.dtype)
        for t in range(fused.slot_map.loops):
            state = fused.loop(state, context, t, recording)
    assert slots == list(range(fused.slot_map.num_slots))


def test_eager_loops_take_a_backend_or_an_attention_callable_not_both(model):
    with pytest.raises(ValueError, match="pass one of them"):
        EagerLoops(model, None)
    with pytest.raises(ValueError, match="pass one of them"):
        EagerLoops(model, object(), dense_causal_attention)


def imported_modules(source: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_runner_cache_and_engine_name_no_model_family():
    """They take the interface (model/looped.py) and the registry, never Ouro's classes; cache/ reads only
    the slot map of model/."""
    paths = [ROOT / "engine.py", ROOT / "stepping.py", ROOT / "outputs.py",
             *sorted((ROOT / "runner").glob("*.py")), *sorted((ROOT / "cache").glob("*.py"))]
    assert len(paths) > 15
    for path in paths:
        source = path.read_text()
        modules = imported_modules(source)
        name = str(path.relative_to(ROOT))
        assert not {m for m in modules if m.startswith(("model.ouro", "model.config", "model.huginn"))}, name
        assert "OuroConfig" not in source and "OuroForCausalLM" not in source, name
        if name.startswith("cache/"):
            assert {m for m in modules if m.split(".")[0] == "model"} <= {"model.looped"}, name


def test_a_huginn_checkpoint_is_served_with_its_prelude_and_coda_slots():
    with Engine(ROOT / "model" / "checkpoints" / "tiny-huginn", device="cpu", verbose=False) as engine:
        slot_map = engine.model.slot_map
        assert engine.model.prelude is not None and engine.model.coda is not None
        assert engine.kv_pool.slot_map is slot_map and not slot_map.loops_only
        assert slot_map.num_slots == 1 + engine.engine_config.loops * 2 + 1


def test_an_unknown_model_type_is_refused_naming_the_families(tiny_checkpoint, tmp_path):
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, model_type="qwen2")))
    with pytest.raises(ValueError, match=r"'model_type' must name .* \('ouro', 'huginn_raven'\), "
                                         r"got 'qwen2'"):
        Engine(tmp_path, device="cpu", verbose=False)
