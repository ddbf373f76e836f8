"""What a file's functions could reach: their lines, and their branches, found in the interpreter's own bytecode.

The unit is the function (every code object with its own locals: functions, methods, lambdas, generator
expressions). A module's and a class's body run once, when the engine is imported, before any campaign starts, so
they are neither measured nor counted.

* A function's lines are the lines its bytecode is attributed to (``co_lines``); its first line (the ``def`` line,
  or its first decorator's) counts as reached when the function is entered.
* A branch is one direction of a conditional jump (``if``, ``while``, ``for``, ``and``/``or``, ``match``...), named
  by the line the jump is on and the first other line the direction goes on to: ``(jump's line, landing line)``, as
  a line trace sees it. Directions landing on the same line are one branch (the two tests of ``if a and b:`` go on
  to the same body); a direction that never leaves its line (``return a if c else b``) is no branch.

Invariant: the same source gives the same :class:`CodePoints` in every process of one interpreter version, so the
points of two workers (or two runs) compare.
"""

from __future__ import annotations

import ast
import bisect
import dis
import inspect
from collections.abc import Iterator
from pathlib import Path
from types import CodeType
from typing import Optional

import attrs

Branch = tuple[int, int]
"""(the line a conditional jump is on, the line one of its directions lands on)."""


def _is_jump(name: str) -> bool:
    """A conditional jump's opcode, on CPython 3.11 to 3.14 (``POP_JUMP_FORWARD_IF_FALSE``, ``JUMP_IF_TRUE_OR_POP``,
    ``FOR_ITER``, ...)."""
    return ("JUMP" in name and "_IF_" in name) or name == "FOR_ITER"


@attrs.frozen
class CodePoints:
    """One function's reachable points. ``jumps`` maps each conditional jump's offset to its line, the
    offset of the instruction after it, and the landing lines of its two directions (fall-through, jump)."""

    first_line: int
    lines: frozenset[int]
    branches: frozenset[Branch]
    jumps: dict[int, tuple[int, Optional[int], Optional[int], Optional[int]]] = attrs.field(eq=False, repr=False)
    offsets: dict[int, int] = attrs.field(eq=False, repr=False)  # instruction offset -> its line

    @property
    def size(self) -> int:
        return len(self.lines) + len(self.branches)


def is_function(code: CodeType) -> bool:
    """Whether ``code`` is a function's (it has its own locals), not a module's or a class body's."""
    return bool(code.co_flags & inspect.CO_NEWLOCALS)


def code_points(code: CodeType) -> CodePoints:
    """The lines and branches of ``code`` itself (not of the functions nested in it)."""
    offsets: dict[int, int] = {}
    for start, end, line in code.co_lines():
        if line is not None:
            for offset in range(start, end, 2):
                offsets[offset] = line
    lines = frozenset(offsets.values()) | {code.co_firstlineno}
    instructions = list(dis.get_instructions(code))
    starts = [instruction.offset for instruction in instructions]
    jumps: dict[int, tuple[int, Optional[int], Optional[int], Optional[int]]] = {}
    branches: set[Branch] = set()
    for index, instruction in enumerate(instructions):
        if not _is_jump(instruction.opname) or instruction.offset not in offsets:
            continue
        line = offsets[instruction.offset]
        following = instructions[index + 1].offset if index + 1 < len(instructions) else None
        fall = _landing(offsets, instructions, starts, following, line)
        argument = instruction.argval if isinstance(instruction.argval, int) else None
        target = _landing(offsets, instructions, starts, argument, line)
        jumps[instruction.offset] = (line, following, fall, target)
        branches |= {(line, landing) for landing in (fall, target) if landing is not None}
    return CodePoints(code.co_firstlineno, lines, frozenset(branches), jumps, offsets)


def _landing(
    offsets: dict[int, int], instructions: list[dis.Instruction], starts: list[int], offset: Optional[int], line: int
) -> Optional[int]:
    """The line a direction starting at ``offset`` lands on: the line of the first instruction from there on that is
    on another line than the jump's, or None when the direction leaves the function (or jumps away) on the jump's own
    line first (``return a if c else b``)."""
    if offset is None:
        return None
    for instruction in instructions[bisect.bisect_left(starts, offset) :]:
        landing = offsets.get(instruction.offset)
        if landing is not None and landing != line:
            return landing
        if instruction.opname in _LEAVES:
            return None
    return None


_LEAVES = frozenset(
    ("RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP", "YIELD_VALUE")
)
"""Instructions after which the next instruction in the bytecode is not the next to run."""


