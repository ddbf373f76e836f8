"""Turning failures into lasting regression tests: save a run's failure as a trace, replay a trace, and export it as
a standalone pytest file."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Optional

import attrs

from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import REFINED, InvariantViolation
from kvfuzz.exported_test import known_bug_note, pytest_file
from kvfuzz.kernels import KernelUnavailable, make_kernel, prepare_kernel
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.failures import failure_kind
from kvfuzz.program.replay import NotApplicable, ReplayOutcome, replay
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT, Watchdog
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, load_factory
from kvfuzz.runner import HangFound, RunSummary
from kvfuzz.saved.trace import Trace, failure_record, save
from kvfuzz.shrink.signature import TEARDOWN, Signature, signature_of
from kvfuzz.text import plural
from kvfuzz.trace_saving import SavedTrace, save_or_keep


def trace_of(summary: RunSummary, allocator: str, config: MachineConfig) -> Optional[Trace]:
    """The trace of a failed run, or None if it has no program to replay: in ``config``, the run's, or in the pool
    the run's swarm drew for the failing program (:attr:`RunSummary.pool`)."""
    if not summary.failed or not summary.calls:
        return None
    failure = summary.failure
    record = (
        failure_record(failure)
        if isinstance(failure, InvariantViolation)
        else {"invariant": None, "title": summary.invariant, "operation": None, "explanation": summary.explanation}
    )
    flaky = (summary.reproduced or 0, summary.replays) if summary.flaky else None
    return Trace(allocator, summary.pool or config, summary.calls, record, summary.declared_window, flaky=flaky)


def save_failure(
    summary: RunSummary, allocator: str, config: MachineConfig, directory: Path
) -> Optional[SavedTrace[Trace]]:
    """Save a failed run's trace in ``directory``; None if the run has no program to save. A corpus that cannot be
    written (read-only, full, not a directory) raises nothing: the result carries the error and the trace."""
    trace = trace_of(summary, allocator, config)
    return None if trace is None else save_trace(trace, directory)


def save_trace(trace: Trace, directory: Path) -> SavedTrace[Trace]:
    """Save ``trace`` in ``directory``; a corpus that cannot be written raises nothing (see :func:`save_failure`)."""
    return save_or_keep(trace, directory, save, trace.allocator)


class HangSaver:
    """A run's ``on_hang``: saves a hang as the search found it, before it is shrunk (each shrinking candidate that
    hangs costs time, and a run killed meanwhile, by a CI job's time limit say, must not lose it), and writes one
    line for a person: where it is, or why it is not saved yet, and what shrinking and confirming it may cost.
    ``path`` is where it was saved (None: not saved; the run saves its failure at its end all the same).
    ``directory`` None: the corpus cannot be written."""

    def __init__(
        self, allocator: str, config: MachineConfig, directory: Optional[Path], write: Callable[[str], None]
    ) -> None:
        self.allocator, self.config, self.directory, self.write = allocator, config, directory, write
        self.path: Optional[Path] = None

    def __call__(self, found: HangFound) -> None:
        trace = trace_of(found.summary, self.allocator, self.config)
        calls = plural(len(found.summary.calls), "call")
        if trace is None or self.directory is None:
            self.write(f"hang found ({calls}; not saved yet: the corpus cannot be written); {found.describe()}")
            return
        saved = save_trace(trace, self.directory)
        if saved.error is not None:
            where = f"not saved yet: cannot write {saved.path} ({saved.error})"
            self.write(f"hang found ({calls}; {where}); {found.describe()}")
            return
        self.path = saved.path
        self.write(f"hang found: its program as found ({calls}) saved to {saved.path}; {found.describe()}")


def superseded(found: Path, saved: Optional[SavedTrace[Trace]], summary: RunSummary) -> Optional[Path]:
    """Remove the hang saved as found (at ``found``, by a :class:`HangSaver`) once ``saved``, the run's final trace
    of ``summary``, is on disk and confirmed in every replay: the same hang, shrunk. Returns the path removed (None:
    it stays: the final trace is not saved, not confirmed, or the same file)."""
    if saved is None or saved.error is not None or saved.path == found:
        return None
    if not summary.replays or summary.reproduced != summary.replays:
        return None
    try:
        found.unlink(missing_ok=True)
    except OSError:
        return None
    return found


PROCESS_DIED = "crash (the process died)"
"""The title of a trace recovered from the journal of a run the allocator killed (:mod:`kvfuzz.saved.journals`)."""


class ProcessDied(Exception):
    """Replaying a trace in a child process killed the child (a segfault, an abort): the recorded crash."""

    def __init__(self, returncode: int, stderr: str) -> None:
        self.returncode = returncode
        self.stderr = stderr
        how = f"signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        last = [line for line in stderr.splitlines() if line.strip()][-3:]
        super().__init__(f"the replaying process died ({how})" + "".join(f"\n  {line}" for line in last))


