"""Huginn's model-side pieces on their own (docs/huginn.md): the config and loader, the network's step-wise
methods, RoPE, the initial state, the exit criteria, and the cache strategies and warm start as a loop
driver would run them, all against tests/reference_huginn.py.

`PlaneStore` and `drive` are the engine's job in miniature: KV planes per physical slot (a latest or a
compress:k layout, copy-forward at a token's exit), and the per-token loop with exits and warm start over
the model's prelude / initial_state / core_step / coda / logits.
"""

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from model.exit_criteria import (AUTO_THRESHOLDS, ExitCriterion, ExitMemory, kl_divergence, minp_log_probs,
                                 uniform_log_probs)
from model.huginn import HuginnConfig, HuginnForCausalLM, apply_rope, half_split_order
from model.huginn_loader import expected_tensors, load_huginn
from model.tiny import HUGINN_PRESETS, HUGINN_SPECIAL_TOKENS, huginn_hf_config, write_checkpoint
from tests.reference_huginn import ReferenceHuginn, read_recurrence, rope_adjacent

PROMPTS = [[7, 30, 99, 12, 5], [200, 201, 3], [64]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("huginn-tiny"), preset="huginn-tiny", seed=0)


@pytest.fixture(scope="module")
def model(checkpoint) -> HuginnForCausalLM:
    return load_huginn(checkpoint, HuginnConfig.from_file(checkpoint / "config.json"), "cpu", torch.float32)


@pytest.fixture(scope="module")
def reference(checkpoint) -> ReferenceHuginn:
    return ReferenceHuginn(checkpoint)


def dense_causal_attention(q, k, v, slot):
    qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)


class PlaneStore:
    """One sequence's KV as an engine layout keeps it: a plane per physical slot, a logical slot (the model's
    numbering) mapped onto its plane, and copy-forward when a token stops early. `latest`: a plane per
    logical slot; `compress:k`: a ring of k core planes (k / C recurrences deep). Attention reads the planes
    as they are, causally over the positions being written (set `positions` before each call group)."""

    def __init__(self, config: HuginnConfig, recurrences: int, layout: str = "latest", capacity: int = 64):
        self.config, self.recurrences = config, recurrences
        core = config.n_layers_in_recurrent_block
        self.depth = recurrences if layout == "latest" else int(layout.partition(":")[2]) // core
        planes = config.n_layers_in_prelude + self.depth * core + config.n_layers_in_coda
        shape = (planes, capacity, config.n_heads, config.head_dim)
        self.keys, self.values = torch.zeros(shape), torch.zeros(shape)
        self.positions = torch.arange(0)

    def plane(self, slot: int) -> int:
        prelude, core = self.config.n_layers_in_prelude, self.config.n_layers_in_recurrent_block
        coda_start = self.config.coda_slot(0, self.recurrences)
        if slot < prelude:
            return slot
        if slot < coda_start:
            recurrence, layer = divmod(slot - prelude, core)
            return prelude + (recurrence % self.depth) * core + layer
        return prelude + self.depth * core + slot - coda_start

    def __call__(self, q, k, v, slot):
        plane, positions = self.plane(slot), self.positions
        self.keys[plane, positions], self.values[plane, positions] = k, v
        end = int(positions[-1]) + 1
        scores = torch.einsum("qhd,khd->hqk", q, self.keys[plane, :end]) / math.sqrt(q.shape[-1])
        visible = torch.arange(end)[None, :] <= positions[:, None]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", weights, self.values[plane, :end])

    def exited(self, position: int, ran: int) -> None:
        """Copy-forward: the token at `position` ran `ran` recurrences; the core planes it never wrote take
        its deepest K/V of the same layer."""
        prelude, core = self.config.n_layers_in_prelude, self.config.n_layers_in_recurrent_block
        for row in range(ran, self.depth):
            for layer in range(core):
                source, target = prelude + (ran - 1) * core + layer, prelude + row * core + layer
                self.keys[target, position] = self.keys[source, position]
                self.values[target, position] = self.values[source, position]