def functions(code: CodeType) -> Iterator[CodeType]:
    """Every function's code object nested in ``code`` (itself included when it is one)."""
    if is_function(code):
        yield code
    for constant in code.co_consts:
        if inspect.iscode(constant):
            yield from functions(constant)


@attrs.frozen
class FilePoints:
    """Every point of one file's functions."""

    path: str
    lines: frozenset[int]
    branches: frozenset[Branch]

    @property
    def size(self) -> int:
        return len(self.lines) + len(self.branches)


@attrs.frozen
class FunctionPoints:
    """One function's points in its file, named as Python names it (``Scheduler.schedule``,
    ``Scheduler.schedule.<locals>.skip_request``)."""

    qualname: str
    first_line: int
    lines: frozenset[int]
    branches: frozenset[Branch]

    @property
    def size(self) -> int:
        return len(self.lines) + len(self.branches)


def function_points(path: str) -> Optional[tuple[FunctionPoints, ...]]:
    """The points of each function of the Python file at ``path``, in the order of the source (None when it cannot be
    read or compiled here)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
        module = compile(source, path, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    found = []
    for qualname, code in _named_functions(module, ""):
        points = code_points(code)
        found.append(FunctionPoints(qualname, points.first_line, points.lines, points.branches))
    return tuple(sorted(found, key=lambda function: function.first_line))


def _named_functions(code: CodeType, prefix: str) -> Iterator[tuple[str, CodeType]]:
    """Every function nested in ``code`` with its qualified name, as ``co_qualname`` (3.11+) gives it: a class body
    adds ``Class.``, a function ``function.<locals>.`` to the names inside it."""
    for constant in code.co_consts:
        if not inspect.iscode(constant):
            continue
        name = prefix + constant.co_name
        if is_function(constant):
            yield name, constant
            yield from _named_functions(constant, name + ".<locals>.")
        else:
            yield from _named_functions(constant, name + ".")


def file_points(path: str) -> Optional[FilePoints]:
    """The points of the Python file at ``path`` (None when it cannot be read or compiled here)."""
    found = function_points(path)
    if found is None:
        return None
    lines: set[int] = set()
    branches: set[Branch] = set()
    for function in found:
        lines |= function.lines
        branches |= function.branches
    return FilePoints(path, frozenset(lines), frozenset(branches))


def guarded_lines(path: str, guards: frozenset[str]) -> frozenset[int]:
    """The lines of the file at ``path`` that run only when one of ``guards`` is set: in every ``if`` statement whose
    condition holds only then (:func:`_requires`: ``if request.has_encoder_inputs:``, ``if self.ec_connector is not
    None and ...:``; not ``if not request.mm_features:``, nor ``if x or request.mm_features:``), the block it guards
    and the condition's lines after the term that requires the guard. The ``if`` line itself, the terms before, and
    the ``else`` (an ``elif`` is a statement of its own) run either way and stay. Empty when the file cannot be read
    or parsed."""
    if not guards:
        return frozenset()
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return frozenset()
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not _requires(node.test, guards):
            continue
        terms = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) else []
        required = next((term for term in terms if _requires(term, guards)), node.test)
        first = (required.end_lineno or required.lineno) + 1
        end = node.body[-1].end_lineno or node.body[-1].lineno
        lines.update(range(first, end + 1))
    return frozenset(lines)


def _requires(test: ast.expr, guards: frozenset[str]) -> bool:
    """Whether ``test`` can be true only when one of ``guards`` (a name, or an attribute's name) is set: the guard
    itself, ``guard is not None``, something read from it (``guard.x``, ``guard[i]``, ``guard.f()``), a conjunction
    with one such term, a disjunction of such terms only. A negation, or any other comparison, requires nothing."""
    if isinstance(test, ast.BoolOp):
        terms = [_requires(value, guards) for value in test.values]
        return any(terms) if isinstance(test.op, ast.And) else all(terms)
    if isinstance(test, ast.Name):
        return test.id in guards
    if isinstance(test, ast.Attribute):
        return test.attr in guards or _requires(test.value, guards)
    if isinstance(test, ast.Subscript):
        return _requires(test.value, guards)
    if isinstance(test, ast.Call):
        return isinstance(test.func, ast.Attribute) and _requires(test.func.value, guards)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot):
        (compared,) = test.comparators
        return isinstance(compared, ast.Constant) and compared.value is None and _requires(test.left, guards)
    return False