def reproduces_recorded(trace: Trace, failure: Optional[BaseException]) -> bool:
    """``failure`` is the trace's recorded failure: the same invariant for the same cause (where the trace recorded
    one; a cause refined since, :meth:`~kvfuzz.engine.violations.Cause.refined`, is still the cause recorded), or
    the same kind of crash or hang."""
    if failure is None:
        return False
    if isinstance(failure, InvariantViolation):
        cause = trace.failure.get("cause")
        words = failure.cause.words
        same_cause = cause is None or words == cause or words.startswith(f"{cause}{REFINED}")
        return failure.invariant.number == trace.failure.get("invariant") and same_cause
    title = str(trace.failure.get("title"))
    if isinstance(failure, ProcessDied):
        return title.startswith(PROCESS_DIED)
    return trace.failure.get("invariant") is None and (
        str(failure_kind(failure)) == title or f"({type(failure).__name__})" in title
    )


def died_signature(trace: Trace) -> Signature:
    """The signature of a process that died running ``trace``'s program: the process died, in its last call's
    operation (the teardown's, for an empty program)."""
    operation = trace.program[-1].rule if trace.program else TEARDOWN
    return Signature(trace.allocator, PROCESS_DIED, operation)


def trace_signature(trace: Trace, call_timeout: float) -> Signature | None:
    """The signature of the failure ``trace`` reproduces now, replayed in this process under the watchdog of
    ``call_timeout``; None if it no longer does, fails otherwise than it recorded (another invariant, or the same
    for another cause), or cannot be replayed. A trace of a process that died is not replayed (this process would
    die too): its signature is read from the trace."""
    if str(trace.failure.get("title")).startswith(PROCESS_DIED):
        return died_signature(trace)
    try:
        factory = load_factory(trace.allocator)
        with Watchdog(call_timeout) as watchdog:
            outcome = replay(Target(factory, trace.config, safeguards=Safeguards(watchdog=watchdog)), trace.program)
    except (AllocatorNotFound, NotApplicable):
        return None
    if not reproduces_recorded(trace, outcome.failure):
        return None
    assert outcome.failure is not None  # reproduces_recorded says so
    return signature_of(trace.allocator, outcome.failure, trace.program, outcome.failed_at, outcome.diverged)


@attrs.frozen
class TraceReplay:
    """A trace replayed against an allocator, ``tries`` times for a flaky trace (once otherwise): what happened, and
    in how many tries it was the recorded failure."""

    trace: Trace
    allocator: str
    outcome: ReplayOutcome  # the first try that reproduced, else the first that failed, else the last
    tries: int = 1
    reproductions: int = 0

    @property
    def failed(self) -> bool:
        return self.outcome.failure is not None

    @property
    def reproduced(self) -> bool:
        """The recorded failure happened again (in at least one try): the same invariant, or the same kind of crash."""
        return self.reproductions > 0

    def describe_failure(self) -> str:
        failure = self.outcome.failure
        if failure is None:
            return "no invariant broke"
        described = (
            failure.explain() if isinstance(failure, InvariantViolation) else f"{type(failure).__name__}: {failure}"
        )
        if self.tries > 1:
            described += f"\n(flaky: reproduced in {self.reproductions} of {self.tries} tries)"
        return described


def allocator_missing(error: AllocatorNotFound) -> bool:
    """Whether ``error`` says the trace's allocator is not here (its module, a package it needs, the name it is
    registered or listed under), rather than that it is here and failed while it was loaded (a module that raised
    or exited while importing): a trace of a missing allocator is skipped, one of a failing allocator is an error."""
    cause = error.__cause__
    return cause is None or isinstance(cause, (ImportError, LookupError))


def replay_trace(
    trace: Trace,
    allocator: Optional[str] = None,
    on_call: Optional[Callable[[int, Call], None]] = None,
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT,
    trust: AllocatorTrust = AllocatorTrust(),
) -> TraceReplay:
    """Replay ``trace`` against its recorded allocator, or ``allocator`` if given: once, or as many times as its
    confirmation replays when it is flaky; a trace of a process the allocator killed is replayed in a child
    process, so the replay survives the crash it reproduces. Each operation runs under a watchdog of
    ``call_timeout`` seconds (None: none).

    Raises :class:`~kvfuzz.registry.UntrustedAllocator`, before anything is imported, if ``allocator`` is not
    given and ``trust`` does not cover the recorded one; :class:`~kvfuzz.registry.AllocatorNotFound` if the
    allocator cannot be loaded, and :class:`~kvfuzz.program.replay.NotApplicable` if the program (or the trace's
    attention kernel) does not fit the allocator.
    """
    if allocator is None:
        trust.check(trace.allocator)
    spec = allocator or trace.allocator
    if str(trace.failure.get("title")).startswith(PROCESS_DIED):
        return _replay_in_child(trace, spec, call_timeout)
    prepare_kernel(trace.config.kernel, trace.config.shape)  # before the allocator's package, and its engine, loads
    factory = load_factory(spec)
    try:
        make_kernel(trace.config.kernel, factory(trace.config.pool_spec()), trace.config.shape)
    except KernelUnavailable as error:
        raise NotApplicable(f"the trace ran the {trace.config.kernel!r} attention kernel: {error}") from error
    tries = trace.flaky[1] if trace.flaky is not None else 1
    outcomes: list[ReplayOutcome] = []
    diverged: Optional[NotApplicable] = None
    with Watchdog(call_timeout) if call_timeout is not None else contextlib.nullcontext() as watchdog:
        target = Target(factory, trace.config, safeguards=Safeguards(watchdog=watchdog))
        for _ in range(tries):
            try:
                outcomes.append(replay(target, trace.program, on_call if not outcomes else None))
            except NotApplicable as error:
                if trace.flaky is None:
                    raise
                # A nondeterministic allocator took another path (a refusal where the recording had none): this try
                # does not reproduce, and the others still count.
                diverged = error
    if not outcomes:
        assert diverged is not None
        raise diverged
    reproducing = [outcome for outcome in outcomes if reproduces_recorded(trace, outcome.failure)]
    failing = [outcome for outcome in outcomes if outcome.failure is not None]
    shown = (reproducing or failing or outcomes)[0 if (reproducing or failing) else -1]
    return TraceReplay(trace, spec, shown, tries, len(reproducing))


