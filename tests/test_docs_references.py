"""What README.md and docs/*.md cite exists: every repository path (`model/ouro.py`, `docs/ouro.md`, a
directory, a glob), every results file named bare (`latency-2026-12-04-f4b3c29.md`), every `file.py: name`
and `tests/x.py::test_name`, every dotted name rooted at one of our modules (`model.ouro.OuroLayer`,
`python -m benchmarks.latency`, `from engine import Engine`), each name defined where the doc says.

A path counts as the repository's when its first part is a top-level entry of it; names are looked up in the
module's source (top-level definitions, imports, and a class's attributes), never by importing it.
Checkpoint tensor names (`model.norm.weight`, `model.layers.{i}...`) are not code and are left alone."""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
TOP = {p.name for p in ROOT.iterdir() if p.name == ".ci" or not p.name.startswith(".")}
PACKAGES = {p.stem for p in ROOT.glob("*.py")} | {p.parent.name for p in ROOT.glob("*/__init__.py")}
EXTENSIONS = {"py", "md", "json", "jsonl", "sh", "toml", "ipynb", "txt"}

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
PATH = re.compile(r"(?<![\w./$~:-])((?:[\w.-]+/)+[\w.*-]*)")
RESULT_NAME = re.compile(r"(?<![\w./-])([A-Za-z][\w.+-]*-20\d\d-\d\d-\d\d[\w.+-]*)")
DOTTED = re.compile(r"(?<![\w./$-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(sorted(PACKAGES)))
FILE_NAME = re.compile(r"^\s*((?:[\w.-]+/)*[\w-]+\.py)(?::\s+|::)([A-Za-z_][\w.]*)")
NODE_ID = re.compile(r"((?:[\w.-]+/)*[\w-]+\.py)::([A-Za-z_]\w*)")
RUN_MODULE = re.compile(r"python3? -m ([\w.]+)")
FROM_IMPORT = re.compile(r"^\s*from ([\w.]+) import ([\w, ]+)", re.M)


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def repository_paths(text: str) -> set[str]:
    found = set()
    for match in PATH.findall(text):
        path = match.rstrip(".")
        if path.split("/")[0] in TOP:
            found.add(path)
    return found


def path_exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def result_names(text: str) -> set[str]:
    return {name.rstrip(".") for name in RESULT_NAME.findall(text)}


def result_exists(name: str) -> bool:
    if name.rsplit(".", 1)[-1] in ("md", "json"):
        return (RESULTS / name).is_file()
    return (RESULTS / f"{name}.md").is_file() or (RESULTS / f"{name}.json").is_file()


def module_file(path: str) -> Path | None:
    """A `file.py` as cited: relative to the root, or a bare name found once anywhere in the repository."""
    if (ROOT / path).is_file():
        return ROOT / path
    if "/" not in path:
        matches = [p for p in ROOT.rglob(path) if ".git" not in p.parts]
        return matches[0] if len(matches) == 1 else None
    return None


@cache
def definitions(module: Path) -> dict[str, set[str]]:
    """The module's top-level names, each mapped to its attributes when it is a class."""
    names: dict[str, set[str]] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                names[node.name] = class_attributes(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = set()
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update({n.id: set() for n in ast.walk(target) if isinstance(n, ast.Name)})
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", [])
                      + [s for h in getattr(node, "handlers", []) for s in h.body])

    visit(ast.parse(module.read_text()).body)
    return names


def class_attributes(node: ast.ClassDef) -> set[str]:
    attributes = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attributes.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return attributes


def defines(module: Path, dotted: str) -> bool:
    """Whether `module` defines dotted's first name (and, for a class, its second as an attribute)."""
    first, *rest = dotted.split(".")
    names = definitions(module)
    if first not in names:
        return False
    return not rest or not names[first] or rest[0] in names[first]


def resolves(dotted: str) -> bool:
    """A dotted name rooted at one of our modules: packages, then a module, then names the module defines."""
    parts, here = dotted.split("."), ROOT
    while parts and (here / parts[0] / "__init__.py").is_file():
        here = here / parts.pop(0)
    if not parts:
        return True
    if (here / f"{parts[0]}.py").is_file():
        module = here / f"{parts.pop(0)}.py"
        return not parts or defines(module, ".".join(parts))
    return here != ROOT and defines(here / "__init__.py", ".".join(parts))


def checkpoint_tensor(text: str, match: re.Match) -> bool:
    return match.group(1).endswith((".weight", ".bias")) or text.startswith(".{", match.end())


def missing_references(path: Path) -> list[str]:
    text = path.read_text()
    prose = without_code_blocks(text)
    missing = [p for p in sorted(repository_paths(text)) if not path_exists(p)]
    missing += [n for n in sorted(result_names(text)) if not result_exists(n)]
    cited_names = [m.groups() for span in re.findall(r"`([^`]+)`", prose) if (m := FILE_NAME.match(span))]
    cited_names += NODE_ID.findall(text)
    for file, name in cited_names:
        module = module_file(file)
        if module is None or not defines(module, name):
            missing.append(f"{file}: {name}")
    dotted = [m.group(1) for m in DOTTED.finditer(prose) if not checkpoint_tensor(prose, m)]
    dotted += [m for m in RUN_MODULE.findall(text) if m.split(".")[0] in PACKAGES]
    for module, names in FROM_IMPORT.findall(text):
        if module.split(".")[0] in PACKAGES:
            dotted += [module] + [f"{module}.{n.strip()}" for n in names.split(",") if n.strip()]
    missing += [d for d in sorted(set(dotted))
                if d.rsplit(".", 1)[-1] not in EXTENSIONS and not resolves(d)]
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_name_a_doc_cites_exists(doc):
    assert missing_references(doc) == []


def test_the_parser_sees_each_kind_of_reference_and_flags_what_is_missing(tmp_path):
    doc = tmp_path / "cited.txt"
    doc.write_text(
        "See `model/ouro.py` and docs/ouro.md, model/no_such.py and benchmarks/results/latency-*.md;\n"
        "results latency-2026-12-04-f4b3c29.md and gone-2026-01-01-abc1234.json.\n"
        "`runner/loop_driver.py: run_loops`, `runner/loop_driver.py: no_such_function`,\n"
        "`model/ouro.py: OuroLayer.no_such_attribute`, tests/test_blocks.py::no_such_test,\n"
        "model.ouro.OuroLayer, triton_runtime.launch.no_such_name, model.norm.weight, vllm/x/ouro.py.\n"
        "```bash\npython -m benchmarks.latency\npython -m benchmarks.no_such_benchmark\n```\n"
        "```python\nfrom engine import Engine, no_such_export\n```\n")
    assert missing_references(doc) == [
        "model/no_such.py", "gone-2026-01-01-abc1234.json", "runner/loop_driver.py: no_such_function",
        "model/ouro.py: OuroLayer.no_such_attribute", "tests/test_blocks.py: no_such_test",
        "benchmarks.no_such_benchmark", "engine.no_such_export", "triton_runtime.launch.no_such_name"]
