"""Failure signatures: what makes two failures of a campaign the same finding.

A signature is the allocator, the failure (the broken invariant, or a crash with its exception type, or a hang) and
what is known of its cause:

* a broken invariant: the cause its check named (:class:`~kvfuzz.engine.violations.Cause`, "a cache hit covering
  the whole prompt", "a refcount one too high after preempt released the block"), and the failing operation only
  where the cause says the operation is part of it, or where the check named no cause. Two bugs that break one
  invariant in one operation for different reasons are two findings; one bug met through several operations is one;
* a crash: the failing operation and the allocator's frame that raised (module and function, never a line number,
  which moves with every edit);
* a hang: the operation that hung.

A new signature is shrunk and saved once; a known one is only counted. Shrinking keeps the signature, so the
findings of a campaign are its shrunk programs grouped by the cause they end in.

The teardown first frees every sequence still alive, then checks quiescence: a failure while it frees one is a
failure of ``free``, as if the program had ended with that call (the same bug, whether the program freed the
sequence or left it to the teardown); a failure after that is one of ``teardown``.
"""

from __future__ import annotations

import hashlib
import sysconfig
import traceback
from pathlib import Path
from typing import Optional, Sequence

import attrs

from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import TEARDOWN_OPERATION
from kvfuzz.program.failures import failure_kind
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.program.replay import Divergence
from kvfuzz.program.safeguards import AllocatorHang

TEARDOWN = "teardown"
"""The operation of a failure raised after the last call, by the quiescence check of the teardown."""

_HARNESS = tuple(
    str(Path(__file__).resolve().parent.parent / part)
    for part in (
        "engine",
        "program",
        "shrink",
        "reference",
        "kernels",
        "accounting",
        "campaign",
        "statemachines",
        "runner.py",
    )
)
"""kvfuzz's own code around an allocator call: a crash's frame is the innermost frame outside it (and outside the
standard library)."""
_STDLIB = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
_SITE_PACKAGES = tuple({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
"""Where installed libraries live: inside ``platstdlib`` in a virtual environment (``venv/lib/python3.X``), yet
an allocator's code (vLLM's, SGLang's), never the standard library's."""
_ENGINE = str(Path(__file__).resolve().parent.parent / "engine" / "engine.py")
"""The engine, with one method per operation: the teardown frees sequences through its ``free``."""
_OPERATION_NAMES = frozenset(operation.name for operation in OPERATIONS)


@attrs.frozen
class Signature:
    """One distinct failure of one allocator: equal signatures are the same finding. Invariant: ``operation`` is
    None exactly where a broken invariant's named cause makes the finding whatever operation met it, and ``cause``
    is None for crashes, hangs and violations whose check named no cause."""

    allocator: str  # the allocator's spec
    failure: str  # "invariant 5 (exclusive writes)", "crash (KeyError)", "hang", "crash (the process died)"
    operation: Optional[str]  # the failing call's operation, or TEARDOWN; None where the cause is the finding
    frame: Optional[str] = None  # crashes: "module.function" of the allocator's innermost frame
    cause: Optional[str] = None  # broken invariants: the cause the check named, in words

    def key(self) -> str:
        """A stable string for stores and files: the fields joined, hashed to a short digest."""
        fields = [self.allocator, self.failure, self.operation or "", self.frame or ""]
        if self.cause is not None:
            fields.append(self.cause)  # without one, the key is the one a signature had before causes
        return hashlib.sha256("\x1f".join(fields).encode()).hexdigest()[:16]

    def __str__(self) -> str:
        cause = f": {self.cause}" if self.cause else ""
        operation = f" in {self.operation}" if self.operation else ""
        frame = f" at {self.frame}" if self.frame else ""
        return f"{self.failure}{cause}{operation}{frame}"

    def to_json(self) -> dict[str, Optional[str]]:
        return attrs.asdict(self)


def signature_of(
    allocator: str,
    failure: BaseException,
    calls: Sequence[Call],
    failed_at: Optional[int],
    diverged: Optional[Divergence] = None,
) -> Signature:
    """The signature of ``failure``, raised by call ``failed_at`` of ``calls`` (``len(calls)``: the teardown; None:
    the last call); where its replay's audit found the allocator diverged before it failed (``diverged``), the
    signature of that divergence instead, unless the failure is a hang."""
    if diverged is not None and not isinstance(failure, AllocatorHang):
        return signature_of(allocator, diverged.violation, calls, diverged.at)
    kind = str(failure_kind(failure))
    if isinstance(failure, InvariantViolation) and failure.cause.words:
        cause = failure.cause
        operation = _operation(failure, calls, failed_at) if cause.by_operation else None
        return Signature(allocator, kind, operation, cause=cause.words)
    frame = None
    if not isinstance(failure, (InvariantViolation, AllocatorHang)):
        frame = allocator_frame(getattr(failure, "original", failure))
    return Signature(allocator, kind, _operation(failure, calls, failed_at), frame)


def _operation(failure: BaseException, calls: Sequence[Call], failed_at: Optional[int]) -> str:
    """The operation of the call ``failed_at`` of ``calls`` that raised ``failure`` (the last call for None; for
    ``len(calls)``, the teardown's)."""
    index = len(calls) - 1 if failed_at is None else failed_at
    return calls[index].rule if 0 <= index < len(calls) else _teardown_operation(failure)


def _teardown_operation(failure: BaseException) -> str:
    """``free`` for a failure raised while the teardown freed a sequence (the violation's operation, or for a crash
    the engine's operation method in its traceback), else :data:`TEARDOWN`."""
    if isinstance(failure, InvariantViolation):
        name = failure.operation.removeprefix(TEARDOWN_OPERATION).partition("(")[0]
        return name if name in _OPERATION_NAMES else TEARDOWN
    if isinstance(failure, AllocatorHang):
        return TEARDOWN
    operation = TEARDOWN
    for frame, _ in traceback.walk_tb(getattr(failure, "original", failure).__traceback__):
        if frame.f_code.co_filename == _ENGINE and frame.f_code.co_name in _OPERATION_NAMES:
            operation = frame.f_code.co_name
    return operation


def _is_standard_library(path: str) -> bool:
    return path.startswith(_STDLIB) and not path.startswith(_SITE_PACKAGES)


def allocator_frame(error: BaseException) -> Optional[str]:
    """``module.function`` of the innermost frame of ``error``'s traceback that is neither kvfuzz's harness nor the
    standard library: where the allocator raised (None if no such frame)."""
    found: Optional[str] = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        path = frame.f_code.co_filename
        if path.startswith(_HARNESS) or _is_standard_library(path) or path.startswith("<"):
            continue
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # co_qualname: Python 3.11+
        found = f"{frame.f_globals.get('__name__', Path(path).stem)}.{name}"
    return found
