"""`loop-engine serve` (server/) on 127.0.0.1, driven by the real `openai` client and by httpx: completions
and chat, whole and streamed, give the Engine's own text, tokens and logprobs; the loop controls ride per
request; bad input answers 400 naming the field; a client that leaves mid-stream or mid-request is aborted
and its KV blocks freed; a full queue answers 429 and a draining server 503; SIGTERM finishes or aborts what
is in flight and frees everything. Needs the [serve] extra and the [dev] clients; CI installs them, so there
a missing one fails."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

if os.environ.get("CI"):
    import httpx
    import openai
else:
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")

from engine import Engine, SamplingParams  # noqa: E402
from server.app import bound_socket, build_server  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

MODEL = "tiny-ouro"
GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}  # runs until the test ends it


def tiny_engine(**options) -> Engine:
    return Engine(device="cpu", dtype="float32", num_kv_blocks=512, verbose=False, **options)


@contextlib.contextmanager
def running_server(engine: Engine, **options):
    """The server of `engine` on an ephemeral port of 127.0.0.1, in a thread; yields (base URL, server).
    Leaving stops it as SIGTERM would."""
    server = build_server(engine, MODEL, log_level="warning", **options)
    sock = bound_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(60)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def served():
    with running_server(tiny_engine()) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def reference():
    """A second Engine of the same config, for what the server should answer."""
    with tiny_engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def engine_state(server) -> tuple[int, int, bool]:
    """(free KV blocks, all blocks, anything unfinished) read on the engine thread between two steps."""
    manager = server.engine_loop.engine.block_manager
    return server.engine_loop.call(
        lambda engine: (manager.num_free_blocks, manager.num_blocks, engine.has_unfinished())).result(10)


def wait_until_idle(server, timeout: float = 20.0) -> None:
    """Until the engine holds no block and has nothing unfinished; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        free, total, busy = engine_state(server)
        if free == total and not busy and server.engine_loop.pending == 0:
            return
        assert time.monotonic() < deadline, f"{total - free} blocks still held, unfinished: {busy}"
        time.sleep(0.05)


def sse_events(response) -> list:
    """The JSON events of a server-sent-event response, then "[DONE]" if it came."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: "):]))
    return events


# -- what the server answers -----------------------------------------------------------------------

def test_completion_through_the_openai_client_is_the_engines_own(client, reference):
    prompts = ["15+46=", "A looped language model"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    expected = reference.generate(prompts, GREEDY, use_tqdm=False)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [e.outputs[0].text for e in expected for _ in range(2)]
    assert out.choices[0].text.startswith("61\n") and out.choices[0].finish_reason == "length"
    prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 4 * 8)


def test_token_id_prompts_and_stop_strings_act_as_in_the_engine(client, reference):
    ids = reference.tokenizer.encode("79+47=")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, stop=["\n"])
    expected = reference.generate([ids], SamplingParams(temperature=0, max_tokens=8, stop=["\n"]),
                                  use_tqdm=False)[0].outputs[0]
    assert out.choices[0].text == expected.text == "126"
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", "\n")


def test_a_stream_adds_up_to_the_whole_answer_with_usage_last(client):
    whole = client.completions.create(model=MODEL, prompt="A looped", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="A looped", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_a_streamed_stop_string_is_never_sent_and_then_taken_back(client, reference):
    """The stop string ("1\\n" below) starts inside text the stream would otherwise have sent already."""
    params = SamplingParams(temperature=0, max_tokens=8, stop=["1\n"])
    expected = reference.generate(["15+46="], params, use_tqdm=False)[0].outputs[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="15+46=", max_tokens=8, temperature=0,
                                            stop=["1\n"], stream=True))
    assert expected == "6" and "".join(c.choices[0].text for c in chunks) == expected


def test_chat_answers_through_the_checkpoints_template_whole_and_streamed(client, reference):
    messages = [{"role": "user", "content": "What is 123+456?"}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert out.choices[0].message.content == expected.outputs[0].text and "579" in expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage == out.usage


def test_chat_logprobs_are_the_engines_with_the_top_n(client, reference):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                              use_tqdm=False)[0].outputs[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    want = [entry[token].logprob for token, entry in zip(expected.token_ids, expected.logprobs)]
    assert [c.logprob for c in content] == want
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_lm_eval_reads_them(client, reference):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1 (and 0, vLLM's prompt-only form)."""
    ids = reference.tokenizer.encode("439+61=500")
    expected = reference.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                  use_tqdm=False)[0]
    want = [None] + [expected.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                    echo=True)
    zero = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, temperature=0, logprobs=1,
                                     echo=True)
    assert one.choices[0].logprobs.token_logprobs[:-1] == want and len(one.choices[0].logprobs.tokens) == 11
    assert one.choices[0].text == "439+61=500" + expected.outputs[0].text
    assert zero.choices[0].logprobs.token_logprobs == want and zero.choices[0].text == "439+61=500"
    assert zero.usage.completion_tokens == 0
    top = one.choices[0].logprobs.top_logprobs
    assert top[0] is None and all(len(t) in (1, 2) for t in top[1:])


