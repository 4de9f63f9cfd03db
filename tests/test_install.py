"""Install and CI parity: pyproject.toml declares the flat layout and its extras, .ci/run runs the README's
own commands, the CPU path imports and generates without triton, no example, benchmark or notebook edits
sys.path, and the docs cite only files that are in the repository."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from engine import Engine, SamplingParams
from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_declares_every_top_level_module_and_package():
    setuptools = PYPROJECT["tool"]["setuptools"]
    modules = sorted(p.stem for p in ROOT.glob("*.py"))
    packages = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("*/**/__init__.py")
                      if p.parts[len(ROOT.parts)] != "tests" and not p.parts[len(ROOT.parts)].startswith("."))
    assert sorted(setuptools["py-modules"]) == modules
    assert modules == ["cli", "engine", "engine_config", "exit_policy", "outputs", "request",
                       "request_checks", "stepping"]
    assert sorted(setuptools["packages"]) == packages
    assert "model/checkpoints/tiny-ouro" in {f"model/{d.rsplit('/', 1)[0]}" for d in
                                             setuptools["package-data"]["model"]}


def test_pyproject_has_the_console_script_python_floor_and_extras():
    project = PYPROJECT["project"]
    assert project["scripts"] == {"loop-engine": "cli:main"}
    assert project["requires-python"] == ">=3.11"
    assert {"dev", "notebook", "gpu", "ray"} <= set(project["optional-dependencies"])
    floors = dict(re.fullmatch(r"([\w-]+)>=([\d.]+)", d).groups() for d in project["dependencies"])
    assert floors["tokenizers"] == "0.21" and floors["huggingface_hub"] == "0.25"
    assert not any(d.startswith("triton") for d in project["dependencies"])  # no macOS/Windows wheels


def readme_commands() -> set[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return {line.strip() for block in blocks for line in block.splitlines()}


def test_ci_runs_the_readme_commands_verbatim():
    script = (ROOT / ".ci" / "run").read_text()
    commands = script.split("# -- README commands --\n")[1].split("# -- end of README commands --")[0]
    commands = [line for line in commands.splitlines() if line.strip()]
    assert commands[0] == 'pip install -e ".[dev]"' and commands[-1] == "python -m pytest -q"
    assert [c for c in commands if c not in readme_commands()] == []


@pytest.mark.skipif(not os.environ.get("CI") and shutil.which("loop-engine") is None,
                    reason="the console script is there after pip install -e . (CI installs it)")
def test_console_script_runs_generate():
    result = subprocess.run(["loop-engine", "generate", "--device", "cpu", "--max-tokens", "4"],
                            capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("A looped language model") and "tok/s" in result.stderr


WITHOUT_TRITON = """
import json, sys
sys.modules["triton"] = None  # as if not installed: `import triton` raises ModuleNotFoundError
import attention, engine
out = engine.Engine(device="cpu", verbose=False).generate(
    ["A looped language model"], engine.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
try:
    engine.Engine(device="cpu", attention="triton", verbose=False)
except ValueError as err:
    error = str(err)
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "backends": attention.available(), "error": error,
                  "loaded": sorted(m for m in sys.modules if m.startswith("triton."))}))
"""


def test_engine_imports_and_generates_without_triton_and_names_it_when_asked_for():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    with Engine(device="cpu", verbose=False) as engine:
        expected = engine.generate(["A looped language model"], SamplingParams(temperature=0, max_tokens=8),
                                   use_tqdm=False)[0].outputs[0].token_ids
    assert report["tokens"] == expected
    assert report["backends"] == ["torch"] and report["loaded"] == []
    assert "attention='triton' needs the triton package" in report["error"]


def test_no_example_benchmark_or_notebook_edits_sys_path():
    sources = {p: p.read_text() for p in [*ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/*.py")]}
    for notebook in (ROOT / "examples").glob("*.ipynb"):
        cells = json.loads(notebook.read_text())["cells"]
        sources[notebook] = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert len(sources) > 20
    edits = re.compile(r"sys\.path\s*(\.(insert|append|extend)\(|\[|\+?=)")
    assert [str(p.relative_to(ROOT)) for p, text in sources.items() if edits.search(text)] == []
    assert edits.search("sys.path.insert(0, root)") and edits.search("sys.path[:0] = [root]")


# Names the docs use for files a command writes, not files they cite.
WRITTEN = {"out.md", "OUT/latency.md", "OUT/prefill.md", "LOGS/main_table.md", "LOGS/rerun_table.md"}


def cited_markdown(text: str) -> set[str]:
    return {m for m in re.findall(r"[\w./-]*\w\.md\b", text) if m not in WRITTEN}


def test_docs_and_docstrings_cite_only_files_in_the_repository():
    """README, docs/ and every module's text: each *.md they name is in the repository (at the root, in
    docs/, beside the citing file, or a benchmark result), and none points outside it."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.sh"),
             *(ROOT / "benchmarks").glob("*.sh"),
             *(p for p in ROOT.rglob("*.py")
               if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))]
    missing, outside = [], []
    for path in files:
        text = path.read_text()
        for name in cited_markdown(text):
            places = (ROOT / name, ROOT / "docs" / name, path.parent / name,
                      ROOT / "benchmarks" / "results" / name)
            if not any(place.is_file() for place in places):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
        outside += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"\.\./shared|/work/\w+", text)]
    assert missing == [] and outside == []
