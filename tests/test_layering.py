"""The import graph reads top-down: every engine module imports only the layers below it (function-level
imports included), so no package cycle can come back.

    server/                  the HTTP server and lm-eval's model: above the engine, which never imports it
                             (but engine.py's cli_serve, the command line that starts it)
    engine.py
    runner/                  step execution: runner, loop driver, CUDA graphs, sampler
    scheduler/, engine_config.py
    cache/                   KV memory, sized and addressed by the model's slot map (model/looped.py)
    model/                   the network and its kernels, and the looped-model interface
    attention/               backends and their kernels, and the KV codecs they store and read with
    request.py               the shared request and batch types: imports nothing of the engine
"""

import ast
from pathlib import Path

from tests.conftest import ROOT

ENGINE = {"engine", "engine_config", "request", "runner", "scheduler", "cache", "model", "attention"}
LAYERS = ENGINE | {"server"}
# engine.py's command line (the design's cli.py, once engine.py is split) starts the server: these functions
# of engine.py may import it.
CLI_FUNCTIONS = {"cli_serve"}
ALLOWED = {
    "request": set(),
    "attention": {"attention"},
    "cache": {"cache", "model", "attention", "request"},
    "model": {"model", "attention", "request"},
    "scheduler": {"scheduler", "cache", "request"},
    "engine_config": {"model", "cache", "attention", "request"},
    "runner": {"runner", "engine_config", "model", "cache", "attention", "request"},
    "engine": ENGINE,
    "server": LAYERS,
}


def imported_packages(source: str, skip_functions: set[str] = frozenset()) -> set[str]:
    """The top-level names a module's source imports, anywhere in it but in its top-level functions named in
    `skip_functions`."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body
                 if not (isinstance(node, ast.FunctionDef) and node.name in skip_functions)]
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
        imported = imported_packages(source, CLI_FUNCTIONS if path == "engine.py" else set())
        for package in sorted(imported & LAYERS - ALLOWED[layer] - {layer}):
            found.append(f"{path} imports {package}")
    return found


def engine_sources() -> dict[str, str]:
    paths = [ROOT / f"{name}.py" for name in ("engine", "engine_config", "request")]
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
           "request.py": "from model.config import OuroConfig\n",
           "runner/x.py": "from scheduler import scheduler\n",
           "scheduler/scheduler.py": "import torch\nfrom request import Request\n",
           "runner/y.py": "from server.app import serve\n",
           "engine.py": "def main():\n    import server.app\n\ndef cli_serve():\n    import server.app\n",
           "server/app.py": "from engine import Engine\nfrom runner import model_runner\n"}
    assert violations(bad) == ["cache/blocks.py imports scheduler", "engine.py imports server",
                               "model/ouro.py imports cache", "request.py imports model",
                               "runner/x.py imports scheduler", "runner/y.py imports server"]