def drive(model: HuginnForCausalLM, prompt: list[int], max_new_tokens: int, num_steps: int,
          layout: str = "latest", criterion: ExitCriterion | None = None, exit_steps: list[int] | None = None,
          warm_start: str | None = None) -> tuple[list[int], list[int]]:
    """Greedy tokens and the recurrences behind each, the prompt in one call and each token after it alone,
    through the model's step-wise methods and a PlaneStore; zero initial states."""
    store = PlaneStore(model.config, num_steps, layout)
    tokens, steps, ids, start, warm = [], [], list(prompt), 0, None
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            store.positions = torch.arange(start, start + len(ids))
            generated = start >= len(prompt)
            cos, sin = model.rotary(store.positions)
            e = model.run_prelude(torch.tensor(ids), cos, sin, store)
            state = model.initial_state(e)
            if generated and warm_start is not None:
                state = model.ln_f(warm) if warm_start == "normalized" else warm
            adaptive = criterion if generated else None
            memory = adaptive.start(state, model.config.padded_vocab_size) if adaptive else None
            states, exit_loop = [], None
            for i in range(num_steps):
                state = model.core_step(state, e, cos, sin, store, i)
                states.append(state)
                if generated and exit_steps is not None and i + 1 >= exit_steps[start - len(prompt)]:
                    exit_loop = i
                    break
                if adaptive is not None and adaptive.is_checked(i):
                    observed = model.logits(model.run_coda(state, cos, sin, store, num_steps)) \
                        if adaptive.reads_logits else state
                    exits, _, memory = adaptive.check(memory, observed)
                    if bool(exits[0]):
                        exit_loop = i
                        break
            if exit_loop is None:
                exit_loop = adaptive.readout_loop(num_steps) if adaptive else num_steps - 1
            if generated:
                store.exited(start, len(states))
            readout = states[exit_loop] if states else state
            logits = model.logits(model.run_coda(readout, cos, sin, store, num_steps))
            tokens.append(int(logits[-1].argmax()))
            steps.append(len(states))
            warm = state[-1:]
            start += len(ids)
            ids = tokens[-1:]
    return tokens, steps


# --- the network --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("init_scale", [0.0, 1.0])
def test_step_wise_methods_compose_to_forward_bitwise(model, init_scale):
    ids, positions, steps = torch.tensor(PROMPTS[0]), torch.arange(len(PROMPTS[0])), 3
    with torch.inference_mode():
        whole = model(ids, positions, dense_causal_attention, steps, init_scale,
                      torch.Generator().manual_seed(1))
        cos, sin = model.rotary(positions)
        e = model.run_prelude(ids, cos, sin, dense_causal_attention)
        state = model.initial_state(e, init_scale, torch.Generator().manual_seed(1))
        for i in range(steps):
            state = model.core_step(state, e, cos, sin, dense_causal_attention, i)
        stepped = model.logits(model.run_coda(state, cos, sin, dense_causal_attention, steps))
    assert whole.dtype == torch.float32 and whole.shape == (len(PROMPTS[0]), model.config.padded_vocab_size)
    assert torch.equal(whole, stepped)


def test_forward_logits_match_the_reference(model, reference):
    ids = PROMPTS[0] + PROMPTS[1]
    with torch.inference_mode():
        logits = model(torch.tensor(ids), torch.arange(len(ids)), dense_causal_attention, 4)
    torch.testing.assert_close(logits, reference.logits(ids, 4), rtol=0, atol=2e-5)


@pytest.mark.parametrize("loops", [1, 2, 4, 8])
def test_greedy_tokens_token_by_token_equal_the_dense_reference(model, reference, loops):
    """The model through a per-slot K/V store, the prompt in one call and one token a call, against the
    reference recomputing the whole sequence densely for every token (fp32, zero initial states)."""
    for prompt in PROMPTS:
        assert drive(model, prompt, 8, loops)[0] == reference.greedy(prompt, 8, loops)


def test_the_slot_map_numbers_prelude_core_then_coda():
    config = HuginnConfig.from_dict(huginn_hf_config(HUGINN_PRESETS["huginn-0125"]))
    assert (config.num_slots(32), config.core_slot(0, 0), config.core_slot(31, 3)) == (132, 2, 129)
    assert (config.coda_slot(0, 32), config.coda_slot(1, 32), config.coda_slot(0, 4)) == (130, 131, 18)
    layers = [config.physical_layer(slot, 2) for slot in range(config.num_slots(2))]
    assert layers == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="slot 12 is outside 0..11"):
        config.physical_layer(12, 2)


# --- RoPE ---------------------------------------------------------------------------------------------------

