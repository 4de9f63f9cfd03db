"""A frozen eval protocol: one small JSON file that fixes the task file, the item ids, the shots, the prompt
template, max_new_tokens, the loop count, the sampling and the answer rule, so two configs are compared on
exactly the same inputs. It builds prompts and SamplingParams; it never runs a model.

A bad field is a ValueError naming the protocol file, the line of the field and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from pathlib import Path
from typing import Any

from benchmarks.eval_task import DEFAULT_TEMPLATE, AnswerRule, load_task, parse_answer_rule, shots_prefix
from request import SamplingParams

REQUIRED = ("name", "task", "ids", "max_new_tokens")
OPTIONAL = {"description": None, "task_source": None, "task_sha256": None, "line_ids": False, "shots": 0,
            "shots_file": None, "template": DEFAULT_TEMPLATE, "loops": None,
            "sampling": {"temperature": 0}, "extract": "last_number", "logprobs": 20}
SET_BY_PROTOCOL = ("max_tokens", "logprobs", "prompt_logprobs")  # SamplingParams fields it owns itself


@dataclasses.dataclass(frozen=True, slots=True)
class EvalItem:
    id: str
    prompt: str  # the shots prefix, then the item rendered
    gold: str    # normalised


@dataclasses.dataclass(frozen=True, slots=True)
class Protocol:
    """A loaded protocol. ids is None for "all" (every item, in file order). logprobs: the top N recorded
    per generated token for the KL estimate. loops None: the checkpoint's own loop count."""

    path: Path
    name: str
    task: Path
    ids: tuple[str, ...] | None
    max_new_tokens: int
    description: str | None
    task_source: str | None
    task_sha256: str | None
    line_ids: bool
    shots: int
    shots_file: Path | None
    template: str
    loops: int | None
    sampling: dict[str, Any]
    extract: AnswerRule
    logprobs: int

    def items(self) -> list[EvalItem]:
        """The protocol's items in its id order, prompts built."""
        task = load_task(self.task, self.line_ids)
        by_id = {item.id: item for item in task}
        ids = list(self.ids) if self.ids is not None else [item.id for item in task]
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} id(s) of the protocol are not in the task file "
                             f"{self.task}, first {missing[:5]}")
        prefix = shots_prefix(self.shots_file, self.shots, self.template) if self.shots else ""
        return [EvalItem(i, prefix + by_id[i].render(self.template), by_id[i].gold) for i in ids]

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling, max_tokens=self.max_new_tokens, logprobs=self.logprobs)

    def task_digest(self) -> str:
        return hashlib.sha256(self.task.read_bytes()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(path=str(self.path), task=str(self.task), extract=self.extract.to_json(),
                      ids=list(self.ids) if self.ids is not None else "all",
                      shots_file=str(self.shots_file) if self.shots_file else None)
        return fields


def load_protocol(path: str | Path, task: str | Path | None = None) -> Protocol:
    """Read and check a protocol file. `task` replaces its task path (a local copy of the data set)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"protocol file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}:1: a protocol is a JSON object, got {type(raw).__name__}")

    def where(field: str) -> str:
        return f"{path}:{line_of(text, field)}: {field}"

    for field in raw:
        if field not in REQUIRED and field not in OPTIONAL:
            raise ValueError(f"{where(field)} is not a protocol field; fields: "
                             f"{', '.join([*REQUIRED, *OPTIONAL])}")
    for field in REQUIRED:
        if field not in raw:
            raise ValueError(f"{path}: the protocol has no \"{field}\" (required: {', '.join(REQUIRED)})")
    values = {**OPTIONAL, **raw}
    base = path.parent
    for field in ("name", "task", "template"):
        _check(isinstance(values[field], str) and values[field], where(field), "must be a non-empty string")
    _check_template(values["template"], where("template"))
    _check(_is_int(values["max_new_tokens"], 1), where("max_new_tokens"), "must be an integer >= 1")
    _check(values["loops"] is None or _is_int(values["loops"], 1), where("loops"), "must be null or >= 1")
    _check(_is_int(values["shots"], 0), where("shots"), "must be an integer >= 0")
    _check(_is_int(values["logprobs"], 0), where("logprobs"), "must be an integer >= 0")
    _check(isinstance(values["line_ids"], bool), where("line_ids"), "must be true or false")
    _check(not values["shots"] or isinstance(values["shots_file"], str), where("shots"),
           "needs a shots_file (a task file of worked examples)")
    ids = _ids(values["ids"], where("ids"))
    task_path = Path(task) if task is not None else base / values["task"]
    if not task_path.is_file():
        hint = f" Get it from {values['task_source']}." if values["task_source"] else ""
        raise FileNotFoundError(f"{where('task')}: task file {task_path} does not exist.{hint} "
                                "Pass --task PATH (task= in Python) to read another copy.")
    protocol = Protocol(
        path=path, name=values["name"], task=task_path, ids=ids, max_new_tokens=values["max_new_tokens"],
        description=values["description"], task_source=values["task_source"],
        task_sha256=values["task_sha256"], line_ids=values["line_ids"], shots=values["shots"],
        shots_file=base / values["shots_file"] if values["shots_file"] else None, template=values["template"],
        loops=values["loops"], sampling=_sampling(values["sampling"], where("sampling")),
        extract=parse_answer_rule(values["extract"], where("extract")), logprobs=values["logprobs"])
    digest = protocol.task_digest() if protocol.task_sha256 is not None else None
    if digest != protocol.task_sha256:
        raise ValueError(f"{where('task_sha256')}: task file {task_path} has sha256 {digest}, not the "
                         f"protocol's {protocol.task_sha256}")
    try:
        protocol.sampling_params()
    except ValueError as err:
        raise ValueError(f"{where('sampling')}: {err}") from None
    return protocol


def line_of(text: str, field: str) -> int:
    """1-based line of a top-level field's key in the protocol's text (1 when not found)."""
    match = re.search(rf'"{re.escape(field)}"\s*:', text)
    return text.count("\n", 0, match.start()) + 1 if match else 1


def _check(ok: object, where: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{where} {what}")


def _check_template(template: str, where: str) -> None:
    """A template names {question} and no other field ({{ and }} are literal braces), so that rendering an
    item never fails on a field it lacks."""
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as err:
        raise ValueError(f"{where} {template!r} is not a format string: {err} (write {{{{ and }}}} for "
                         "literal braces)") from None
    for name, spec, conversion in fields:
        _check(name == "question", where, f"{template!r} names the field {{{name}}}, which an item does not "
               "have: a template names {question} only (write {{ and }} for literal braces)")
        _check(not spec and not conversion, where, f"{template!r}: {{question}} takes no format spec or "
               "conversion")
    _check(fields, where, f"{template!r} must contain {{question}}")


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _ids(value: Any, where: str) -> tuple[str, ...] | None:
    if value == "all":
        return None
    ok = isinstance(value, list) and value and all(
        isinstance(i, (str, int)) and not isinstance(i, bool) for i in value)
    _check(ok, where, "must be \"all\" or a non-empty list of item ids")
    ids = tuple(str(i) for i in value)
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    _check(not repeated, where, f"lists id(s) {repeated[:5]} more than once")
    return ids


def _sampling(value: Any, where: str) -> dict[str, Any]:
    _check(isinstance(value, dict), where, "must be an object of SamplingParams fields")
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - set(SET_BY_PROTOCOL)
    for key in value:
        _check(key in fields, where, f"has {key!r}, which is not a SamplingParams field the protocol may set "
               f"(max_new_tokens and logprobs are protocol fields); fields: {', '.join(sorted(fields))}")
    return dict(value)
