"""The Engine's Python surface: stream, chat, step/abort, input order, dict prompts, the progress bar,
errors, close."""

import importlib.util
import io
import sys
import types
import warnings
import weakref

import pytest
import tqdm
import tqdm.notebook

import outputs as outputs_module
from engine import LLM, Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", verbose=False) as engine:
        yield engine


def test_outputs_come_back_in_input_order(engine):
    prompts = ["a b c d e f g h", "x", "hello there"]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [engine.tokenizer.encode(p) for p in prompts]


def test_stream_yields_growing_text_that_ends_as_generate(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pieces = [o.outputs[0].token_ids for o in engine.stream("hello", params)]
    assert [len(p) for p in pieces] == [1, 2, 3, 4, 5, 6]
    assert pieces[-1] == engine.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_renders_the_template(engine):
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    out = engine.chat(messages, params)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_abort_finishes_only_that_request(engine):
    keep = engine.add_request("one", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    drop = engine.add_request("two", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    engine.abort(drop)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished[drop].finish_reason == "abort"
    assert finished[keep].finish_reason == "length" and len(finished[keep].token_ids) == 4


def test_stop_string_is_cut_unless_asked_to_include(engine):
    base = engine.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    stop = base.text[2:4]
    cut = engine.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop),
                          use_tqdm=False)[0].outputs[0]
    kept = engine.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop,
                                                   include_stop_str_in_output=True),
                           use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason == "stop" and cut.stop_reason == stop
            and cut.text == base.text[:base.text.find(stop)])
    assert kept.text == base.text[:base.text.find(stop) + len(stop)]


def test_bad_prompt_type_names_the_prompt(engine):
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate(["ok", 3.5], use_tqdm=False)


@pytest.mark.parametrize("option, value", [("block_size", 0), ("max_num_seqs", -1),
                                           ("gpu_memory_utilization", 1.5),
                                           ("dtype", "int8"), ("attention", "flash"), ("device", "tpu"),
                                           ("loops", 0)])
def test_bad_engine_option_is_named(tiny_checkpoint, option, value):
    with pytest.raises(ValueError, match=option if option not in ("attention", "device") else value):
        Engine(tiny_checkpoint, verbose=False, **{"device": "cpu", option: value})


def test_close_releases_the_model_and_pool(tiny_checkpoint):
    engine = Engine(tiny_checkpoint, device="cpu", verbose=False)
    pool = weakref.ref(engine.kv_pool)
    engine.close()
    assert pool() is None and "model" not in vars(engine)
    engine.close()  # a second close (as a with block after close() does) is a no-op


@pytest.fixture
def closed_engine(tiny_checkpoint):
    engine = Engine(tiny_checkpoint, device="cpu", verbose=False)
    engine.close()
    return engine


@pytest.mark.parametrize("use", [
    lambda e: e.generate("hi", use_tqdm=False), lambda e: e.stream("hi"),
    lambda e: e.chat([{"role": "user", "content": "hi"}]), lambda e: e.add_request("hi"), lambda e: e.step(),
    lambda e: e.abort("0"), lambda e: e.has_unfinished(), lambda e: e.get_tokenizer(), lambda e: e.tokenizer,
    lambda e: e.model, lambda e: e.device, lambda e: e.loop_stats, lambda e: e.max_concurrent_sequences(4, 4),
], ids=["generate", "stream", "chat", "add_request", "step", "abort", "has_unfinished", "get_tokenizer",
        "tokenizer", "model", "device", "loop_stats", "max_concurrent_sequences"])
def test_a_closed_engine_raises_engine_is_closed_on_any_use(closed_engine, use):
    with pytest.raises(RuntimeError, match="^Engine is closed$"):
        use(closed_engine)


def test_a_stream_open_when_the_engine_closes_raises_engine_is_closed(tiny_checkpoint):
    engine = Engine(tiny_checkpoint, device="cpu", verbose=False)
    outputs = engine.stream("hello", SamplingParams(max_tokens=8, ignore_eos=True))
    next(outputs)
    engine.close()
    with pytest.raises(RuntimeError, match="^Engine is closed$"):
        next(outputs)


def test_llm_is_the_engine_under_vllms_name():
    assert LLM is Engine


def test_get_tokenizer_returns_the_engines_tokenizer(engine):
    tokenizer = engine.get_tokenizer()
    assert tokenizer is engine.tokenizer
    assert tokenizer.decode(tokenizer.encode("hello there")) == "hello there"


# -- dict prompts (vLLM's TextPrompt and TokensPrompt) -----------------------------------------------------