def test_half_split_rope_of_permuted_rows_is_the_adjacent_pair_rope_permuted_bitwise():
    """The loader permutes each head's q/k rows into half_split_order; rotating those with the model's
    tables gives, bit for bit, the official adjacent-pair rotation of the checkpoint-order rows, permuted."""
    config = HuginnConfig.from_dict(huginn_hf_config(HUGINN_PRESETS["huginn-0125"]))
    from model.huginn import Rotary

    x = torch.randn(7, 3, config.head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 2, 17, 500, 2047, 4095])
    order = half_split_order(config.head_dim)
    cos, sin = Rotary(config.head_dim, config.rope_base)(positions)
    adjacent = rope_adjacent(x, positions, config.rope_base)
    assert torch.equal(apply_rope(x[..., order], cos, sin), adjacent[..., order])


def test_adjacent_pair_rope_is_a_complex_rotation_of_each_pair():
    """The reference's adjacent-pair RoPE against a direct one: pair j as a complex number times
    exp(i * angle), the angle position * 50000^(-2j/96) in fp32 as the official table has it (at position
    4095 its rounding alone moves the result by 6e-4), the product in float64."""
    x = torch.randn(5, 2, 96, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, 1, 3, 1000, 4095])
    theta = 1.0 / (50000.0 ** (torch.arange(0, 96, 2, dtype=torch.float32) / 96))
    turn = torch.polar(torch.ones(5, 48, dtype=torch.float64), (positions.float()[:, None] * theta).double())
    pairs = torch.view_as_complex(x.double().view(5, 2, 48, 2))
    direct = torch.view_as_real(pairs * turn[:, None]).flatten(-2)
    torch.testing.assert_close(rope_adjacent(x, positions, 50000.0).double(), direct, rtol=0, atol=1e-6)
    assert not torch.allclose(rope_adjacent(x, positions, 50000.0), x[..., half_split_order(96)], atol=1e-3)


# --- the initial state --------------------------------------------------------------------------------------

def test_initial_state_is_a_clipped_normal_times_the_embedding_scale():
    config = HuginnConfig.from_dict(huginn_hf_config(HUGINN_PRESETS["huginn-0125"]))
    with torch.device("meta"):
        model = HuginnForCausalLM(config)
    e = torch.zeros(64, config.n_embd)
    state = model.initial_state(e, 1.0, torch.Generator().manual_seed(3))
    sigma = 0.008703882797784892 * math.sqrt(5280)  # init_values.std x embed_scale
    assert state.dtype == e.dtype and state.shape == e.shape
    assert state.abs().max() <= 3 * sigma and state.abs().max() > 2.9 * sigma
    # a normal clipped at 3 sigma keeps 98.66% of its variance
    assert abs(state.std().item() / (sigma * math.sqrt(0.98658)) - 1) < 0.01
    assert abs(state.mean().item()) < 0.01
    half = model.initial_state(e, 0.5, torch.Generator().manual_seed(3))
    assert half.abs().max() <= 1.5 * sigma
    assert torch.equal(state, model.initial_state(e, 1.0, torch.Generator().manual_seed(3)))
    assert not torch.equal(state, model.initial_state(e, 1.0, torch.Generator().manual_seed(4)))
    assert torch.equal(model.initial_state(e, 0.0), torch.zeros_like(e))
    with pytest.raises(ValueError, match="init_scale must be a finite number >= 0"):
        model.initial_state(e, -1.0)


# --- config and loader --------------------------------------------------------------------------------------

def test_huginn_0125_preset_has_the_published_shape():
    config = HuginnConfig.from_dict(huginn_hf_config(HUGINN_PRESETS["huginn-0125"]))
    assert (config.head_dim, config.mean_recurrence, config.padded_vocab_size) == (96, 32, 65536)
    assert config.embed_scale == pytest.approx(72.6636085) and config.init_std == pytest.approx(0.0087038828)
    assert sum(math.prod(shape) for shape in expected_tensors(config).values()) == 3_564_976_800


