"""The import graph reads top-down: every module imports only the layers below it (function-level imports
included), no kernel file imports another package's kernels, and no import cycle comes back, between
packages or between modules.

    tests/                   the suite: may import anything; nothing imports it
    cli.py                   the command line: generate, eval (benchmarks/paired_eval.py), serve (server/)
    benchmarks/, examples/   run the engine (and may start the server); neither imports the other
    server/                  the HTTP server and lm-eval's model: above the engine, which never imports it
    engine.py                the Engine, the Python API
    request_checks.py        a request's params against the engine's options
    stepping.py              one engine iteration, synchronous or overlapped
    outputs.py               which call reads each request's outputs
    runner/                  step execution: runner, loop driver, CUDA graphs, sampler
    scheduler/, engine_config.py
    cache/                   KV memory, sized and addressed by the model's slot map (model/looped.py)
    model/                   the network and its kernels, and the looped-model interface
    attention/               backends and their kernels, and the KV codecs they store and read with
    triton_runtime/          the Triton runtime: launch, PDL, stream, workspace, jit helpers kernels share
    request.py               the shared request and batch types
    exit_policy.py           the exit policies: their strings, the readout, the loop traces
    (triton_runtime/ and exit_policy.py, the ground floor, import nothing of the engine; request.py only
    exit_policy.py)

A module's `if __name__ == "__main__":` block is a program run on top of it, not part of the module:
engine.py's hands `python engine.py ...` to cli.py.
"""

import ast
import dataclasses
from pathlib import Path

from tests.conftest import ROOT

ENGINE = {"engine", "request_checks", "stepping", "outputs", "engine_config", "request", "exit_policy",
          "runner", "scheduler", "cache", "model", "attention", "triton_runtime"}
SHARED = {"request", "exit_policy"}  # the types every layer may speak of
ALLOWED = {
    "exit_policy": set(),
    "request": {"exit_policy"},
    "triton_runtime": set(),
    "attention": {"triton_runtime"},
    # cache/ reads the model's slot map (model/looped.py) and nothing else of model/
    "cache": {"model", "attention", "triton_runtime"} | SHARED,
    "model": {"attention", "triton_runtime"} | SHARED,
    "scheduler": {"cache"} | SHARED,
    "engine_config": {"model", "cache", "attention"} | SHARED,
    "runner": {"engine_config", "model", "cache", "attention", "triton_runtime"} | SHARED,
    "outputs": {"runner"} | SHARED,
    "stepping": {"outputs", "runner", "scheduler"} | SHARED,
    "request_checks": {"engine_config", "model"} | SHARED,
    "engine": ENGINE,
    "server": ENGINE,
    "benchmarks": ENGINE | {"server"},
    "examples": ENGINE | {"server"},
    "cli": ENGINE | {"server", "benchmarks"},
    "tests": ENGINE | {"server", "benchmarks", "examples", "cli"},
}
LAYERS = set(ALLOWED)


def imports(source: str) -> list[tuple[str, bool]]:
    """(the dotted name imported; whether it is for type checking only) for every absolute import in a
    module's source but in its `__main__` block. `from a.b import c` gives a.b.c: c may be a module
    (resolve() falls back to a.b)."""
    tree = ast.parse(source)
    type_only = {id(inner) for node in ast.walk(tree) if is_type_checking(node)
                 for statement in node.body for inner in ast.walk(statement)}
    found = []
    for top in [node for node in tree.body if not is_main_guard(node)]:
        for node in ast.walk(top):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                names = []
            found += [(name, id(node) in type_only) for name in names]
    return found


def is_main_guard(node: ast.AST) -> bool:
    """Is this `if __name__ == "__main__":`?"""
    return isinstance(node, ast.If) and ast.unparse(node.test) in {"__name__ == '__main__'",
                                                                   '__name__ == "__main__"'}


def is_type_checking(node: ast.AST) -> bool:
    """Is this `if TYPE_CHECKING:`?"""
    return isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def layer_of(path: str) -> str:
    return Path(path).parts[0].removesuffix(".py")


def package_of(module: str) -> str:
    return module.split(".")[0]


def module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of a dotted name that is one of `modules` (None: not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


@dataclasses.dataclass(frozen=True)
class Import:
    path: str  # of the importing module
    module: str  # the importing module
    target: str  # the imported module
    type_only: bool  # under `if TYPE_CHECKING:`


def edges(sources: dict[str, str]) -> list[Import]:
    """Every import of one of our modules by another."""
    modules = {module_of(path) for path in sources} | LAYERS
    found = []
    for path, source in sorted(sources.items()):
        for name, type_only in imports(source):
            target = resolve(name, modules)
            if target is None or target == module_of(path):
                continue
            found.append(Import(path, module_of(path), target, type_only))
    return found


def violations(sources: dict[str, str]) -> list[str]:
    """'path imports package' for every import of another layer that the module's layer may not make."""
    found = set()
    for edge in edges(sources):
        layer, imported = layer_of(edge.path), package_of(edge.target)
        if imported != layer and imported not in ALLOWED[layer]:
            found.add(f"{edge.path} imports {imported}")
    return sorted(found)


def is_kernel_file(path: str) -> bool:
    parts = Path(path).parts
    return "kernels" in parts[:-1] or parts[-1].endswith("_kernel.py")


def kernel_violations(sources: dict[str, str]) -> list[str]:
    """'path imports module' for every import a kernel file makes outside its own package and the runtime."""
    return sorted({f"{edge.path} imports {edge.target}" for edge in edges(sources)
                   if is_kernel_file(edge.path) and package_of(edge.target) not in {layer_of(edge.path),
                                                                                    "triton_runtime"}})


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of a directed graph as [a, b, ..., a], or [] where there is none."""
    state: dict[str, str] = {}  # "open" while on the walk's path, then "done"

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path)):
                return found
        path.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return []


def module_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Who imports whom at run time: an import under `if TYPE_CHECKING:` never runs, so it closes no cycle
    (benchmarks/paired_markdown.py's, for a type hint); the layer checks above count it all the same."""
    graph: dict[str, set[str]] = {}
    for edge in edges(sources):
        if not edge.type_only:
            graph.setdefault(edge.module, set()).add(edge.target)
    return graph


def package_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph(sources).items():
        graph.setdefault(package_of(module), set()).update(package_of(t) for t in targets)
        graph[package_of(module)].discard(package_of(module))
    return graph


def repository_sources() -> dict[str, str]:
    """Every top-level module's and every package's source, by path."""
    paths = list(ROOT.glob("*.py"))
    for package in ROOT.iterdir():
        if (package / "__init__.py").is_file():
            paths += package.rglob("*.py")
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(paths)}


