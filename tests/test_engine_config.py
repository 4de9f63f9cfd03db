"""Engine options are checked before anything slow or remote happens: the plain ones before the model
directory is resolved (so a Hugging Face id is never downloaded for a typo), those that depend on the
checkpoint before any weight is read. Each error names the option."""

import pytest

import engine
import engine_config
from engine import Engine

PLAIN = [("block_size", 0), ("num_kv_blocks", 0), ("gpu_memory_utilization", True),
         ("max_num_seqs", "8"), ("max_num_batched_tokens", 1.5), ("max_model_len", 0),
         ("enable_prefix_caching", "yes"), ("packed_prefill", 1), ("enforce_eager", None),
         ("exit_policy", "fast"), ("kv_sharing", "all"), ("loops", 0), ("exit_threshold", float("inf")),
         ("dtype", "int8"), ("attention", "flash"), ("device", "tpu"), ("verbose", "no"),
         ("admission", "eager")]


@pytest.fixture
def no_resolving(monkeypatch):
    def refuse(model):
        raise AssertionError(f"resolved {model!r} before checking the options")

    monkeypatch.setattr(engine_config, "resolve_model_dir", refuse)


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded weights before checking the options")

    monkeypatch.setattr(engine, "load_model", refuse)


@pytest.mark.parametrize("option, value", PLAIN)
def test_a_bad_plain_option_is_named_before_the_model_is_resolved(no_resolving, option, value):
    arguments = {"device": "cpu", option: value}
    with pytest.raises(ValueError, match=option if option not in ("attention", "device") else repr(value)):
        Engine("some-org/some-model", **arguments)


def test_both_exit_policy_and_threshold_are_refused_before_the_model_is_resolved(no_resolving):
    with pytest.raises(ValueError, match="not both"):
        Engine("some-org/some-model", device="cpu", exit_policy="full", exit_threshold=0.5)


@pytest.mark.parametrize("option, value, message", [
    ("max_model_len", 10**6, "max_model_len 1000000 exceeds the checkpoint's max_position_embeddings 4096"),
    ("exit_policy", "step:4", "exit_policy 'step:4'"),
    ("loops", 2, None)])
def test_checkpoint_dependent_options_are_checked_before_weights_load(tiny_checkpoint, no_loading, option,
                                                                      value, message):
    arguments = {"device": "cpu", "verbose": False, option: value}
    if message is None:  # loops=2 makes step:2 out of range
        arguments["exit_policy"], message = "step:2", "exit_policy 'step:2'"
    with pytest.raises(ValueError, match=message):
        Engine(tiny_checkpoint, **arguments)


def test_a_model_argument_that_is_no_path_is_named():
    with pytest.raises(ValueError, match="model must be a checkpoint directory or a Hugging Face repo id"):
        Engine(42, device="cpu")


@pytest.mark.parametrize("option, value, message", [
    ("kv_cache_dtype", "kvarn_k4v2_g64",
     "kv_cache_dtype='kvarn_k4v2_g64' cannot serve this checkpoint: KVarN needs a power-of-two head_dim of "
     "at least 8, got 24"),
    ("attention", "flex", "kv_cache_dtype='kvarn_k4v2_g64' runs on attention='torch' or 'triton'")])
def test_kvarn_refusals_that_depend_on_the_checkpoint_or_backend_name_the_options(
        tiny_checkpoint, tmp_path, monkeypatch, no_loading, option, value, message):
    """A KVarN tile needs a power-of-two head_dim: a checkpoint with head_dim 24 is refused before its weights
    load, naming kv_cache_dtype. So is a KVarN cache on a backend without a KVarN path."""
    import json
    import re
    import shutil

    from attention import registry
    from attention.torch_backend import TorchBackend

    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    if option == "kv_cache_dtype":
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "head_dim": 24}))
        arguments = {"kv_cache_dtype": value}
    else:
        registry.available()  # the built-in backends registered first, so this one is only added
        flex = type("FlexBackend", (TorchBackend,), {"name": "flex"})
        monkeypatch.setitem(registry._REGISTRY, "flex", flex)
        arguments = {"kv_cache_dtype": "kvarn_k4v2_g64", "attention": value}
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(checkpoint, device="cpu", block_size=64, verbose=False, **arguments)
