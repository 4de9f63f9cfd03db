import json
import shutil
import time

import pytest

from model import chat_template
from model.tokenizer import Tokenizer, render_chatml


def test_round_trip_and_special_ids(tiny_checkpoint):
    tok = Tokenizer(tiny_checkpoint)
    text = "A looped model, 12 + 30 = 42."
    assert tok.decode(tok.encode(text)) == text
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]


def test_stop_ids_come_from_generation_and_model_config(tiny_checkpoint):
    assert set(Tokenizer(tiny_checkpoint).stop_token_ids) == {0, 2}


def test_chat_template_renders_chatml(tiny_checkpoint):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tok = Tokenizer(tiny_checkpoint)
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages) == expected
    assert render_chatml(messages) == expected


def test_builtin_chatml_is_used_without_a_template(tiny_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(path)
    assert tok.chat_template is None
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def _with_tokenizer_config(tiny_checkpoint, tmp_path, **changes):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(changes)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


MESSAGES = [{"role": "user", "content": "x"}]


def test_named_templates_pick_default_a_name_or_tool_use(tiny_checkpoint, tmp_path):
    named = [{"name": "default", "template": "D{{ messages[0].content }}"},
             {"name": "terse", "template": "T{{ messages[0].content }}"},
             {"name": "tool_use", "template": "U{{ tools | tojson }}"}]
    tok = Tokenizer(_with_tokenizer_config(tiny_checkpoint, tmp_path, chat_template=named))
    assert tok.apply_chat_template(MESSAGES) == "Dx"
    assert tok.apply_chat_template(MESSAGES, chat_template="terse") == "Tx"
    assert tok.apply_chat_template(MESSAGES, tools=["f"]) == 'U["f"]'
    assert tok.apply_chat_template(MESSAGES, chat_template="S{{ messages | length }}") == "S1"


def test_named_templates_without_a_default_ask_for_a_name(tiny_checkpoint, tmp_path):
    path = _with_tokenizer_config(tiny_checkpoint, tmp_path, chat_template=[{"name": "a", "template": "A"}])
    with pytest.raises(ValueError, match=r"tokenizer_config\.json has named chat templates \(a\) and no "):
        Tokenizer(path).apply_chat_template(MESSAGES)


@pytest.mark.parametrize("template, message", [
    ("{% if %}", "TemplateSyntaxError"), ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ messages[3].content }}", "UndefinedError")])
def test_template_errors_are_value_errors_naming_the_file(tiny_checkpoint, tmp_path, template, message):
    tok = Tokenizer(_with_tokenizer_config(tiny_checkpoint, tmp_path, chat_template=template))
    with pytest.raises(ValueError, match=rf"chat template of .*tokenizer_config\.json: .*{message}"):
        tok.apply_chat_template(MESSAGES)


def test_a_template_that_never_ends_or_grows_without_bound_is_stopped(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 0.2)
    monkeypatch.setattr(chat_template, "TEMPLATE_MAX_CHARS", 10_000)
    tok = Tokenizer(tiny_checkpoint)
    silent_loop = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ValueError, match="rendering took longer than 0.2 s"):
        tok.apply_chat_template(MESSAGES, chat_template=silent_loop)
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="output exceeds 10000 characters"):
        tok.apply_chat_template(MESSAGES, chat_template="{% for i in range(99999) %}abc{% endfor %}")
    with pytest.raises(ValueError, match=rf"needed more than {chat_template.TEMPLATE_MEMORY_BYTES} bytes"):
        tok.apply_chat_template(MESSAGES, chat_template="{% set big = 'a' * 10**9 %}")
    assert tok.apply_chat_template(MESSAGES) == render_chatml(MESSAGES)  # a fresh renderer, as before


@pytest.mark.parametrize("file, changes, message", [
    ("tokenizer_config.json", {"chat_template": {"default": "x"}}, "'chat_template' must be a string or"),
    ("generation_config.json", {"eos_token_id": True}, "'eos_token_id' must be a token id"),
    ("config.json", {"eos_token_id": [0, "2"]}, "'eos_token_id' must be a token id")])
def test_malformed_tokenizer_fields_name_the_file(tiny_checkpoint, tmp_path, file, changes, message):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    data = json.loads((path / file).read_text())
    data.update(changes)
    (path / file).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{file.replace('.', '[.]')}: .*{message}"):
        Tokenizer(path)


def test_an_interrupted_render_leaves_no_reply_behind_for_the_next(tiny_checkpoint, monkeypatch):
    """A Ctrl-C while the renderer works stops that process, so the next render never reads the reply that
    was meant for the interrupted one."""
    tok = Tokenizer(tiny_checkpoint)
    wait = chat_template._Renderer.wait

    def interrupted(self, seconds, origin, doing, if_died):
        if doing == "rendering":
            raise KeyboardInterrupt
        return wait(self, seconds, origin, doing, if_died)

    monkeypatch.setattr(chat_template._Renderer, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tok.apply_chat_template(MESSAGES, chat_template="first")
    monkeypatch.setattr(chat_template._Renderer, "wait", wait)
    assert tok.apply_chat_template(MESSAGES, chat_template="second") == "second"
