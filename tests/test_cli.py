"""The `generate` CLI (cli.main): failed requests exit non-zero with their error, --chat prints the answer
only, --prompts-file writes one JSON line per prompt in input order, sampling and KV flags reach the engine,
and the thread rule. Most run main() in this process; one runs the real command line for its exit status."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cache import pool_sizing
from cli import default_cpu_threads, main, read_prompts_file
from engine import Engine, SamplingParams
from tests.conftest import ROOT

GREEDY = ["--device", "cpu", "--threads", "1", "--temperature", "0"]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["generate", *GREEDY, *argv])
    out, err = capsys.readouterr()
    return status, out, err


def greedy_tokens(checkpoint, prompts: list[str], **params) -> list[list[int]]:
    with Engine(checkpoint, device="cpu", verbose=False) as engine:
        outputs = engine.generate(prompts, SamplingParams(temperature=0, **params), use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def test_a_failed_request_exits_nonzero_with_its_error_on_the_command_line(tiny_checkpoint, capsys):
    """The real command line's exit status for an empty prompt; main()'s for a prompt too long."""
    command = [sys.executable, "engine.py", "generate", "--model", str(tiny_checkpoint), *GREEDY,
               "--prompt", ""]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 1, result.stderr
    assert "error: prompt is empty" in result.stderr and result.stdout == ""
    status, out, err = run_main(capsys, "--model", str(tiny_checkpoint), "--prompt", "a b c d e f g h i j",
                                "--max-model-len", "4")
    assert status == 1 and out == "" and "more than max_model_len 4" in err


def test_prompt_is_echoed_then_its_greedy_continuation(tiny_checkpoint, capsys):
    status, out, err = run_main(capsys, "--model", str(tiny_checkpoint), "--prompt", "Hello",
                                "--max-tokens", "6", "--ignore-eos")
    with Engine(tiny_checkpoint, device="cpu", verbose=False) as engine:
        text = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].text
    assert status == 0 and out == "Hello" + text + "\n"
    assert "6 tokens in" in err and "1 CPU threads" in err and torch.get_num_threads() == 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_prints_the_answer_without_the_chatml_around_it(capsys, stream):
    """The embedded checkpoint was trained on ChatML sums, so its answer is known."""
    status, out, _ = run_main(capsys, "--chat", "What is 123+456?", "--max-tokens", "24",
                              *(["--stream"] if stream else []))
    with Engine(device="cpu", verbose=False) as engine:
        answer = engine.chat([{"role": "user", "content": "What is 123+456?"}],
                             SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    assert status == 0 and out == answer + "\n"
    assert "<|im_start|>" not in out and "579" in answer


def test_prompts_file_gives_one_json_line_per_prompt_in_order_and_a_bad_prompt_fails_alone(
        tiny_checkpoint, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time\n\nHello there\n")
    status, out, err = run_main(capsys, "--model", str(tiny_checkpoint), "--prompts-file", str(path),
                                "--max-tokens", "5", "--ignore-eos")
    rows = [json.loads(line) for line in out.splitlines()]
    assert status == 1 and [row["index"] for row in rows] == [0, 1, 2]
    assert [row["prompt"] for row in rows] == ["Once upon a time", "", "Hello there"]
    assert rows[1]["finish_reason"] == "error" and rows[1]["error"] == "prompt is empty"
    assert "error: prompt 1 (line 2): prompt is empty" in err and "3 prompts, 10 tokens" in err
    expected = greedy_tokens(tiny_checkpoint, ["Once upon a time", "Hello there"], max_tokens=5,
                             ignore_eos=True)
    assert [rows[0]["token_ids"], rows[2]["token_ids"]] == expected


def test_jsonl_prompts_carry_their_fields_and_stop_strings_unescape(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "sum", "prompt": "4821+3907="}\n{"id": "story", "prompt": "Once upon a time"}\n')
    status, out, _ = run_main(capsys, "--prompts-file", str(path), "--max-tokens", "12", "--stop", "\\n")
    rows = [json.loads(line) for line in out.splitlines()]
    assert status == 0 and [row["id"] for row in rows] == ["sum", "story"]
    assert (rows[0]["text"], rows[0]["finish_reason"], rows[0]["stop_reason"]) == ("8728", "stop", "\n")


def test_min_tokens_and_penalty_flags_reach_the_sampling_params(capsys):
    """The embedded model answers "8728" then a newline; min_tokens 8 lets the newline pass."""
    flags = ["--prompt", "4821+3907=", "--max-tokens", "12", "--stop", "\\n", "--min-tokens", "8",
             "--repetition-penalty", "1.2", "--presence-penalty", "0.5", "--frequency-penalty", "0.25"]
    status, out, _ = run_main(capsys, *flags)
    params = SamplingParams(temperature=0, max_tokens=12, stop=["\n"], min_tokens=8, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.25)
    with Engine(device="cpu", verbose=False) as engine:
        completion = engine.generate("4821+3907=", params, use_tqdm=False)[0].outputs[0]
    assert status == 0 and out == "4821+3907=" + completion.text + "\n"
    assert len(completion.token_ids) >= 8


@pytest.mark.parametrize("line, message", [("{oops", "line 2: not JSON"),
                                           ('{"text": "hi"}', 'line 2: needs a "prompt"')])
def test_a_malformed_jsonl_line_is_named_before_any_model_loads(tmp_path, capsys, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    status, out, err = run_main(capsys, "--model", str(tmp_path / "no-model-here"),
                                "--prompts-file", str(path))
    assert status == 1 and message in err and str(path) in err and out == ""
    with pytest.raises(ValueError, match=message):
        read_prompts_file(path)


def test_a_sequence_the_kv_pool_cuts_short_is_reported(tiny_checkpoint, capsys):
    with pytest.warns(UserWarning, match="KV pool holds 32 tokens"):
        status, _, err = run_main(capsys, "--model", str(tiny_checkpoint), "--prompt", "Hello",
                                  "--num-kv-blocks", "2", "--max-tokens", "100", "--ignore-eos")
    assert status == 0 and "finish_reason=length" in err
    assert "ended because the KV pool (32 tokens) was full, not at --max-tokens" in err


def test_bad_engine_flags_exit_with_the_field_named(tiny_checkpoint, capsys):
    status, _, err = run_main(capsys, "--model", str(tiny_checkpoint), "--kv-cache-gib", "0")
    assert status == 1 and "kv_cache_gib" in err
    with pytest.raises(SystemExit):
        main(["generate", "--threads", "0"])
    assert "--threads must be a positive integer or auto" in capsys.readouterr().err


def test_auto_threads_leave_busy_cores_to_their_owners(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for load, threads in ((0.2, 2), (0.9, 1), (1.4, 1), (3.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert default_cpu_threads() == threads


def test_available_memory_is_a_positive_amount_within_the_machine():
    available = pool_sizing.available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