@pytest.mark.parametrize("change,match", [
    ({"model_type": "ouro"}, "'model_type' must be 'huginn_raven'"),
    ({"injection_type": "add"}, "'injection_type' must be 'linear'"),
    ({"state_init": "zero"}, "'state_init' must be 'like-init'"),
    ({"bias": True}, "'bias' must be False"),
    ({"block_class_name": "SandwichBlockSwin"}, "'block_class_name' must be 'SandwichBlock'"),
    ({"test_time_noise": 0.1}, "'test_time_noise' must be 0"),
    ({"n_embd": None}, "'n_embd' must be an integer >= 1"),
    ({"n_heads": 7}, "'n_embd' \\(64\\) must be a multiple of 'n_heads' \\(7\\)"),
    ({"n_layers": 5}, "'n_layers' \\(5\\) must be prelude \\+ recurrent block \\+ coda layers \\(4\\)"),
    ({"num_key_value_heads": 2}, "'num_key_value_heads' must equal n_heads"),
    ({"head_dim": 32}, "'head_dim' must be n_embd / n_heads \\(16\\)"),
    ({"n_layers_in_recurrent_block": 0, "n_layers": 2},
     "'n_layers_in_recurrent_block' must be an integer >= 1"),
    ({"padded_vocab_size": 10}, "'padded_vocab_size' \\(10\\) must be at least 'vocab_size'"),
    ({"rope_base": -1}, "'rope_base' must be a finite positive number"),
    ({"qk_bias": "yes"}, "'qk_bias' must be true or false"),
    ({"init_values": {"std": 0.1}}, "'init_values' must be an object with 'std' and 'embed_scale'"),
    ({"init_values": {"std": 0.1, "embed_scale": 0}}, "'init_values.embed_scale' must be a finite positive"),
    ({"torch_dtype": "int8"}, "'torch_dtype' must be float32, float16 or bfloat16"),
])
def test_config_refuses_what_is_not_huginn_naming_the_field(change, match):
    raw = {**huginn_hf_config(HUGINN_PRESETS["huginn-tiny"]), **change}
    with pytest.raises(ValueError, match=match):
        HuginnConfig.from_dict(raw)


def test_config_requires_the_shape_fields():
    raw = huginn_hf_config(HUGINN_PRESETS["huginn-tiny"])
    del raw["mean_recurrence"]
    with pytest.raises(ValueError, match="missing the required field 'mean_recurrence'"):
        HuginnConfig.from_dict(raw)


def test_config_without_init_values_derives_them_as_the_official_class_does():
    raw = huginn_hf_config(HUGINN_PRESETS["huginn-tiny"])
    del raw["init_values"]
    config = HuginnConfig.from_dict(raw)
    assert (config.init_std, config.embed_scale) == (math.sqrt(2 / (5 * 64)), 8.0)


def _rewrite(checkpoint, tmp_path, edit):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    return HuginnConfig.from_file(tmp_path / "config.json")


def test_loader_refuses_a_missing_tensor_naming_it(checkpoint, tmp_path):
    config = _rewrite(checkpoint, tmp_path, lambda t: t.pop("transformer.core_block.1.attn.qk_bias"))
    with pytest.raises(ValueError, match="missing tensor 'transformer.core_block.1.attn.qk_bias'"):
        load_huginn(tmp_path, config, "cpu", torch.float32)


def test_loader_refuses_a_misshapen_tensor_naming_it(checkpoint, tmp_path):
    def edit(tensors):
        tensors["transformer.adapter.weight"] = tensors["transformer.adapter.weight"][:, :64].contiguous()
    config = _rewrite(checkpoint, tmp_path, edit)
    with pytest.raises(ValueError, match=r"tensor 'transformer.adapter.weight' has shape \(64, 64\), "
                                         r"expected \(64, 128\)"):
        load_huginn(tmp_path, config, "cpu", torch.float32)


