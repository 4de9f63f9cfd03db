"""`python engine.py eval` (benchmarks/paired_eval.py) on the embedded trained tiny checkpoint: identical
configs agree exactly, 4 loops against 1 reproduce the teacher-forced accuracy item by item, ABBA timing runs
in order; and the statistics, tasks and protocols it rests on."""

import json
import math
import random

import pytest
import torch
from tokenizers import Tokenizer

from benchmarks.eval_protocol import load_protocol
from benchmarks.eval_task import AnswerRule, load_task, normalize_answer
from benchmarks.paired_eval import paired_eval, parse_config
from benchmarks.paired_stats import TINY, abba_ratio, first_divergence, mcnemar_exact, topn_kl
from cli import main
from engine import DEFAULT_MODEL
from examples import train_tiny
from model.config import OuroConfig
from model.loader import load_model
from tests.conftest import ROOT

TASKS = ROOT / "benchmarks" / "tasks"
ADDITION = TASKS / "addition.json"
CPU = {"device": "cpu", "dtype": "float32"}


# -- statistics ------------------------------------------------------------------------------------

def test_mcnemar_exact_is_the_two_sided_binomial_tail():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 2 ** 10)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(5, 5) == 1.0


def test_first_divergence_is_the_first_differing_position_or_the_shorter_length():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_topn_kl_is_exact_on_the_full_vocabulary_and_a_lower_bound_on_a_top_n():
    p, q = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1), \
        torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), -1)
    exact = float((p.double().exp() * (p.double() - q.double())).sum())
    full = {t: float(p[t]) for t in range(50)}, {t: float(q[t]) for t in range(50)}
    # fp32 log_softmax sums to 1 only within its rounding, so topn_kl sees rest buckets of that mass (at
    # most r) and adds at most r log(r / TINY); the 50 shared terms, summed in another order, add at most
    # 50 x 2^-53 of their absolute sum.
    rest = max(abs(1 - float(d.double().exp().sum())) for d in (p, q))
    terms = float((p.double().exp() * (p.double() - q.double())).abs().sum())
    bound = rest * math.log(max(rest, TINY) / TINY) + 50 * 2**-53 * terms
    assert topn_kl(*full) == pytest.approx(exact, abs=bound)
    top = [{t: float(d[t]) for t in d.topk(10).indices.tolist()} for d in (p, q)]
    assert 0 < topn_kl(*top) <= exact
    assert topn_kl(top[0], dict(top[0])) == 0.0


def test_abba_ratio_pairs_each_b_with_its_neighbouring_a():
    assert abba_ratio("ABBA", [10.0, 20.0, 22.0, 11.0]) == 2.0
    assert abba_ratio("ABBAABBA", [1.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0, 1.0]) == 2.5
    with pytest.raises(ValueError, match="one A and one B"):
        abba_ratio("AABB", [1.0] * 4)


# -- tasks and protocols ---------------------------------------------------------------------------