def test_every_package_and_top_level_module_has_a_layer():
    sources = repository_sources()
    assert {layer_of(path) for path in sources} == LAYERS


def test_no_module_imports_a_layer_above_it():
    sources = repository_sources()
    assert "runner/loop_driver.py" in sources and "server/app.py" in sources
    assert "triton_runtime/launch.py" in sources and "benchmarks/latency.py" in sources
    assert violations(sources) == []


def test_no_kernel_file_imports_another_packages_kernels():
    sources = repository_sources()
    kernels = [path for path in sources if is_kernel_file(path)]
    assert "cache/kvarn_pack_kernel.py" in kernels and "model/kernels/gemv.py" in kernels
    assert kernel_violations(sources) == []


def test_packages_import_each_other_without_a_cycle():
    assert cycle(package_graph(repository_sources())) == []


def test_modules_import_each_other_without_a_cycle():
    graph = module_graph(repository_sources())
    assert "attention.registry" in graph and "engine" in graph
    assert cycle(graph) == []


def test_the_checks_catch_upward_and_sideways_imports():
    bad = {"cache/blocks.py": "from scheduler.scheduler import Scheduler\n",
           "model/ouro.py": "def f():\n    import cache.kv_pool\n",
           "request.py": "from model.config import OuroConfig\nfrom exit_policy import ExitPolicy\n",
           "exit_policy.py": "from request import LoopTrace\n",
           "runner/x.py": "from scheduler import scheduler\n",
           "scheduler/scheduler.py": "import torch\nfrom request import Request\n",
           "scheduler/x.py": "import typing\nif typing.TYPE_CHECKING:\n    from model import config\n",
           "runner/y.py": "from server.app import serve\n",
           "triton_runtime/launch.py": "from attention import fp8\n",
           "engine.py": "def main():\n    import benchmarks.abba\n    import server.app\n\n"
                        "if __name__ == '__main__':\n    import cli\n",
           "server/app.py": "from engine import Engine\nfrom runner import model_runner\nimport cli\n",
           "cli.py": "from server.app import serve\nfrom benchmarks.paired_eval import main\n",
           "benchmarks/abba.py": "from engine import Engine\nfrom examples import train_tiny\n",
           "examples/train_tiny.py": "from tests.reference import ReferenceOuro\n"}
    assert violations(bad) == ["benchmarks/abba.py imports examples", "cache/blocks.py imports scheduler",
                               "engine.py imports benchmarks", "engine.py imports server",
                               "examples/train_tiny.py imports tests", "exit_policy.py imports request",
                               "model/ouro.py imports cache", "request.py imports model",
                               "runner/x.py imports scheduler", "runner/y.py imports server",
                               "scheduler/x.py imports model", "server/app.py imports cli",
                               "triton_runtime/launch.py imports attention"]


def test_the_checks_catch_a_kernel_importing_another_packages_kernels():
    bad = {"cache/kvarn_pack_kernel.py": "from attention.kernels.kvarn_decode import high_byte_offset\n"
                                         "from cache import kvarn\n"
                                         "from triton_runtime.pdl import pdl_supported\n",
           "model/kernels/fused.py": "from attention.kernels.prefill import _dot\n"
                                     "from model.kernels import gemv\n",
           "attention/kernels/kvarn_decode.py": "", "attention/kernels/prefill.py": "", "cache/kvarn.py": "",
           "model/kernels/gemv.py": "", "triton_runtime/pdl.py": ""}
    assert kernel_violations(bad) == ["cache/kvarn_pack_kernel.py imports attention.kernels.kvarn_decode",
                                      "model/kernels/fused.py imports attention.kernels.prefill"]


def test_the_checks_catch_a_cycle_through_a_function_level_import():
    sources = {"attention/base.py": "def load():\n    import attention.torch_backend\n",
               "attention/torch_backend.py": "from attention.base import AttentionBackend\n",
               "engine.py": "from model import ouro\n",
               "model/ouro.py": "def f():\n    from engine import Engine\n"}
    assert cycle(module_graph(sources)) == ["attention.base", "attention.torch_backend", "attention.base"]
    assert cycle(package_graph(sources)) == ["engine", "model", "engine"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_an_import_for_type_checking_only_closes_no_cycle():
    sources = {"benchmarks/report.py": "from benchmarks.markdown import render\n",
               "benchmarks/markdown.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                         "    from benchmarks.report import Report\n"}
    assert [(edge.module, edge.target, edge.type_only) for edge in edges(sources)] == [
        ("benchmarks.markdown", "benchmarks.report", True),
        ("benchmarks.report", "benchmarks.markdown", False)]
    assert cycle(module_graph(sources)) == []
