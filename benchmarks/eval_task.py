"""Eval tasks: JSONL items `{"id", "prompt" or "question", "answer"}`, the k-shot prefix, and the rule that
extracts an answer from a completion. It reads files and strings only; it never runs a model.

A bad line is a ValueError that names the file and the 1-based line. A gold answer is the text after its
last "####" when it has one (GSM8K's format), else the whole answer; numbers compare after normalisation
("1,000" = "1000", "72.0" = "72").
"""

from __future__ import annotations

import dataclasses
import decimal
import json
import re
from pathlib import Path
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
SHOT_SEPARATOR = "\n\n"


@dataclasses.dataclass(frozen=True, slots=True)
class TaskItem:
    """One item: its id, its text (a verbatim prompt, or a question for the protocol's template), the raw
    answer and where it came from."""

    id: str
    prompt: str | None
    question: str | None
    answer: str
    line: int

    @property
    def gold(self) -> str:
        return normalize_answer(self.answer.rpartition("####")[2] if "####" in self.answer else self.answer)

    def render(self, template: str) -> str:
        return self.prompt if self.prompt is not None else template.format(question=self.question)


@dataclasses.dataclass(frozen=True, slots=True)
class AnswerRule:
    """How a completion becomes an answer: the last number in it ("last_number"), or the last match of a
    regex (its first group when it has one)."""

    kind: str = "last_number"
    pattern: str | None = None

    def extract(self, text: str) -> str | None:
        if self.kind == "last_number":
            found = NUMBER.findall(text)
            return normalize_answer(found[-1]) if found else None
        matches = list(re.finditer(self.pattern, text))
        if not matches:
            return None
        last = matches[-1]
        return normalize_answer(last.group(1) if last.re.groups else last.group(0))

    def to_json(self) -> str | dict[str, str]:
        return self.kind if self.kind == "last_number" else {"regex": self.pattern}


def parse_answer_rule(spec: Any, where: str) -> AnswerRule:
    """"last_number" or {"regex": PATTERN}; `where` ("file:line: field") starts the error."""
    if spec == "last_number":
        return AnswerRule()
    if isinstance(spec, dict) and set(spec) == {"regex"} and isinstance(spec["regex"], str):
        try:
            re.compile(spec["regex"])
        except re.error as err:
            raise ValueError(f"{where} regex {spec['regex']!r} does not compile: {err}") from None
        return AnswerRule("regex", spec["regex"])
    raise ValueError(f"{where} must be \"last_number\" or {{\"regex\": PATTERN}}, got {spec!r}")


def normalize_answer(text: str) -> str:
    """Strip spaces, a leading "$" and a trailing "."; a number loses its commas and trailing zeros."""
    text = text.strip().lstrip("$").rstrip(".").strip()
    plain = text.replace(",", "")
    if NUMBER.fullmatch(plain):
        value = decimal.Decimal(plain)
        return format(value.normalize(), "f") if value != 0 else "0"
    return text


def load_task(path: str | Path, line_ids: bool = False) -> list[TaskItem]:
    """Every item of a JSONL task file. With line_ids (GSM8K's test.jsonl has no ids) an item's id is its
    0-based line number and an "id" field is refused."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    items: list[TaskItem] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        item = parse_item(text, f"{path}:{number}", number, str(number - 1) if line_ids else None)
        if item.id in seen:
            raise ValueError(f"{path}:{number}: id {item.id!r} was already used on line {seen[item.id]}")
        seen[item.id] = number
        items.append(item)
    if not items:
        raise ValueError(f"task file {path} has no items")
    return items


def parse_item(text: str, where: str, line: int, line_id: str | None = None) -> TaskItem:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg}, column {err.colno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: an item must be a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {"id", "prompt", "question", "answer"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; an item has id, prompt or question, "
                         "and answer")
    if line_id is not None and "id" in raw:
        raise ValueError(f"{where}: this file's items are numbered by line (line_ids): no \"id\" field")
    item_id = line_id if line_id is not None else raw.get("id")
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or item_id == "":
        raise ValueError(f"{where}: item needs an \"id\" (a string or an integer), got {item_id!r}")
    if ("prompt" in raw) == ("question" in raw):
        raise ValueError(f"{where}: item needs exactly one of \"prompt\" and \"question\"")
    text_field = "prompt" if "prompt" in raw else "question"
    for name in (text_field, "answer"):
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name == "answer":
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: item field \"{name}\" must be a non-empty string, got {value!r}")
    return TaskItem(str(item_id), raw.get("prompt"), raw.get("question"), str(raw["answer"]), line)


def shots_prefix(path: str | Path, shots: int, template: str) -> str:
    """The first `shots` items of a shots file (a task file numbered by line), each rendered and followed by
    its answer (after a space for a question, directly after a verbatim prompt), then a blank line."""
    items = load_task(path, line_ids=True) if shots else []
    if len(items) < shots:
        raise ValueError(f"shots file {path} has {len(items)} items, fewer than the {shots} shots asked for")
    return "".join(item.render(template) + (" " if item.prompt is None else "") + item.answer + SHOT_SEPARATOR
                   for item in items[:shots])
