"""tokenizer.json through `tokenizers`, the chat template through jinja2 (as transformers renders it, in a
sandboxed process bounded in time, memory and output: model/chat_template.py), and the stop ids from
generation_config.json and config.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from model.chat_template import render_chat_template, start_renderer
from model.checkpoint_paths import checkpoint_file


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _ids(value: Any, path: Path, field: str) -> list[int]:
    ids = [] if value is None else list(value) if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: field {field!r} must be a token id or a list of them, got {value!r}")
    return ids


def _templates(value: Any, path: Path) -> str | dict[str, str] | None:
    """tokenizer_config.json's chat_template: one template, or HF's named list [{"name", "template"}]."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{path}: 'chat_template' must be a string or a list of {{\"name\", \"template\"}} "
                     f"objects, got {value!r:.200}")


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Ouro's chat format (ChatML), used when the checkpoint ships no chat_template."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        """The checkpoint's tokenizer files, each inside model_dir (model/checkpoint_paths.py); a missing or
        malformed one is an error naming it."""
        path = checkpoint_file(model_dir, "tokenizer.json", "the checkpoint's tokenizer")
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"{path} is not a tokenizer the tokenizers library can read: {err}") from None
        self.config_path = checkpoint_file(model_dir, "tokenizer_config.json",
                                           "the checkpoint's tokenizer config")
        self.config = _read_json(self.config_path)
        # One template, or several by name (transformers picks "default", or "tool_use" when given tools).
        self.chat_template = _templates(self.config.get("chat_template"), self.config_path)
        stop = []
        for name in ("generation_config.json", "config.json"):
            file = checkpoint_file(model_dir, name, f"the checkpoint's {name}")
            stop += _ids(_read_json(file).get("eos_token_id"), file, "eos_token_id")
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stop))
        self._token_texts: dict[int, str] = {}
        if self.chat_template is not None:
            start_renderer()  # in the background: the first chat does not wait for it

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text decoded alone (vLLM's Logprob.decoded_token), decoded once per token id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def stream(self, skip_special_tokens: bool = True) -> Callable[[int], str]:
        """A fresh incremental decoder (tokenizers' DecodeStream): fed each next token id, it returns the text
        that token adds, "" while a character's bytes are incomplete. Its pieces add up to a prefix of
        decode() of the same ids, all of it once the last character is complete."""
        decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: decoder.step(self._tok, token_id) or ""

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """The conversation as one prompt string, through the checkpoint's chat template (ChatML if it has
        none). chat_template: the name of one of the checkpoint's named templates, or a template's source,
        as in transformers. Template errors, and templates stopped at a bound of model/chat_template.py
        (wall time, memory, output), raise ValueError naming where the template came from and the bound."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content'")
        source, origin = self._pick_template(chat_template, kwargs.get("tools") is not None)
        if source is None:
            return render_chatml(messages, add_generation_prompt)
        context = dict(kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))
        return render_chat_template(source, context, origin)

    def _pick_template(self, chat_template: str | None, tools: bool) -> tuple[str | None, str]:
        """(template source or None for ChatML, where it comes from), as transformers chooses."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a template name or source, got {chat_template!r}")
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template], f"{chat_template!r} of {self.config_path}"
            if chat_template is None:
                for name in (["tool_use"] if tools else []) + ["default"]:
                    if name in templates:
                        return templates[name], f"{name!r} of {self.config_path}"
                raise ValueError(f"{self.config_path} has named chat templates ({', '.join(templates)}) and "
                                 "no 'default'; pass chat_template=<name>")
        if chat_template is not None:
            return chat_template, "given as chat_template"
        return templates, f"of {self.config_path}"

    def _special(self, key: str) -> str:
        value = self.config.get(key) or ""
        return value.get("content", "") if isinstance(value, dict) else value