def _replay_in_child(trace: Trace, spec: str, call_timeout: Optional[float]) -> TraceReplay:
    """Replay in a child Python process, which is expected to die; its death is the recorded failure. ``spec`` was
    checked against the caller's trust already: the child is given it as the allocator to replay against."""
    child = {**trace.to_json(), "allocator": spec, "failure": {**trace.failure, "title": "replayed in a child"}}
    script = (
        "import json, sys; from kvfuzz.saved.corpus import replay_trace; from kvfuzz.saved.trace import from_json; "
        "r = replay_trace(from_json(json.load(sys.stdin)), %r, call_timeout=%r); "
        "print(json.dumps({'failed': r.failed, 'at': r.outcome.failed_at, 'what': r.describe_failure()}))"
    ) % (spec, call_timeout)
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script],
        input=json.dumps(child),
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
    )
    if done.returncode < 0:  # killed by a signal: the recorded death, in the journal's last call
        outcome = ReplayOutcome(ProcessDied(done.returncode, done.stderr), max(len(trace.program) - 1, 0))
        return TraceReplay(trace, spec, outcome, 1, 1)
    if done.returncode != 0 or not done.stdout.strip():  # the child raised: it could not replay the trace
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if "AllocatorNotFound" in last:
            raise AllocatorNotFound(last)
        raise NotApplicable(f"replaying in a child process failed: {last}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    failure = RuntimeError(result["what"]) if result["failed"] else None
    return TraceReplay(trace, spec, ReplayOutcome(failure, result["at"]), 1, 0)


def export_test(trace: Trace, source: str, allocator: Optional[str] = None) -> str:
    """A standalone pytest file that reproduces ``trace`` through kvfuzz's public API: it fails while the failure
    reproduces and passes once it is fixed (the frame is :mod:`kvfuzz.exported_test`'s)."""
    spec = allocator or trace.allocator
    shape = trace.config.shape
    calls = "\n".join(f"    {call}" for call in trace.program)
    uses_misuse = any(isinstance(value, MisuseCall) for call in trace.program for _, value in call.arguments)
    statemachines = "MachineConfig, MisuseCall, machine_for" if uses_misuse else "MachineConfig, machine_for"
    kernel = "" if trace.config.kernel == "gather" else f", kernel={trace.config.kernel!r}"
    tries, flaky_note = 1, ""
    if trace.flaky is not None:
        tries = trace.flaky[1]
        flaky_note = (
            f"\nFlaky: it reproduced in {trace.flaky[0]} of {tries} replays when recorded, so the test runs the "
            f"program up to {tries} times and fails if any run fails.\n"
        )
    body = f"""    state = machine_for(load_factory({spec!r}), config)()
{calls}
    state.teardown()"""
    if tries > 1:
        body = f"""    for _ in range({tries}):
    {body.replace(chr(10), chr(10) + "    ")}"""
    imports = f"""import torch

from kvfuzz.reference import ModelShape
from kvfuzz.runner import load_factory
from kvfuzz.statemachines import {statemachines}"""
    body = f"""    config = MachineConfig(block_size={trace.config.block_size}, num_blocks={trace.config.num_blocks},
                           num_host_blocks={trace.config.num_host_blocks},
                           shape=ModelShape(num_layers={shape.num_layers}, num_kv_heads={shape.num_kv_heads},
                                            num_query_heads={shape.num_query_heads}, head_dim={shape.head_dim},
                                            dtype={shape.dtype}, device={shape.device!r}){kernel})
{body}"""
    return pytest_file(
        source,
        f"against {trace.allocator}",
        textwrap.indent(str(trace.failure.get("explanation", "")), "    "),
        flaky_note + known_bug_note(trace.known_bug),
        imports,
        f"{spec.split(':')[-1]} {trace.failure.get('title', '')}",
        trace.digest(),
        body,
    )
