"""Turning failures into lasting regression tests: save a run's failure as a trace, replay a trace, and export it as
a standalone pytest file."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Callable, Optional

import attrs

from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.kernels import KernelUnavailable, make_kernel
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Target
from kvfuzz.program.replay import NotApplicable, ReplayOutcome, replay
from kvfuzz.registry import load_factory
from kvfuzz.runner import RunSummary
from kvfuzz.trace import Trace, failure_record, save


def trace_of(
    summary: RunSummary, allocator: str, config: MachineConfig, inflight_window: Optional[int]
) -> Optional[Trace]:
    """The trace of a failed run, or None if it has no program to replay."""
    if not summary.failed or not summary.calls:
        return None
    failure = summary.failure
    record = (
        failure_record(failure)
        if isinstance(failure, InvariantViolation)
        else {"invariant": None, "title": summary.invariant, "operation": None, "explanation": summary.explanation}
    )
    return Trace(allocator, config, summary.calls, record, inflight_window)


@attrs.frozen
class SavedTrace:
    """Where a failure's trace went: written to ``path``, already there, or, when the corpus could not be written,
    nowhere but memory, in which case :meth:`report` shows the whole trace so that the failure is not lost."""

    trace: Trace
    path: Path  # where it is, or would have been, saved
    written: bool  # False when the same trace was already saved there, or when it could not be written
    error: Optional[str] = None  # why it could not be written; None once it is on disk

    def text(self) -> str:
        """The trace file's content."""
        return json.dumps(self.trace.to_json(), indent=2)

    def report(self) -> str:
        """For a person: where the trace is and how to replay it, or one line saying it was not saved followed by
        the trace itself."""
        if self.error is None:
            where = "saved to" if self.written else "already in the corpus:"
            return f"trace {where} {self.path}\nreplay it with: kvfuzz replay {self.path}"
        name = self.path.name
        return (
            f"trace NOT saved: cannot write {self.path} ({self.error}); here it is: save it as {name} and replay it "
            f"with: kvfuzz replay {name}\n{self.text()}"
        )


def save_failure(
    summary: RunSummary, allocator: str, config: MachineConfig, inflight_window: Optional[int], directory: Path
) -> Optional[SavedTrace]:
    """Save a failed run's trace in ``directory``; None if the run has no program to save. A corpus that cannot be
    written (read-only, full, not a directory) raises nothing: the result carries the error and the trace."""
    trace = trace_of(summary, allocator, config, inflight_window)
    if trace is None:
        return None
    try:
        path, written = save(trace, directory)
    except OSError as error:
        return SavedTrace(trace, directory / trace.file_name(), False, error.strerror or str(error))
    return SavedTrace(trace, path, written)


@attrs.frozen
class TraceReplay:
    """A trace replayed against an allocator: what happened, and whether it is the recorded failure."""

    trace: Trace
    allocator: str
    outcome: ReplayOutcome

    @property
    def failed(self) -> bool:
        return self.outcome.failure is not None

    @property
    def reproduced(self) -> bool:
        """The recorded failure happened again: the same invariant (or, for a crash, the same exception type)."""
        failure = self.outcome.failure
        if isinstance(failure, InvariantViolation):
            return failure.invariant.number == self.trace.failure.get("invariant")
        return (
            failure is not None
            and self.trace.failure.get("invariant") is None
            and f"({type(failure).__name__})" in str(self.trace.failure.get("title"))
        )

    def describe_failure(self) -> str:
        failure = self.outcome.failure
        if failure is None:
            return "no invariant broke"
        return failure.explain() if isinstance(failure, InvariantViolation) else f"{type(failure).__name__}: {failure}"


def replay_trace(
    trace: Trace, allocator: Optional[str] = None, on_call: Optional[Callable[[int, Call], None]] = None
) -> TraceReplay:
    """Replay ``trace`` against its recorded allocator, or ``allocator`` if given.

    Raises :class:`~kvfuzz.runner.AllocatorNotFound` if the allocator cannot be loaded, and
    :class:`~kvfuzz.program.replay.NotApplicable` if the program (or the trace's attention kernel) does
    not fit the allocator.
    """
    spec = allocator or trace.allocator
    factory = load_factory(spec)
    try:
        make_kernel(trace.config.kernel, factory(trace.config.pool_spec()))
    except KernelUnavailable as error:
        raise NotApplicable(f"the trace ran the {trace.config.kernel!r} attention kernel: {error}") from error
    return TraceReplay(trace, spec, replay(Target(factory, trace.config), trace.program, on_call))


def export_test(trace: Trace, source: str, allocator: Optional[str] = None) -> str:
    """A standalone pytest file that reproduces ``trace`` through kvfuzz's public API: it fails while the failure
    reproduces and passes once it is fixed."""
    spec = allocator or trace.allocator
    shape = trace.config.shape
    name = re.sub(r"[^a-z0-9]+", "_", f"{spec.split(':')[-1]} {trace.failure.get('title', '')}".lower()).strip("_")
    calls = "\n".join(f"    {call}" for call in trace.program)
    uses_misuse = any(isinstance(value, MisuseCall) for call in trace.program for _, value in call.arguments)
    statemachines = "MachineConfig, MisuseCall, machine_for" if uses_misuse else "MachineConfig, machine_for"
    explanation = _docstring_text(textwrap.indent(str(trace.failure.get("explanation", "")), "    "))
    kernel = "" if trace.config.kernel == "gather" else f", kernel={trace.config.kernel!r}"
    return f'''"""Regression test exported by kvfuzz from {_docstring_text(source)}.

Recorded failure against {_docstring_text(trace.allocator)}:
{explanation}
"""

import torch

from kvfuzz.reference import ModelShape
from kvfuzz.runner import load_factory
from kvfuzz.statemachines import {statemachines}


def test_{name}_{trace.digest()}():
    config = MachineConfig(block_size={trace.config.block_size}, num_blocks={trace.config.num_blocks},
                           num_host_blocks={trace.config.num_host_blocks},
                           shape=ModelShape(num_layers={shape.num_layers}, num_kv_heads={shape.num_kv_heads},
                                            num_query_heads={shape.num_query_heads}, head_dim={shape.head_dim},
                                            dtype={shape.dtype}, device={shape.device!r}){kernel})
    state = machine_for(load_factory({spec!r}), config)()
{calls}
    state.teardown()
'''


def _docstring_text(text: str) -> str:
    """``text`` as it may stand inside a triple-quoted docstring: backslashes, triple quotes and unprintable
    characters escaped, so that nothing a trace holds can end the docstring or run as code."""
    escaped = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return "".join(
        char if char == "\n" or char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in escaped
    )
