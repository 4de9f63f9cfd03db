import json
import shutil

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
