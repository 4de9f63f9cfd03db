"""lm-evaluation-harness on the engine, offline, on the tiny model's addition tasks
(benchmarks/tasks/harness/): lm-eval's local-completions against `loop-engine serve` and the in-process model
`loop-engine` give the same loglikelihoods, greedy flags, generations and rolling loglikelihoods item by item,
and those are the Engine's own prompt logprobs; local-chat-completions answers as Engine.chat does. Needs the
[eval] and [serve] extras; CI installs them, so there a missing one fails."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: nothing is downloaded
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("CI"):
    import lm_eval
else:
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("fastapi")

from lm_eval.tasks import TaskManager  # noqa: E402

from engine import Engine, SamplingParams  # noqa: E402
from server.app import bound_socket, build_server  # noqa: E402
from server.lm_eval_model import LoopEngineLM  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

TASKS = ["tiny_addition_mc", "tiny_addition_gen", "tiny_addition_rolling"]
INCLUDE = str(ROOT / "benchmarks" / "tasks" / "harness")
LIMIT = 4


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=INCLUDE, include_defaults=False)  # lm-eval's own thousands: not indexed


@contextlib.contextmanager
def served_engine(**options):
    """`loop-engine serve` of the embedded model (fp32, CPU) on an ephemeral port; yields its base URL."""
    engine = Engine(device="cpu", dtype="float32", num_kv_blocks=512, verbose=False, **options)
    server = build_server(engine, "tiny-ouro", log_level="warning")
    sock = bound_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(60)
    assert server.engine_loop.leaked_blocks == 0 and server.engine_loop.stats.failed == 0


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def in_process(task_manager):
    return lm_eval.simple_evaluate(model="loop-engine", model_args="dtype=float32,num_kv_blocks=512",
                                   device="cpu", tasks=TASKS, task_manager=task_manager, log_samples=True,
                                   limit=LIMIT)


def test_local_completions_through_the_server_equals_the_in_process_model_item_by_item(task_manager,
                                                                                         in_process):
    """batch_size 1 on both routes: each request runs alone, so the two are bitwise equal (the remote
    tokenizer, /tokenize on the server, tokenizes as the in-process model does)."""
    with served_engine() as (url, server):
        through_server = lm_eval.simple_evaluate(
            model="local-completions", model_args=f"base_url={url}/v1/completions,model=tiny-ouro",
            tasks=TASKS, task_manager=task_manager, log_samples=True, limit=LIMIT)
        admitted = server.engine_loop.stats.admitted
    for task in TASKS:
        assert responses(through_server, task) == responses(in_process, task), task
    assert admitted == 4 * LIMIT + LIMIT + LIMIT  # four choices an item, one generation, one window
    assert in_process["results"]["tiny_addition_mc"]["acc,none"] == 1.0
    assert in_process["results"]["tiny_addition_gen"]["exact_match,none"] == 1.0


def test_deterministic_engines_agree_item_by_item_however_the_requests_are_batched(task_manager):
    """deterministic=True (batch invariance) on both: the server takes 4 requests at once, the in-process
    model all 16 together, and each loglikelihood has the same bits on both."""
    with served_engine(deterministic=True) as (url, _):
        through_server = lm_eval.simple_evaluate(
            model="local-completions", model_args=f"base_url={url}/v1/completions,model=tiny-ouro,"
            "num_concurrent=4", tasks=TASKS[:1], task_manager=task_manager, log_samples=True, limit=LIMIT)
    batched = lm_eval.simple_evaluate(
        model="loop-engine", model_args="dtype=float32,num_kv_blocks=512,deterministic=True", device="cpu",
        batch_size="auto", tasks=TASKS[:1], task_manager=task_manager, log_samples=True, limit=LIMIT)
    assert responses(through_server, TASKS[0]) == responses(batched, TASKS[0])


def test_loglikelihoods_are_the_engines_own_prompt_logprobs(in_process):
    """Item 0 of the multiple choice, scored by hand: the sum of each choice's prompt logprobs from
    Engine.generate, and greedy where every one of them is the top token."""
    doc = sorted(in_process["samples"]["tiny_addition_mc"], key=lambda s: s["doc_id"])[0]["doc"]
    with Engine(device="cpu", dtype="float32", verbose=False) as engine:
        context = engine.tokenizer.encode(doc["prompt"])
        expected = []
        for choice in doc["choices"]:
            whole = engine.tokenizer.encode(doc["prompt"] + choice)
            out = engine.generate([whole], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                  use_tqdm=False)[0]
            picked = [out.prompt_logprobs[i][whole[i]] for i in range(len(context), len(whole))]
            expected.append([(sum(lp.logprob for lp in picked), all(lp.rank == 1 for lp in picked))])
    assert responses(in_process, "tiny_addition_mc")[0] == expected
    assert [greedy for [(_, greedy)] in expected] == [c == doc["answer"] for c in doc["choices"]]


def test_local_chat_completions_answers_as_engine_chat(task_manager):
    with served_engine() as (url, _):
        results = lm_eval.simple_evaluate(
            model="local-chat-completions", model_args=f"base_url={url}/v1/chat/completions,model=tiny-ouro",
            tasks=["tiny_addition_gen"], task_manager=task_manager, log_samples=True, limit=2,
            apply_chat_template=True)
    docs = [s["doc"] for s in sorted(results["samples"]["tiny_addition_gen"], key=lambda s: s["doc_id"])]
    params = SamplingParams(temperature=0, max_tokens=8, stop=["\n"])  # the task's until (no EOS string)
    with Engine(device="cpu", dtype="float32", verbose=False) as engine:
        expected = [[[engine.chat([{"role": "user", "content": doc["prompt"]}], params,
                                  use_tqdm=False)[0].outputs[0].text]] for doc in docs]
    assert responses(results, "tiny_addition_gen") == expected


def test_the_in_process_model_takes_engine_arguments_and_names_a_wrong_one():
    lm = LoopEngineLM.create_from_arg_string("loops=2,exit_policy=threshold:0.5,dtype=float32",
                                             {"device": "cpu", "batch_size": "auto"})
    assert (lm.engine.config.total_ut_steps, str(lm.engine.exit_policy)) == (2, "threshold:0.5")
    with pytest.raises(ValueError, match="--model_args: 'loop' is not an Engine argument"):
        LoopEngineLM.create_from_arg_string("loop=2", {"device": "cpu"})


def test_the_command_line_runs_lm_eval_with_the_in_process_model(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "server.lm_eval_model", "--model", "loop-engine", "--model_args",
         "dtype=float32", "--device", "cpu", "--tasks", "tiny_addition_gen", "--include_path", INCLUDE,
         "--limit", "2", "--output_path", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    row = next(line for line in result.stdout.splitlines() if "tiny_addition_gen" in line)
    assert [cell.strip() for cell in row.split("|")][5:8] == ["exact_match", "↑", "1"], row
