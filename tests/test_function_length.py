"""Functions stay short enough to read at a glance: none over 80 lines, except Triton kernels (a @triton.jit
body is one GPU program, kept whole so that its tiles and masks read in one place)."""

import ast

from tests.test_layering import repository_sources

MAX_LINES = 80


def is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def long_functions(sources: dict[str, str]) -> list[str]:
    found = []
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_outside_triton_kernels_is_over_80_lines():
    assert long_functions(repository_sources()) == []


def test_the_check_finds_a_long_function_and_spares_a_kernel():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    sources = {"a.py": f"def long():\n{body}", "k.py": f"@triton.jit\ndef kernel():\n{body}",
               "s.py": "def short():\n    return 1\n"}
    assert long_functions(sources) == ["a.py:1 long (81 lines)"]
