"""What a compiled kernel's program can do before `griddepcontrol.wait`, read from its PTX: the check that a
Programmatic Dependent Launch kernel (triton_runtime/pdl.py) reads only what no earlier kernel of the step
writes before the wait, writes nothing to global memory before it, and reaches it on every path."""

from __future__ import annotations

import dataclasses
import re

WAIT = "griddepcontrol.wait"
REGISTER = re.compile(r"%[A-Za-z]+\d+")
PARAM = re.compile(r"\[\s*(\w+_param_(\d+))\s*(?:\+\s*\d+\s*)?\]")
LABEL = re.compile(r"^(\$?[\w$]+):$")
LINE_DIRECTIVES = (".loc", ".file")  # debug line info: ends at the line's end, not with a semicolon
# Opcodes with no destination register: every register operand is read.
NO_DESTINATION = ("st.", "red.", "prefetch", "bra", "ret", "exit", "bar.", "barrier.", "griddepcontrol.",
                  "cp.async", "membar", "fence", "trap")


@dataclasses.dataclass(slots=True)
class Instruction:
    predicate: str | None
    opcode: str
    operands: list[str]


def pre_wait_violations(ptx: str, param_names: list[str], may_read: set[str]) -> list[str]:
    """Problems with the code a program runs before the wait: a path from the entry that ends without the
    wait, a global load whose address derives from a pointer argument (a name ending in _ptr) outside
    `may_read`, a global store, atomic or reduction. param_names: the kernel's PTX parameters in order."""
    blocks = _blocks(_instructions(ptx))
    params = _param_names(ptx, param_names)
    taint = _taint(blocks, params)
    early, exits = _before_wait(blocks)
    problems = [f"a path from the entry reaches {op} without {WAIT}" for op in exits]
    if not any(i.opcode.startswith(WAIT) for block in blocks for i in block):
        problems.append(f"no {WAIT}")
    for instruction in early:
        op = instruction.opcode
        if _writes_global(op):
            problems.append(f"{op} before the wait")
        elif _reads_global(op):
            address = instruction.operands[1] if op.startswith("cp.async") else instruction.operands[-1]
            sources = {name for name in _operand_taint(address, taint, params) if name.endswith("_ptr")}
            if not sources <= may_read:
                problems.append(f"{op} of {sorted(sources - may_read)} before the wait")
    return problems


def _instructions(ptx: str) -> list[Instruction | str]:
    """The entry function's body as instructions and label names, in order. Braces that open a statement
    are blocks (the function's, an inline asm's scope) and are dropped; braces inside one are operands."""
    lines = (line.split("//")[0] for line in ptx[ptx.index(".entry"):].splitlines())
    text = "\n".join(line for line in lines if not line.strip().startswith(LINE_DIRECTIVES))
    statements, current, blocks, inner = [], "", 0, 0
    for char in text[text.index("{") + 1:]:
        if char == "{" and not current.strip():
            blocks += 1
        elif char == "}" and inner == 0:
            if blocks == 0:
                break
            blocks -= 1
        elif char == ";" and inner == 0:
            statements.append(current.strip())
            current = ""
        else:
            inner += {"{": 1, "}": -1}.get(char, 0)
            current += char
            if char == "\n" and LABEL.match(current.strip()):
                statements.append(current.strip())
                current = ""
    out: list[Instruction | str] = []
    for statement in statements:
        label = LABEL.match(statement)
        if label:
            out.append(label.group(1))
        elif statement and not statement.startswith("."):
            out.append(_parse(statement))
    return out


def _parse(statement: str) -> Instruction:
    predicate = None
    if statement.startswith("@"):
        predicate, statement = statement.split(None, 1)
    parts = statement.split(None, 1)
    operands = _split_operands(parts[1]) if len(parts) > 1 else []
    return Instruction(predicate, parts[0], operands)


def _split_operands(text: str) -> list[str]:
    operands, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            operands.append(current.strip())
            current = ""
        else:
            current += char
    return operands + [current.strip()] if current.strip() else operands


def _blocks(items: list[Instruction | str]) -> list[list[Instruction]]:
    """Basic blocks: a label opens one, a branch or return closes one. A label names the block it opens
    through a leading pseudo-instruction with opcode ':label'."""
    blocks: list[list[Instruction]] = [[]]
    for item in items:
        if isinstance(item, str):
            blocks.append([Instruction(None, ":label", [item])])
            continue
        blocks[-1].append(item)
        if item.opcode.startswith(("bra", "ret", "exit")):
            blocks.append([])
    return [block for block in blocks if block]


def _param_names(ptx: str, names: list[str]) -> dict[str, str]:
    """PTX parameter symbol -> argument name."""
    header = ptx[ptx.index(".entry"):]
    symbols = re.findall(r"\.param\s+[^\n]*?(\w+_param_(\d+))", header[:header.index("{")])
    return {symbol: names[int(index)] for symbol, index in symbols if int(index) < len(names)}


def _taint(blocks: list[list[Instruction]], params: dict[str, str]) -> dict[str, set[str]]:
    """Per register, the kernel parameters its value derives from (a loaded value from its address's),
    over every definition, to a fixed point: PTX from LLVM is nearly SSA, so this is exact but for loops."""
    taint: dict[str, set[str]] = {}
    changed = True
    while changed:
        changed = False
        for instruction in (i for block in blocks for i in block):
            if instruction.opcode.startswith(NO_DESTINATION) or not instruction.operands:
                continue
            sources = set().union(*(_operand_taint(o, taint, params) for o in instruction.operands[1:]))
            for register in REGISTER.findall(instruction.operands[0]):
                if not sources <= taint.setdefault(register, set()):
                    taint[register] |= sources
                    changed = True
    return taint


def _operand_taint(operand: str, taint: dict[str, set[str]], params: dict[str, str]) -> set[str]:
    found = {params[m.group(1)] for m in PARAM.finditer(operand) if m.group(1) in params}
    for register in REGISTER.findall(operand):
        found |= taint.get(register, set())
    return found


def _before_wait(blocks: list[list[Instruction]]) -> tuple[list[Instruction], list[str]]:
    """The instructions some path from the entry runs before the wait, and the exits reached without it."""
    labels = {block[0].operands[0]: index for index, block in enumerate(blocks)
              if block[0].opcode == ":label"}
    seen, early, exits, todo = set(), [], [], [0]
    while todo:
        index = todo.pop()
        if index in seen or index >= len(blocks):
            continue
        seen.add(index)
        falls_through = True
        for instruction in blocks[index]:
            op = instruction.opcode
            if op.startswith(WAIT):
                falls_through = False
                break
            early.append(instruction)
            if op.startswith("bra"):
                todo.append(labels[instruction.operands[0]])
                falls_through = instruction.predicate is not None
            elif op.startswith(("ret", "exit")):
                exits.append(op)
                falls_through = instruction.predicate is not None
        if falls_through:
            todo.append(index + 1)
    return early, exits


def _reads_global(op: str) -> bool:
    if op.startswith(("ld.param", "ld.shared", "ld.local", "ld.const")):
        return False
    return op.startswith(("ld.", "ldu.")) or (op.startswith("cp.async") and ".shared.global" in op)


def _writes_global(op: str) -> bool:
    if op.startswith(("st.shared", "st.local", "st.param")):
        return False
    return op.startswith(("st.", "atom.", "red.", "cp.reduce")) or (
        op.startswith("cp.async") and ".global.shared" in op)
