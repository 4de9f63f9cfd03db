import json

import pytest

from model.config import OuroConfig
from model.tiny import PRESETS, hf_config


def _raw(**changes):
    raw = hf_config(dict(PRESETS["ouro-1.4b"]))
    raw.update(changes)
    return raw


def test_real_shape_config_reads_every_field():
    config = OuroConfig.from_dict(_raw())
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size) == \
        (2048, 24, 16, 16, 128, 5632, 49152)
    assert config.total_ut_steps == 4 and config.num_slots == 96
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6 and not config.tie_word_embeddings
    assert config.early_exit_threshold == 1.0 and config.eos_token_ids == (0,)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "total_ut_steps", "rope_theta",
                                   "intermediate_size", "vocab_size"])
def test_missing_field_is_named(field):
    raw = _raw()
    del raw[field]
    with pytest.raises(ValueError, match=field):
        OuroConfig.from_dict(raw)


@pytest.mark.parametrize("field, value", [("hidden_size", 0), ("num_attention_heads", "16"),
                                          ("total_ut_steps", -1), ("rms_norm_eps", 0),
                                          ("hidden_act", "gelu"), ("model_type", "qwen2"),
                                          ("rope_scaling", {"type": "yarn"}), ("use_sliding_window", True),
                                          ("num_key_value_heads", 5), ("torch_dtype", "int8"),
                                          ("early_exit_threshold", -0.5)])
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        OuroConfig.from_dict(_raw(**{field: value}))


def test_overrides_change_loops_and_threshold_only():
    config = OuroConfig.from_dict(_raw())
    changed = config.with_overrides(loops=2, exit_threshold=0.5)
    assert changed.total_ut_steps == 2 and changed.num_slots == 48 and changed.early_exit_threshold == 0.5
    assert changed.hidden_size == config.hidden_size


def test_loop_count_beyond_trained_warns():
    with pytest.warns(UserWarning, match="trained"):
        OuroConfig.from_dict(_raw()).with_overrides(loops=6)


@pytest.mark.parametrize("loops", [0, 1.5, True])
def test_bad_loop_override_is_rejected(loops):
    with pytest.raises(ValueError, match="loops"):
        OuroConfig.from_dict(_raw()).with_overrides(loops=loops)


def test_config_file_that_is_not_json_is_reported(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        OuroConfig.from_file(path)
    path.write_text(json.dumps(_raw()))
    assert OuroConfig.from_file(path).hidden_size == 2048


@pytest.mark.parametrize("field, value", [("tie_word_embeddings", "false"), ("tie_word_embeddings", None),
                                          ("rms_norm_eps", float("inf")), ("rope_theta", float("nan")),
                                          ("early_exit_threshold", float("inf")),
                                          ("early_exit_threshold", True), ("eos_token_id", True),
                                          ("eos_token_id", [0, "2"]), ("eos_token_id", 10**6),
                                          ("bos_token_id", False), ("use_sliding_window", "false"),
                                          ("attention_bias", "no"), ("head_dim", 127),
                                          ("num_hidden_layers", True)])
def test_accepted_but_wrong_json_types_are_named(field, value):
    """JSON strings are not bools, bools are not ids, Infinity is not a finite number, and RoPE needs an
    even head_dim."""
    with pytest.raises(ValueError, match=field):
        OuroConfig.from_dict(_raw(**{field: value}))


def test_infinity_written_in_the_json_file_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_raw()).replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": Infinity'))
    with pytest.raises(ValueError, match="'rms_norm_eps' must be a finite positive number, got inf"):
        OuroConfig.from_file(path)


def test_absent_exit_threshold_is_the_hf_default_and_null_stays_null():
    raw = _raw()
    del raw["early_exit_threshold"]
    assert OuroConfig.from_dict(raw).early_exit_threshold == 1.0
    assert OuroConfig.from_dict(_raw(early_exit_threshold=None)).early_exit_threshold is None
