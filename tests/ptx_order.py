"""Checks a PDL kernel's PTX against attention/pdl.py's rules: before its first `griddepcontrol.wait`, no
global store or atomic, and every global load or prefetch addresses memory through allowed pointer parameters
only (weights).

PTX before the wait is read in text order. A register depends on the pointer parameters that the
instructions defining it read, transitively from `ld.param` (a loaded value on the pointer it was loaded
through); an address may mix in integer parameters (sizes, strides), never another pointer.
"""

from __future__ import annotations

import re

PARAM = re.compile(r"\w+_param_(\d+)")
REGISTER = re.compile(r"%[\w.]+")
READS = ("ld.", "ldu.", "prefetch", "cp.async", "tex.")
WRITES = ("st.", "atom.", "red.", "cp.reduce", "multimem.")


def _instructions(ptx: str) -> list[str]:
    """The instructions of ptx in order: comments, directives and labels dropped, `a; b;` lines split, the
    guard predicate (`@%p1`) removed."""
    out = []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if not line or line.startswith(".") or line.endswith(":") or line in ("{", "}", ")", "("):
            continue
        out += [re.sub(r"^@!?%\w+\s+", "", part.strip()) for part in line.split(";") if part.strip()]
    return out


def _operands(text: str) -> list[str]:
    """Comma-separated operands, keeping `{..}` vectors and `[..]` addresses whole."""
    operands, depth, current = [], 0, ""
    for char in text:
        depth += char in "{["
        depth -= char in "}]"
        if char == "," and depth == 0:
            operands.append(current.strip())
            current = ""
        else:
            current += char
    return operands + [current.strip()] if current.strip() else operands


def pdl_order_violations(ptx: str, pointer_params: dict[int, str], allowed: set[str]) -> list[str]:
    """What breaks the rules before the first griddepcontrol.wait, each offending instruction with the pointer
    parameters it reads through. pointer_params: the kernel's pointer parameters by PTX parameter index;
    allowed: the names of those that may be read before the wait. A missing wait or launch_dependents is a
    violation too."""
    required = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")
    missing = [f"no {op}" for op in required if op not in ptx]
    if missing:
        return missing
    depends: dict[str, set[str]] = {}

    def on(operand: str) -> set[str]:
        params = {pointer_params[int(i)] for i in PARAM.findall(operand) if int(i) in pointer_params}
        return params.union(*(depends.get(r, set()) for r in REGISTER.findall(operand)))

    violations = []
    for instruction in _instructions(ptx):
        opcode, _, rest = instruction.partition(" ")
        operands = _operands(rest)
        if opcode.startswith("griddepcontrol.wait"):
            return violations
        global_space = ".shared" not in opcode and ".local" not in opcode and ".param" not in opcode
        if opcode.startswith(WRITES) and global_space:
            violations.append(f"{instruction}: a write before the wait")
            continue
        if opcode.startswith(READS) and (global_space or opcode.startswith("cp.async")):
            address = on(operands[1] if opcode.startswith("cp.async") else
                         next(op for op in operands if op.startswith("[")))
            if address - allowed:
                violations.append(f"{instruction}: reads through {sorted(address - allowed)}")
        if operands and not opcode.startswith(("st.", "prefetch", "red.", "bra", "cp.async")):
            value = set().union(*(on(op) for op in operands[1:]))
            for register in REGISTER.findall(operands[0]):
                depends[register] = value
    return violations