def test_shipped_addition_task_is_the_tiny_models_held_out_split():
    trained = json.loads((DEFAULT_MODEL / "results.json").read_text())
    pairs = train_tiny.test_pairs(trained["seed"], 512, trained["task"]["max_digits"])
    items = load_protocol(ADDITION).items()  # also checks the protocol's sha256 of the file
    assert [(i.prompt, i.gold) for i in items] == [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


def test_answer_rules_and_normalisation():
    assert AnswerRule().extract("so 3 + 4 = 7, the answer is 1,234.00.") == "1234"
    assert AnswerRule().extract("no digits") is None
    exact = AnswerRule("regex", "^(0|[1-9][0-9]*)$")
    assert exact.extract("82") == "82" and exact.extract("082") is None and exact.extract("8 2") is None
    assert normalize_answer("$18.") == "18" and normalize_answer("-0.50") == "-0.5"


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("line, text, match", [
    (2, '{"id": 2, "prompt": "x", "answer": "1"', r"tasks.jsonl:2: not valid JSON"),
    (2, '{"id": 2, "prompt": "x"}', r"tasks.jsonl:2: .*\"answer\""),
    (2, '{"id": 1, "prompt": "x", "answer": "1"}', r"tasks.jsonl:2: id '1' was already used on line 1"),
    (2, '{"id": 2, "prompt": "x", "question": "y", "answer": "1"}', r"tasks.jsonl:2: .*exactly one of"),
    (2, '{"id": 2, "prompt": "x", "answer": "1", "extra": 0}', r"tasks.jsonl:2: unknown field"),
])
def test_broken_task_line_is_named_by_file_and_line(tmp_path, line, text, match):
    path = write(tmp_path / "tasks.jsonl", '{"id": 1, "prompt": "x", "answer": "1"}\n' + text + "\n")
    with pytest.raises(ValueError, match=match):
        load_task(path)


def protocol_text(**fields) -> str:
    base = {"name": "t", "task": "tasks.jsonl", "ids": "all", "max_new_tokens": 4}
    return json.dumps({**base, **fields}, indent=1)


@pytest.mark.parametrize("fields, match", [
    ({"max_new_tokens": 0}, r"p.json:5: max_new_tokens must be an integer >= 1"),
    ({"loopz": 4}, r"p.json:6: loopz is not a protocol field"),
    ({"sampling": {"temperature": -1}}, r"p.json:6: sampling: SamplingParams.temperature"),
    ({"sampling": {"max_tokens": 3}}, r"p.json:6: sampling has 'max_tokens'"),
    ({"extract": {"regex": "("}}, r"p.json:6: extract regex '\(' does not compile"),
        ({"extract": "first_number"}, r"p.json:6: extract must be \"last_number\" or"),
    ({"ids": ["1", "1"]}, r"p.json:4: ids lists id\(s\) \['1'\] more than once"),
    ({"shots": 2}, r"p.json:6: shots needs a shots_file"),
])
def test_broken_protocol_field_is_named_by_file_and_line(tmp_path, fields, match):
    write(tmp_path / "tasks.jsonl", '{"id": 1, "prompt": "x", "answer": "1"}\n')
    with pytest.raises(ValueError, match=match):
        load_protocol(write(tmp_path / "p.json", protocol_text(**fields)))


def test_protocol_syntax_error_missing_ids_and_missing_task_are_named(tmp_path):
    write(tmp_path / "tasks.jsonl", '{"id": 1, "prompt": "x", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"p.json:3: not valid JSON"):
        load_protocol(write(tmp_path / "p.json", '{\n "name": "t",\n "task" "x"\n}'))
    with pytest.raises(ValueError, match=r"p.json: 1 id\(s\) of the protocol are not in the task .*\['7'\]"):
        load_protocol(write(tmp_path / "p.json", protocol_text(ids=[1, 7]))).items()
    with pytest.raises(FileNotFoundError, match=r"p.json:3: task: task file .*nope.jsonl does not exist. "
                                                r"Get it from the moon"):
        load_protocol(write(tmp_path / "p.json", protocol_text(task="nope.jsonl", task_source="the moon")))


def test_gsm8k_protocol_reads_a_local_copy_three_shot_with_line_ids(tmp_path):
    rng = random.Random(0)
    answers = [rng.randrange(1000) for _ in range(1319)]
    lines = [json.dumps({"question": f"Question number {i}?", "answer": f"Work it out.\n#### {a:,}"})
             for i, a in enumerate(answers)]
    local = write(tmp_path / "test.jsonl", "\n".join(lines) + "\n")
    protocol = load_protocol(TASKS / "gsm8k.json", task=local)
    items = protocol.items()
    assert len(items) == 87 and protocol.shots == 3 and protocol.max_new_tokens == 1024
    assert protocol.sampling_params().greedy and protocol.loops == 4
    first = int(items[0].id)
    assert items[0].gold == str(answers[first])
    assert items[0].prompt.startswith("Question: There are 15 trees")
    assert items[0].prompt.count("Question:") == 4
    assert items[0].prompt.endswith(f"\n\nQuestion: Question number {first}?\nAnswer:")
    with pytest.raises(FileNotFoundError, match="grade-school-math.*--task PATH"):
        load_protocol(TASKS / "gsm8k.json", task=tmp_path / "missing.jsonl")


def test_config_tokens_become_engine_arguments():
    assert parse_config(["loops=1", "exit_policy=early:0.5", "enforce_eager=true", "/ck"], "b") == \
        {"loops": 1, "exit_policy": "early:0.5", "enforce_eager": True, "model": "/ck"}
    with pytest.raises(ValueError, match="--b: 'loopz' is not an Engine argument"):
        parse_config(["loopz=1"], "b")


# -- paired runs on the trained tiny checkpoint -------------------------------------------------------

def test_identical_configs_agree_exactly_and_time_in_abba_order():
    report = paired_eval(ADDITION, {}, {}, common=CPU, limit=6, abba_rounds=1)
    assert report.identity_rate == 1.0 and report.token_identity_rate == 1.0
    assert report.kl["mean"] == 0.0 and report.kl["max"] == 0.0 and report.kl["positions"] > 0
    assert report.delta == 0.0 and report.mcnemar_p == 1.0 and report.only_a == report.only_b == []
    timing = report.timing
    assert [p.label for p in timing.passes] == list("ABBA")
    assert timing.tok_s_ratio == abba_ratio("ABBA", [p.tok_s for p in timing.passes])
    # Timing passes run without logprobs; the tokens are the same.
    assert all(p.output_tokens == report.a["output_tokens"] for p in timing.passes)
    assert "limit=6" in report.notes[0]


def test_four_loops_against_one_match_the_teacher_forced_accuracy_item_by_item():
    items = 24
    report = paired_eval(ADDITION, {"loops": 4}, {"loops": 1}, common=CPU, limit=items, abba_rounds=0)
    trained = json.loads((DEFAULT_MODEL / "results.json").read_text())
    pairs = train_tiny.test_pairs(trained["seed"], items, trained["task"]["max_digits"])
    cpu = torch.device("cpu")
    model = load_model(DEFAULT_MODEL, OuroConfig.from_file(DEFAULT_MODEL / "config.json"), cpu, torch.float32)
    scores = train_tiny.score_items(model, Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json")), pairs,
                                    cpu)
    right = (scores.correct | ~scores.answer).all(2)  # [loops, items]
    assert [i.a_correct for i in report.items] == right[3].tolist()
    assert [i.b_correct for i in report.items] == right[0].tolist()
    assert report.a["accuracy"] >= 0.9 and report.b["accuracy"] <= 0.6  # the known gap: 0.990 vs 0.357
    assert report.mcnemar_p == mcnemar_exact(len(report.only_a), len(report.only_b)) < 0.01
    for item in report.items:
        d = item.divergence
        if d is not None and d.a_token is not None and d.b_token is not None:
            # Greedy: each side's own token is its most likely one at the divergence.
            assert d.a_logprobs[0] >= (d.a_logprobs[1] if d.a_logprobs[1] is not None else -math.inf)
            assert d.b_logprobs[1] >= (d.b_logprobs[0] if d.b_logprobs[0] is not None else -math.inf)
            assert item.kl[-1] > 0


def test_cli_writes_json_and_markdown_and_names_a_bad_config(tmp_path, capsys):
    out = tmp_path / "report.json"
    main(["eval", "--protocol", str(ADDITION), "--engine", "device=cpu", "--a", "loops=2", "--b",
          "exit_policy=early:0.5", "--limit", "3", "--abba", "0", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["a"]["engine_args"] == {"loops": 2, "device": "cpu"}
    assert saved["b"]["loops_per_token"] < 4.0 and len(saved["items"]) == 3
    assert out.with_suffix(".md").read_text().startswith("# Paired eval `tiny-addition-512`")
    assert "| accuracy |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--b: 'loopz' is not an Engine argument"):
        main(["eval", "--protocol", str(ADDITION), "--b", "loopz=1"])
