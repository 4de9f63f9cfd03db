"""What the server says about its tokenizer: vLLM's /tokenizer_info body, which lm-eval's remote tokenizer
reads (with /tokenize and /detokenize) so that it needs no tokenizer of its own, and the special tokens
lm-eval conditions an empty context on, resolved the way its remote tokenizer resolves them."""

from __future__ import annotations

from typing import Any

from model.tokenizer import Tokenizer


def special_token(tokenizer: Tokenizer, key: str) -> str | None:
    """tokenizer_config.json's bos_token / eos_token / pad_token as text (None where it has none)."""
    value = tokenizer.config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def prefix_token_id(tokenizer: Tokenizer) -> int | None:
    """The token lm-eval puts before an empty context: its remote tokenizer's `bos_token_id or
    eos_token_id`, each the first id of its text (so a BOS of id 0 falls through to the EOS, as there)."""
    ids = [tokenizer.encode(text)[:1] if text is not None else [] for text in
           (special_token(tokenizer, "bos_token"), special_token(tokenizer, "eos_token"))]
    bos, eos = (found[0] if found else None for found in ids)
    return bos or eos


def eos_token_id(tokenizer: Tokenizer) -> int | None:
    """lm-eval's end-of-text token: the first id of the EOS text, else the checkpoint's first stop id."""
    text = special_token(tokenizer, "eos_token")
    ids = tokenizer.encode(text) if text is not None else []
    if ids:
        return ids[0]
    return tokenizer.stop_token_ids[0] if tokenizer.stop_token_ids else None


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special_token(tokenizer, "bos_token"),
            "eos_token": special_token(tokenizer, "eos_token"),
            "pad_token": special_token(tokenizer, "pad_token"), "chat_template": template,
            "model_max_length": max_model_len}