def test_loader_ignores_the_rope_buffer_and_a_stored_tied_head(checkpoint, tmp_path, model):
    def edit(tensors):
        assert tensors["freqs_cis"].shape == (1, 1024, 1, 8, 2)  # what the writer stores, as the official
        tensors["lm_head.weight"] = torch.zeros_like(tensors["transformer.wte.weight"])
    config = _rewrite(checkpoint, tmp_path, edit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_huginn(tmp_path, config, "cpu", torch.float32)
    ids = torch.tensor(PROMPTS[1])
    with torch.inference_mode():
        assert torch.equal(loaded(ids, torch.arange(3), dense_causal_attention, 2),
                           model(ids, torch.arange(3), dense_causal_attention, 2))


def test_tiny_checkpoint_round_trips(checkpoint, model):
    raw = json.loads((checkpoint / "config.json").read_text())
    assert raw["model_type"] == "huginn_raven" and "tie_word_embeddings" not in raw
    config = model.config
    layers = (config.n_layers_in_prelude, config.n_layers_in_recurrent_block, config.n_layers_in_coda)
    assert layers == (1, 2, 1)
    assert config.torch_dtype == "float32" and 100_000 < sum(p.numel() for p in model.parameters()) < 500_000
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config.vocab_size
    assert [tokenizer.token_to_id(t) for t in HUGINN_SPECIAL_TOKENS] == list(range(6))
    stored = load_file(str(checkpoint / "model.safetensors"))
    order = torch.cat([half_split_order(16) + 16 * head for head in range(4)])
    wqkv = model.core_blocks[1].attn.Wqkv.weight
    assert torch.equal(wqkv[:64][order.argsort()], stored["transformer.core_block.1.attn.Wqkv.weight"][:64])
    assert torch.equal(wqkv[128:], stored["transformer.core_block.1.attn.Wqkv.weight"][128:])
    assert torch.equal(model.coda_blocks[0].norm_4.weight, stored["transformer.coda.0.norm_4.weight"])
    assert torch.equal(model.wte.weight, stored["transformer.wte.weight"]) and model.lm_head is None


def test_ouro_presets_still_write_ouro(tmp_path):
    path = write_checkpoint(tmp_path, preset="tiny", seed=0, loops=2, layers=1)
    raw = json.loads((path / "config.json").read_text())
    assert (raw["model_type"], raw["total_ut_steps"], raw["num_hidden_layers"]) == ("ouro", 2, 1)
    with pytest.raises(ValueError, match="layers applies to the Ouro presets"):
        write_checkpoint(tmp_path, preset="huginn-tiny", layers=1)


# --- exit criteria ------------------------------------------------------------------------------------------

def _logits(*rows):
    return torch.tensor(rows, dtype=torch.float32).log()


def test_kl_compares_previous_against_current_in_the_official_direction():
    p, q = torch.tensor([[0.7, 0.2, 0.1]]), torch.tensor([[0.1, 0.3, 0.6]])
    forward = (p * (p / q).log()).sum()  # KL(previous || current)
    assert kl_divergence(p.log(), q.log()).item() == pytest.approx(forward.item())
    assert forward.item() != pytest.approx((q * (q / p).log()).sum().item())
    criterion = ExitCriterion("kl", 1e-3)
    memory = criterion.start(torch.zeros(1, 4), vocab_size=3)
    exits, values, memory = criterion.check(memory, p.log())
    uniform = torch.full((3,), 1 / 3)
    assert values.item() == pytest.approx((uniform * (uniform / p[0]).log()).sum().item(), rel=1e-5)
    assert not exits.item()
    exits, values, memory = criterion.check(memory, q.log())
    assert values.item() == pytest.approx(forward.item(), rel=1e-5) and not exits.item()
    exits, values, _ = criterion.check(memory, (q * 1.0001 / (q * 1.0001).sum()).log())
    assert values.item() < 1e-3 and exits.item()


def test_minp_kl_floors_small_probabilities_to_one_over_v():
    logits = _logits([0.8, 0.15, 0.03, 0.02])  # 0.03 and 0.02 < 0.1 x 0.8: each becomes 1/4
    expected = torch.tensor([0.8, 0.15, 0.25, 0.25]) / 1.45
    torch.testing.assert_close(minp_log_probs(logits)[0].exp(), expected)
    criterion = ExitCriterion.parse("minp-kl")
    memory = criterion.start(torch.zeros(1, 2), vocab_size=4)
    _, _, memory = criterion.check(memory, logits)
    # mass moving between entries under the floor leaves the floored distribution as it was
    moved = _logits([0.8, 0.15, 0.04, 0.01])
    exits, values, _ = criterion.check(memory, moved)
    assert values.item() < 1e-5 and exits.item()
    assert ExitCriterion.parse("kl").check(ExitMemory(logits.log_softmax(-1)), moved)[1].item() > 1e-3


def test_entropy_diff_starts_from_100_and_exits_when_entropy_settles():
    criterion = ExitCriterion("entropy-diff", 0.01)
    memory = criterion.start(torch.zeros(2, 2), vocab_size=2)
    exits, values, memory = criterion.check(memory, _logits([0.5, 0.5], [0.9, 0.1]))
    torch.testing.assert_close(values, torch.tensor([100 - math.log(2), 100 - 0.3250830]), rtol=1e-6, atol=0)
    exits, values, memory = criterion.check(memory, _logits([0.5, 0.5], [0.6, 0.4]))
    assert exits.tolist() == [True, False]


def test_argmax_stability_counts_checks_with_the_same_argmax():
    criterion = ExitCriterion.parse("argmax-stability")  # auto: 5
    memory = criterion.start(torch.zeros(1, 2), vocab_size=3)
    fired = []
    for top in [0, 1, 1, 1, 1, 1, 1, 2]:
        row = [0.1, 0.1, 0.1]
        row[top] = 0.8
        exits, values, memory = criterion.check(memory, _logits(row))
        fired.append((int(values), bool(exits)))
    assert fired == [(0, False), (0, False), (1, False), (2, False), (3, False), (4, False), (5, True),
                     (0, False)]


def test_latent_criteria_compare_raw_states():
    start = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    diff = ExitCriterion("latent-diff", 0.1)
    exits, values, memory = diff.check(diff.start(start, 0), torch.tensor([[3.0, 4.1], [1.0, 0.0]]))
    torch.testing.assert_close(values, torch.tensor([0.1 / math.hypot(3, 4.1), 1.0]))
    assert exits.tolist() == [True, False]
    cosine = ExitCriterion.parse("cosine")
    exits, values, memory = cosine.check(cosine.start(start, 0), torch.tensor([[6.0, 8.0], [1.0, 0.0]]))
    assert values[0].item() == pytest.approx(0, abs=1e-6) and math.isnan(values[1].item())
    assert exits.tolist() == [True, False]  # a zero initial state gives NaN: no exit, as in the official code
    exits, values, _ = cosine.check(memory, torch.tensor([[6.0, 8.0], [0.0, 1.0]]))
    assert values[1].item() == pytest.approx(1.0) and exits.tolist() == [True, False]


def test_inactive_rows_keep_their_memory_and_never_exit():
    criterion = ExitCriterion("kl", 0.5)
    memory = criterion.start(torch.zeros(2, 1), vocab_size=2)
    same = _logits([0.5, 0.5], [0.5, 0.5])
    exits, _, after = criterion.check(memory, same, active=torch.tensor([True, False]))
    assert exits.tolist() == [True, False]
    assert torch.equal(after.previous[1], memory.previous[1])
    rows = torch.stack([criterion.check(memory, same[i:i + 1])[1][0] for i in range(2)])
    assert torch.equal(criterion.check(memory, same)[1], rows)  # a row's value does not depend on the others


def test_min_steps_and_check_every_schedule_the_checks_and_the_readout():
    criterion = ExitCriterion.parse("kl:auto", min_steps=2, check_every=3)
    assert [t for t in range(12) if criterion.is_checked(t)] == [2, 5, 8, 11]
    assert criterion.readout_loop(8) == 5  # loop 7 is not checked: the last check's readout stands
    assert criterion.readout_loop(9) == 8
    assert ExitCriterion.parse("latent-diff", 2, 3).readout_loop(8) == 7
    assert ExitCriterion.parse("kl", min_steps=8).readout_loop(8) == 7  # never checked


@pytest.mark.parametrize("spec,match", [
    ("foo", "unknown exit criterion 'foo'"),
    ("kl:x", "needs a number or 'auto'"),
    ("kl:-1", "needs a finite threshold > 0"),
    ("argmax-stability:2.5", "threshold must be a whole number"),
])
def test_criterion_parse_refuses_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        ExitCriterion.parse(spec)


def test_auto_thresholds_are_the_official_head_values():
    assert {kind: ExitCriterion.parse(kind).threshold for kind in AUTO_THRESHOLDS} == {
        "kl": 1e-3, "minp-kl": 1e-5, "entropy-diff": 1e-3, "latent-diff": 0.03, "argmax-stability": 5,
        "cosine": 1e-3}
    with pytest.raises(ValueError, match="check_every must be an integer >= 1"):
        ExitCriterion.parse("kl", check_every=0)


def test_first_kl_check_is_against_the_uniform_distribution():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    values = ExitCriterion("kl", 1.0).check(ExitCriterion("kl", 1.0).start(torch.zeros(3, 1), 11), logits)[1]
    torch.testing.assert_close(values, kl_divergence(uniform_log_probs(3, 11, "cpu"), logits.log_softmax(-1)))


# --- cache strategies, exits and warm start -----------------------------------------------------------------

def test_read_recurrence_latest_and_compress():
    # latest: the same recurrence, or the deepest the token reached
    assert [read_recurrence("latest", 3, i, 2) for i in range(6)] == [0, 1, 2, 2, 2, 2]
    # compress:4 with 2 core layers: a ring two recurrences deep; a token that ran 8 exposes 6 and 7
    assert [read_recurrence("compress:4", 8, i, 2) for i in range(4)] == [6, 7, 6, 7]
    assert [read_recurrence("compress:4", 3, i, 2) for i in range(4)] == [2, 1, 2, 1]
    assert [read_recurrence("compress:4", 1, i, 2) for i in range(4)] == [0, 0, 0, 0]
    # compress:C is one slot per physical layer: always the token's deepest
    assert [read_recurrence("compress:2", 5, i, 2) for i in range(3)] == [4, 4, 4]


@pytest.mark.parametrize("layout", ["latest", "compress:2", "compress:4"])
def test_tokens_that_exit_at_different_depths_read_what_the_strategy_says(model, reference, layout):
    """Scripted exits (1 to 8 of 8 recurrences): the model through planes kept as an engine layout keeps them
    (copy-forward at exit, a ring for compress:k) gives the reference's tokens, whose strategy is written out
    as which recurrence of each earlier token a query reads."""
    exits = [3, 1, 6, 2, 8, 1]
    want = reference.generate(PROMPTS[0], 7, 8, layout, exit_steps=exits)
    assert want.steps == [8] + exits
    assert drive(model, PROMPTS[0], 7, 8, layout, exit_steps=exits) == (want.tokens, want.steps)


def test_cache_strategies_differ_only_where_the_reference_says(reference):
    """At full depth latest is the plain model (every token reads the same recurrence of every other);
    compress:k is not, since a generated token reads the ring's last writes. With early exits the three
    strategies give three different next-token distributions."""
    ids, prompt_len = PROMPTS[0] + [11, 12, 13, 14], len(PROMPTS[0])
    full = reference.run(ids, prompt_len, 8, "latest", exit_steps=[8] * 4).logits
    torch.testing.assert_close(full, reference.logits(ids, 8)[-1], rtol=0, atol=2e-5)
    ring = reference.run(ids, prompt_len, 8, "compress:4", exit_steps=[8] * 4).logits
    assert (ring - full).abs().max() > 1e-2
    early = [reference.run(ids, prompt_len, 8, layout, exit_steps=[3, 1, 6, 2]).logits
             for layout in ("latest", "compress:2", "compress:4")]
    assert (early[0] - full).abs().max() > 1e-2
    assert all((a - b).abs().max() > 1e-2 for i, a in enumerate(early) for b in early[i + 1:])


ADAPTIVE = [("kl:0.1", 0, 1, "latest", None), ("kl:0.05", 1, 2, "compress:4", "raw"),
            ("minp-kl:0.05", 0, 1, "compress:4", None), ("entropy-diff:0.05", 0, 1, "latest", "normalized"),
            ("argmax-stability:2", 0, 1, "latest", "raw"), ("latent-diff:0.5", 0, 1, "compress:2", None),
            ("cosine:0.1", 0, 1, "latest", "normalized"), ("kl:0.02", 2, 3, "latest", None)]


@pytest.mark.parametrize("spec,min_steps,every,layout,warm_start", ADAPTIVE)
def test_adaptive_exits_equal_the_reference(model, reference, spec, min_steps, every, layout, warm_start):
    """Identical tokens and exit steps, per token, up to 8 recurrences. Every checked value stays at least
    1e-4 (relative) from the threshold, so fp32 rounding cannot flip a decision."""
    criterion = ExitCriterion.parse(spec, min_steps, every)
    want = reference.generate(PROMPTS[0], 6, 8, layout, criterion=criterion, warm_start=warm_start)
    got = drive(model, PROMPTS[0], 6, 8, layout, criterion, warm_start=warm_start)
    assert got == (want.tokens, want.steps)
    if criterion.kind != "argmax-stability":
        assert all(abs(v / criterion.threshold - 1) > 1e-4 for checks in want.checks for _, v in checks)
    if spec != "kl:0.02":
        assert len(set(want.steps[1:])) > 1  # tokens exit at different depths


def test_the_two_warm_starts_differ(reference):
    """raw: the previous token's last state; normalized: its ln_f (the official fixed-depth path's)."""
    runs = {warm: reference.generate(PROMPTS[2], 6, 2, warm_start=warm).tokens
            for warm in (None, "raw", "normalized")}
    assert runs[None] != runs["raw"] != runs["normalized"] != runs[None]
