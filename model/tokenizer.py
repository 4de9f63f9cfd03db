"""tokenizer.json through `tokenizers`, the chat template through jinja2 (as transformers renders it),
and the stop ids from generation_config.json and config.json."""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Ouro's chat format (ChatML), used when the checkpoint ships no chat_template."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = _HFTokenizer.from_file(str(path))
        self.config = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template = self.config.get("chat_template")
        generation = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        stop = _ids(generation.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stop))
        self._template = None
        self._token_texts: dict[int, str] = {}

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
        """The conversation rendered with `chat_template` (a jinja2 string) if given, else the checkpoint's
        template, else ChatML."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content'")
        if chat_template is None and not self.chat_template:
            return render_chatml(messages, add_generation_prompt)
        template = self._compile(chat_template) if chat_template is not None else self._compiled_template()
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._special("bos_token"), eos_token=self._special("eos_token"), **kwargs)

    def _special(self, key: str) -> str:
        value = self.config.get(key) or ""
        return value.get("content", "") if isinstance(value, dict) else value

    def _compiled_template(self):
        if self._template is None:
            self._template = self._compile(self.chat_template)
        return self._template

    @staticmethod
    def _compile(source: str):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                      indent=indent)
        return env.from_string(source)
