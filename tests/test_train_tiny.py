"""examples/train_tiny.py: the stage-I loss, the held-out split, a toy training run whose exported
checkpoint the engine reproduces, and the shipped checkpoint's committed task accuracy."""

import json
import re

import pytest
import torch

from engine import DEFAULT_MODEL, Engine, SamplingParams
from examples import train_tiny
from examples.loops_matter import engine_accuracy
from model.config import OuroConfig
from model.loader import load_model
from tests.numerics import assert_within_noise
from tests.reference import exit_pdf as reference_exit_pdf

HANDFUL_MARGIN = 0.1  # 2 of 20 sums: CPU fp32 engine decoding vs the fp32 scoring done at training time


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    # One thread: the toy model is far too small to gain from more, and on a shared CPU OpenMP
    # threads that spin-wait on each other make each step ten times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("toy") / "tiny-ouro"
        yield out, train_tiny.train(out, "toy", seed=0, device="cpu")
    finally:
        torch.set_num_threads(threads)


def test_exit_pdf_matches_the_reference_formula():
    gate_logits = torch.randn(4, 6) * 3
    p, log_p = train_tiny.exit_pdf(gate_logits)
    exact = torch.stack([reference_exit_pdf(gate_logits[:, i]) for i in range(6)], 1)  # fp64
    # log p is a sum of T logsigmoid terms, all <= 0, each within 4 ulps (torch's logsigmoid), summed in
    # fp32: off by at most (T + 4) u |log p|; exp and the output rounding add 2 u, relative to p.
    loops, u = gate_logits.shape[0], 2.0**-24
    assert ((p.double() - exact).abs() <= ((loops + 4) * exact.log().abs() + 4) * u * exact).all()
    assert torch.equal(log_p.exp(), p)
    # Summed: each term's error above, plus T roundings of the sum.
    sum_bound = ((loops + 4) * (exact * exact.log().abs()).sum(0) + 4 + loops) * u
    assert ((p.double().sum(0) - 1).abs() <= sum_bound).all()


def test_held_out_sums_never_appear_in_training_documents():
    rng = train_tiny.random.Random("check")
    text = "".join(train_tiny.document(rng, max_digits=4) for _ in range(3000))
    seen = {(int(a), int(b)) for a, b in re.findall(r"(\d+)\+(\d+)[=?]", text)}
    assert len(seen) > 5000
    assert not any(train_tiny.is_held_out(a, b) for a, b in seen)
    test = train_tiny.test_pairs(seed=0, count=200, max_digits=4)
    assert len(set(test)) == 200 and all(train_tiny.is_held_out(a, b) for a, b in test)
    assert test == train_tiny.test_pairs(seed=0, count=200, max_digits=4)


def test_toy_training_lowers_the_expected_loss(toy):
    _, trained = toy
    curve = trained.results["curve"]
    assert curve[-1]["step"] == train_tiny.PRESETS["toy"].steps
    assert curve[-1]["expected_ce"] < 0.8 * curve[0]["expected_ce"]
    assert all(ce < 0.8 * first for ce, first in zip(curve[-1]["ce_by_loop"], curve[0]["ce_by_loop"]))


def test_toy_checkpoint_has_the_hf_layout_and_its_results(toy):
    out, trained = toy
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json",
                                               "results.json"}
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["total_ut_steps"], config["torch_dtype"]) == ("ouro", 4, "float32")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    results = json.loads((out / "results.json").read_text())
    assert results["seed"] == 0 and results["steps_done"] == results["steps"]
    assert set(results["task"]["accuracy_by_loops"]) == {"1", "2", "3", "4"}


def test_exported_weights_reproduce_the_training_model(toy):
    out, trained = toy
    ids = torch.tensor([trained.tokenizer.encode("Once upon a time, 12+34=46\n").ids])
    config = OuroConfig.from_file(out / "config.json")
    with torch.no_grad():
        expected = train_tiny.run_model(trained.model, ids)
        loaded_model = load_model(out, config, torch.device("cpu"), torch.float32)
        loaded = train_tiny.run_model(loaded_model, ids)
        exact_model = load_model(out, config, torch.device("cpu"), torch.float64)
        exact = train_tiny.run_model(exact_model, ids)
        logits = [m.compute_logits(s.hidden) for m, s in ((loaded_model, loaded), (trained.model, expected),
                                                          (exact_model, exact))]
    # The loaded model fuses q/k/v and gate/up, so its sums run in another order than training's: it must be
    # as close to the exact (fp64) answer as the training model is (tests/numerics.py).
    assert_within_noise(*logits, "logits")
    assert_within_noise(loaded.gate_logits, expected.gate_logits, exact.gate_logits, "gate logits")


def test_engine_decodes_the_toy_checkpoint_as_the_training_model_does(toy):
    out, trained = toy
    prompt = trained.tokenizer.encode("Once upon a time").ids
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            states = train_tiny.run_model(trained.model, torch.tensor([tokens]))
            tokens.append(trained.model.compute_logits(states.hidden[-1, -1]).argmax().item())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with Engine(out, device="cpu", num_kv_blocks=16, verbose=False) as engine:
        output = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == tokens[len(prompt):]


def test_shipped_checkpoint_keeps_its_committed_task_accuracy():
    results_path = DEFAULT_MODEL / "results.json"
    assert results_path.is_file(), f"{DEFAULT_MODEL} ships without results.json (written by train_tiny.py)"
    task = json.loads(results_path.read_text())["task"]
    committed = task["handful"]
    pairs = train_tiny.test_pairs(json.loads(results_path.read_text())["seed"], committed["items"],
                                  task["max_digits"])
    accuracy, _ = engine_accuracy(DEFAULT_MODEL, "cpu", pairs, task["max_digits"], loops=committed["loops"])
    assert accuracy >= committed["accuracy"] - HANDFUL_MARGIN
