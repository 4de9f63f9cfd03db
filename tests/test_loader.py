import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.config import OuroConfig
from model.loader import load_model, resolve_model_dir
from tests.conftest import ROOT


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _load(path):
    config = OuroConfig.from_file(path / "config.json")
    return load_model(path, config, torch.device("cpu"), torch.float32)


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        _load(path)


def test_wrong_shape_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' in \S+model\.safetensors has shape \(7,\), "
                                         r"expected \(128,\)"):
        _load(path)


def test_wrong_dtype_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    _rewrite(path, lambda t: t.update({"model.early_exit_gate.bias": torch.zeros(1, dtype=torch.int32)}))
    with pytest.raises(ValueError, match=r"'model\.early_exit_gate\.bias' in \S+model\.safetensors has "
                                         r"dtype I32"):
        _load(path)


def test_unexpected_tensor_is_reported(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    _rewrite(path, lambda t: t.update({"model.extra.weight": torch.ones(3)}))
    with pytest.warns(UserWarning, match=r"unexpected tensor.*model\.extra\.weight"):
        _load(path)


def test_bad_config_field_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    raw["num_attention_heads"] = "four"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_attention_heads"):
        OuroConfig.from_file(path / "config.json")


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(tmp_path / "nowhere")


def test_uncached_hub_id_while_offline_says_what_to_do(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    code = "from model.loader import resolve_model_dir; resolve_model_dir('ByteDance/Ouro-1.4B')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "not in the local Hugging Face cache" in result.stderr
    assert "HF_HOME" in result.stderr and "`hf download ByteDance/Ouro-1.4B`" in result.stderr


def test_sharded_checkpoint_loads_identical_weights(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "sharded")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / file))
        weight_map.update({n: file for n in shard_names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    single, sharded = _load(tiny_checkpoint), _load(path)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def _shard(tiny_checkpoint, path, weight_map_file):
    """A copy whose index sends every tensor to the one file it names."""
    _copy(tiny_checkpoint, path)
    names = list(load_file(str(path / "model.safetensors")))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: weight_map_file
                                                                                  for n in names}}))
    return path


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/hostname", "shards/../../x.safetensors",
                                   "C:\\weights.safetensors", "..\\x.safetensors", ""])
def test_index_entries_that_leave_the_checkpoint_are_refused(tiny_checkpoint, tmp_path, entry):
    path = _shard(tiny_checkpoint, tmp_path / "ckpt", entry)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: the entry for tensor"):
        _load(path)


def test_a_link_out_of_the_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tiny_checkpoint / "model.safetensors", outside)
    path = _shard(tiny_checkpoint, tmp_path / "ckpt", "linked.safetensors")
    (path / "linked.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match=r"'linked\.safetensors', a link to .*elsewhere\.safetensors, out"):
        _load(path)


def test_links_inside_the_checkpoint_and_into_a_hub_cache_blobs_folder_load(tiny_checkpoint, tmp_path):
    inside = _shard(tiny_checkpoint, tmp_path / "ckpt", "linked.safetensors")
    (inside / "linked.safetensors").symlink_to(inside / "model.safetensors")
    repo = tmp_path / "hub" / "models--org--tiny"  # huggingface_hub's cache layout
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file in tiny_checkpoint.iterdir():
        shutil.copy(file, repo / "blobs" / file.name)
        (snapshot / file.name).symlink_to(f"../../blobs/{file.name}")
    reference = _load(tiny_checkpoint).state_dict()
    for path in (inside, snapshot):
        for (name, a), b in zip(reference.items(), _load(path).state_dict().values()):
            assert torch.equal(a, b), name
