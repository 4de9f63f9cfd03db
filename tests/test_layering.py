"""The import graph reads top-down: every engine module imports only the layers below it (function-level
imports included), so no package cycle can come back.

    cli.py                   the command line: generate, eval (benchmarks/paired_eval.py), serve (server/)
    server/                  the HTTP server and lm-eval's model: above the engine, which never imports it
    engine.py
    stepping.py              one engine iteration, synchronous or overlapped
    outputs.py               which call reads each request's outputs
    runner/                  step execution: runner, loop driver, CUDA graphs, sampler
    scheduler/, engine_config.py
    cache/, model/           KV memory; the network and its kernels (neither imports the other)
    attention/               backends and their kernels, and the KV codecs they store and read with
    request.py               the shared request and batch types: imports exit_policy.py only
    exit_policy.py           the exit policies: their strings, the readout, the loop traces; imports nothing

A module's `if __name__ == "__main__":` block is a program run on top of it, not part of the module:
engine.py's hands `python engine.py ...` to cli.py.
"""

import ast
from pathlib import Path

from tests.conftest import ROOT

ENGINE = {"engine", "stepping", "outputs", "engine_config", "request", "exit_policy", "runner", "scheduler",
          "cache", "model", "attention"}
LAYERS = ENGINE | {"server", "cli", "benchmarks"}
SHARED = {"request", "exit_policy"}  # the types every layer may speak of
ALLOWED = {
    "exit_policy": set(),
    "request": {"exit_policy"},
    "attention": {"attention"} | SHARED,
    "cache": {"cache", "attention"} | SHARED,
    "model": {"model", "attention"} | SHARED,
    "scheduler": {"scheduler", "cache"} | SHARED,
    "engine_config": {"model", "cache", "attention"} | SHARED,
    "runner": {"runner", "engine_config", "model", "cache", "attention"} | SHARED,
    "outputs": {"runner"} | SHARED,
    "stepping": {"outputs", "runner", "scheduler"} | SHARED,
    "engine": ENGINE,
    "server": ENGINE,
    "cli": LAYERS,
}


def is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":`"""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and [getattr(c, "value", None) for c in test.comparators] == ["__main__"])


def imported_packages(source: str) -> set[str]:
    """The top-level names a module's source imports, anywhere in it but in its `__main__` block."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if not is_main_guard(node)]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def violations(sources: dict[str, str]) -> list[str]:
    """'path imports package' for every import of an engine package that the module's layer may not make."""
    found = []
    for path, source in sorted(sources.items()):
        layer = Path(path).parts[0].removesuffix(".py")
        imported = imported_packages(source)
        for package in sorted(imported & LAYERS - ALLOWED[layer] - {layer}):
            found.append(f"{path} imports {package}")
    return found


def engine_sources() -> dict[str, str]:
    paths = [ROOT / f"{name}.py" for name in ("cli", "engine", "stepping", "outputs", "engine_config",
                                                  "request", "exit_policy")]
    for package in ("runner", "scheduler", "cache", "model", "attention", "server"):
        paths += sorted((ROOT / package).rglob("*.py"))
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def test_no_module_imports_a_layer_above_it():
    sources = engine_sources()
    assert len(sources) > 25 and "runner/loop_driver.py" in sources and "server/app.py" in sources
    assert violations(sources) == []


def test_the_check_catches_upward_and_sideways_imports():
    bad = {"cache/blocks.py": "from scheduler.scheduler import Scheduler\n",
           "model/ouro.py": "def f():\n    import cache.kv_pool\n",
           "request.py": "from model.config import OuroConfig\nfrom exit_policy import ExitPolicy\n",
           "exit_policy.py": "from request import LoopTrace\n",
           "runner/x.py": "from scheduler import scheduler\n",
           "scheduler/scheduler.py": "import torch\nfrom request import Request\n",
           "runner/y.py": "from server.app import serve\n",
           "engine.py": "def main():\n    import server.app\n\nif __name__ == '__main__':\n    import cli\n",
           "server/app.py": "from engine import Engine\nfrom runner import model_runner\nimport cli\n",
           "cli.py": "from server.app import serve\nfrom benchmarks.paired_eval import main\n"}
    assert violations(bad) == ["cache/blocks.py imports scheduler", "engine.py imports server",
                               "exit_policy.py imports request",
                               "model/ouro.py imports cache", "request.py imports model",
                               "runner/x.py imports scheduler", "runner/y.py imports server",
                               "server/app.py imports cli"]