def test_exit_policy_and_loop_trace_ride_per_request(client, reference):
    params = SamplingParams(temperature=0, max_tokens=6, exit_policy="step:1", loop_trace=True)
    expected = reference.generate(["15+46="], params, use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt="15+46=", max_tokens=6, temperature=0,
                                    extra_body={"exit_policy": "step:1", "loop_trace": True, "loops": 4})
    trace = out.choices[0].model_extra["loop_trace"]
    assert out.choices[0].text == expected.text
    assert [t["exit_loop"] for t in trace] == [t.exit_loop for t in expected.traces] == [1] * 6
    assert [t["exit_pdf"] for t in trace] == [t.exit_pdf for t in expected.traces]
    assert all(len(t["top_token_ids"]) == 4 for t in trace)
    streamed = list(client.completions.create(model=MODEL, prompt="15+46=", max_tokens=6, temperature=0,
                                              stream=True, extra_body={"loop_trace": True}))
    assert sum(len(c.choices[0].model_extra["loop_trace"]) for c in streamed) == 6


def test_models_health_and_the_tokenizer_routes_lm_eval_uses(url, reference):
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(m["id"], m["loops"], m["max_model_len"]) for m in models] == [(MODEL, 4, 2048)]
    assert httpx.get(f"{url}/health").status_code == 200
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "15+46="}).json()["tokens"]
    assert ids == reference.tokenizer.encode("15+46=")
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": "15+46="}
    assert httpx.get(f"{url}/tokenizer_info").json()["eos_token"] == "<|endoftext|>"


# -- bad input ------------------------------------------------------------------------------------------

BAD = [
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be >= 0.0"),
    ({"prompt": "x", "top_p": 2.0}, "top_p", "top_p must be in [0.0, 1.0]"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "n": 0}, "n", "n must be an integer >= 1"),
    ({"prompt": "x", "max_token": 5}, "max_token", "unknown field 'max_token'"),
    ({"prompt": []}, "prompt", "prompt must be a string, a list of token ids"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": [5, 999999]}, "prompt", "token id 999999 is outside the vocabulary"),
    ({"prompt": "x", "logprobs": 50}, "logprobs", "logprobs must be in [0, 20]"),
    ({"prompt": "x", "exit_policy": "sometimes"}, "exit_policy", "is not an exit policy"),
    ({"prompt": "x", "exit_policy": "step:7"}, "exit_policy", "K must be >= 0 and < loops (4)"),
    ({"prompt": "x", "exit_policy": "early:0.5"}, "exit_policy", "engine-wide"),
    ({"prompt": "x", "loops": 5}, "loops", "loops=5 exceeds the engine's 4 loops"),
    ({"prompt": "x", "loops": 0}, "loops", "loops must be an integer >= 1"),
    ({"prompt": "x", "loops": 2, "exit_policy": "step:2"}, "exit_policy", "K must be >= 0 and < loops (2)"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of=3 is not supported"),
    ({"prompt": "x", "max_tokens": 2048}, "max_tokens", "maximum context length is 2048 tokens"),
    ({"prompt": [5] * 2048, "max_tokens": 1}, "prompt", "2049 tokens (2048 in the prompt, 1 in the"),
]


@pytest.mark.parametrize("body, param, message", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_completion_input_answers_400_naming_the_field(url, body, param, message):
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"]) == (param, "invalid_request_error") and message in error["message"]


@pytest.mark.parametrize("body, param, message", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content must be a string"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages",
     "unknown field 'messages[0].tool_calls'"),
], ids=["content", "empty", "top_logprobs", "tool_calls"])
def test_bad_chat_input_answers_400_naming_the_field(url, body, param, message):
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"]


def test_bad_json_and_an_unknown_model_are_refused_in_openais_shape(client, url):
    response = httpx.post(f"{url}/v1/completions", content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="x")
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"


# -- clients that leave, queues that fill, shutdown ------------------------------------------------------

def test_a_client_that_leaves_mid_stream_is_aborted_and_its_blocks_freed(served):
    url, server = served
    aborted = server.engine_loop.stats.aborted
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "A looped", "stream": True, **LONG},
                      timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:  # read inside the loop: leaving the lines' iterator closes the response
                free, total, busy = engine_state(server)
                break
        assert free < total and busy  # the request holds blocks while it streams
    wait_until_idle(server)
    assert server.engine_loop.stats.aborted == aborted + 1


def test_a_client_that_leaves_before_a_whole_answer_is_aborted_and_its_blocks_freed(served):
    url, server = served
    aborted = server.engine_loop.stats.aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "A looped", **LONG}, timeout=1.0)
    wait_until_idle(server)
    assert server.engine_loop.stats.aborted == aborted + 1