def test_dict_prompts_generate_as_their_text_and_token_ids(engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = engine.tokenizer.encode("a b c")
    plain = engine.generate(["hello", ids], params, use_tqdm=False)
    dicts = engine.generate([{"prompt": "hello"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert [(o.prompt, o.prompt_token_ids) for o in dicts] == [("hello", engine.tokenizer.encode("hello")),
                                                               (None, ids)]
    single = engine.generate({"prompt": "hello"}, params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


@pytest.mark.parametrize("bad, message", [
    ({}, "exactly one of 'prompt'"), ({"text": "hi"}, r"unknown keys \['text'\]"),
    ({"prompt": "hi", "prompt_token_ids": [5]}, "exactly one of"),
    ({"prompt": "hi", "cache_salt": "x"}, "cache_salt"),
    ({"prompt": [5, 6]}, r"\['prompt'\] must be a string"),
    ({"prompt_token_ids": "hi"}, r"\['prompt_token_ids'\] must be a list of token ids"),
])
def test_a_bad_dict_prompt_names_its_index_and_adds_nothing(engine, bad, message):
    with pytest.raises(ValueError, match=r"prompts\[1\]") as err:
        engine.generate([{"prompt": "fine"}, bad], use_tqdm=False)
    assert err.match(message)
    assert not engine.has_unfinished() and not engine.outputs.groups


def test_stream_checks_its_prompts_when_called_not_when_iterated(engine):
    with pytest.raises(ValueError, match=r"prompts\[0\] has unknown keys"):
        engine.stream([{"text": "hi"}])


def test_add_request_names_the_prompt_it_refuses(engine):
    with pytest.raises(ValueError, match=r"^prompt must be a string"):
        engine.add_request(3.5)


# -- chat ------------------------------------------------------------------------------------------------

def test_chat_template_overrides_the_checkpoints_and_takes_extra_variables(engine):
    template = "{% for m in messages %}[{{ m.role }}|{{ greeting }}]{{ m.content }}{% endfor %}"
    out = engine.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2),
                      use_tqdm=False, chat_template=template, chat_template_kwargs={"greeting": "yo"})[0]
    assert out.prompt == "[user|yo]hi"
    checkpoint = engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                             use_tqdm=False)
    assert checkpoint[0].prompt.startswith("<|im_start|>user")  # the override did not stick


def test_chat_without_a_generation_prompt_ends_after_the_last_message(engine):
    out = engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                      add_generation_prompt=False)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("option, value", [("chat_template", ""), ("chat_template", 3),
                                           ("chat_template_kwargs", ["x"])])
def test_bad_chat_option_is_named(engine, option, value):
    with pytest.raises(ValueError, match=option):
        engine.chat([{"role": "user", "content": "hi"}], use_tqdm=False, **{option: value})


def test_a_bad_message_names_its_conversation(engine):
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\]"):
        engine.chat([[{"role": "user", "content": "hi"}], [{"role": "user"}]], use_tqdm=False)


def test_chat_shows_a_progress_bar_by_default_as_vllm(engine, monkeypatch):
    bars = record_bars(monkeypatch)
    engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
    assert len(bars) == 1 and bars[0].closed


# -- the progress bar ---------------------------------------------------------------------------------------

class RecordingBar:
    """Stands in for tqdm: records the bar's position and total after every update."""

    def __init__(self, total, **kwargs):
        self.total, self.n, self.kwargs, self.closed, self.history = total, 0, kwargs, False, []

    def update(self, count):
        self.n += count
        self.history.append((self.n, self.total))

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def close(self):
        self.closed = True


def record_bars(monkeypatch) -> list[RecordingBar]:
    bars = []
    monkeypatch.setattr(outputs_module, "progress_bar_class",
                        lambda: lambda **kwargs: bars.append(RecordingBar(**kwargs)) or bars[-1])
    return bars


def test_the_progress_bar_counts_generated_tokens_and_ends_at_its_total(engine, monkeypatch):
    bars = record_bars(monkeypatch)
    base = engine.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[base[2]]),  # stops after 3 tokens
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2)]
    outs = engine.generate(["hello", "hello", "a b c"], params)
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    (bar,) = bars
    assert bar.kwargs["unit"] == "tok" and bar.history[0][1] == 8 + 8 + 2 * 6
    assert bar.history[-1] == (generated, generated) and bar.closed
    positions = [n for n, _ in bar.history]
    assert positions == sorted(positions) and len(set(positions)) >= 6  # moves with the tokens
    assert bar.history[0][0] > 0  # the first update already counts tokens, not finished requests


def test_progress_bar_is_plain_tqdm_outside_a_notebook_kernel(monkeypatch):
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert outputs_module.progress_bar_class() is tqdm.std.tqdm


def test_progress_bar_falls_back_to_plain_tqdm_in_a_kernel_without_ipywidgets(monkeypatch):
    shell = types.SimpleNamespace(config={"IPKernelApp": {}})
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ipywidgets" else real_find_spec(name, *a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bar_class = outputs_module.progress_bar_class()
        bar_class(total=2, file=io.StringIO()).close()
    assert bar_class is tqdm.std.tqdm
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert outputs_module.progress_bar_class() is tqdm.notebook.tqdm
