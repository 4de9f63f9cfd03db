"""The Engine's Python surface: stream, chat, step/abort, input order, errors, close."""

import pytest

from engine import Engine, SamplingParams


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
    engine.close()
    assert not hasattr(engine, "kv_pool") and not hasattr(engine, "model")