def test_a_full_queue_answers_429_and_a_draining_server_503_at_once():
    with running_server(tiny_engine(), max_pending_requests=2) as (url, server):
        with contextlib.ExitStack() as streams:
            for _ in range(2):
                response = streams.enter_context(httpx.stream(
                    "POST", f"{url}/v1/completions", json={"prompt": "A looped", "stream": True, **LONG},
                    timeout=60))
                assert response.status_code == 200
            start = time.monotonic()
            full = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
            assert time.monotonic() - start < 5
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            error = full.json()["error"]
            assert error["code"] == "queue_full" and "at most 2" in error["message"]
        wait_until_idle(server)  # the two left: their places are free again
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        server.engine_loop.drain()
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/health").status_code == 503
        stats = server.engine_loop.stats
    assert (stats.admitted, stats.finished, stats.aborted, stats.refused) == (3, 1, 2, 1)
    assert server.engine_loop.leaked_blocks == 0


def test_sigterm_lets_short_requests_finish_aborts_long_ones_and_frees_everything():
    results = {}

    def stream(name: str, url: str, max_tokens: int) -> None:
        body = {"prompt": "A looped", "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            events = sse_events(response)
        results[name] = ([e["choices"][0]["finish_reason"] for e in events[:-1]], events[-1])

    with running_server(tiny_engine(), shutdown_timeout=2.0) as (url, server):
        clients = [threading.Thread(target=stream, args=(name, url, tokens))
                   for name, tokens in (("short", 8), ("long", 1500))]
        for thread in clients:
            thread.start()
        while server.engine_loop.stats.admitted < 2:
            time.sleep(0.01)
        server.handle_exit(signal.SIGTERM, None)
    for thread in clients:
        thread.join(30)
    assert results["short"][0][-1] == "length" and results["long"][0][-1] == "abort"
    assert results["short"][1] == results["long"][1] == "[DONE]"
    stats = server.engine_loop.stats
    assert (stats.admitted, stats.finished, stats.aborted, stats.failed) == (2, 1, 1, 0)
    assert server.engine_loop.leaked_blocks == 0


def test_after_disconnects_aborts_and_overload_no_block_leaks_and_no_request_is_lost(reference):
    """Twelve clients at once against room for six: some read their stream to the end, some leave after two
    chunks, some are refused. Every admitted request ends (finished or aborted), every refusal is a 429, the
    finished ones carry the engine's own text, and the pool is whole again."""
    expected = reference.generate(["15+46="], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
    outcomes = []
    all_answered = threading.Barrier(12, timeout=60)  # nobody reads on before every client has its status

    def client(number: int, url: str) -> None:
        body = {"prompt": "15+46=", "stream": True, "max_tokens": 80, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            all_answered.wait()
            if response.status_code != 200:
                response.read()
                outcomes.append(("refused", response.status_code, response.json()["error"]["code"]))
                return
            texts = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
                if number % 2 and len(texts) == 2:
                    outcomes.append(("left", None, None))
                    return
                if line == "data: [DONE]":
                    outcomes.append(("done", "".join(texts) == expected, None))
                    return

    with running_server(tiny_engine(), max_pending_requests=6) as (url, server):
        threads = [threading.Thread(target=client, args=(i, url)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        wait_until_idle(server)
        stats = server.engine_loop.stats
    kinds = [o[0] for o in outcomes]
    assert len(outcomes) == 12 and kinds.count("refused") == stats.refused > 0
    assert all(o[1:] == (429, "queue_full") for o in outcomes if o[0] == "refused")
    assert all(o[1] for o in outcomes if o[0] == "done") and kinds.count("done") == stats.finished
    assert stats.admitted == stats.finished + stats.aborted == kinds.count("done") + kinds.count("left")
    assert stats.failed == 0 and server.engine_loop.leaked_blocks == 0


def test_an_engine_failure_fails_the_requests_in_flight_with_500_and_then_refuses_with_503(capsys):
    engine = tiny_engine()
    real_step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("a kernel fault")
        return real_step()

    engine.step = failing_step
    with running_server(engine) as (url, server):
        failed = httpx.post(f"{url}/v1/completions", json={"prompt": "A looped", **LONG}, timeout=30)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        health = httpx.get(f"{url}/health").status_code
    assert failed.status_code == 500
    assert "the engine failed: a kernel fault" in failed.json()["error"]["message"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed" and health == 503
    assert (server.engine_loop.stats.failed, server.engine_loop.pending) == (1, 0)
    assert "RuntimeError: a kernel fault" in capsys.readouterr().err


def test_the_serve_command_listens_answers_and_exits_on_sigterm():
    process = subprocess.Popen([sys.executable, "engine.py", "serve", "--device", "cpu", "--threads", "1",
                                "--port", "0", "--num-kv-blocks", "64", "--log-level", "warning"],
                               cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        line = ""
        while "http://" not in line:
            line = process.stderr.readline()
            assert line or process.poll() is None, "serve exited before it listened"
        url = line.split(" on ")[1].split("/v1")[0]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        body = {"prompt": "15+46=", "max_tokens": 3, "temperature": 0}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        assert out["model"] == MODEL and out["choices"][0]["text"] == "61\n"
        process.send_signal(signal.SIGTERM)
        rest = process.stderr.read()
        assert process.wait(30) == -signal.SIGTERM  # uvicorn re-raises the signal once shut down
    finally:
        if process.poll() is None:
            process.kill()
    assert "stopped; 1 requests finished, 0 aborted, 0 failed, 0 refused (429); 0 KV blocks held" in rest
