"""What a campaign found: one row per distinct failure, and the campaign's totals, as a table and as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import attrs

from kvfuzz.campaign.coverage import CampaignCoverage
from kvfuzz.campaign.rerun import Rerun
from kvfuzz.swarm_table import Pins
from kvfuzz.text import plural
from kvfuzz.trace_saving import replay_hint


@attrs.frozen
class Finding:
    """One distinct failure (one signature) of a campaign.

    ``new`` findings were claimed by this campaign (shrunk and saved by it); the others were known before it met them
    (``known``: a corpus trace, or the shared store's record) and were only counted. ``seen`` counts every failing
    program with this signature, across all workers."""

    signature: dict[str, Optional[str]]  # Signature.to_json()
    text: str  # str(Signature), for a person
    new: bool
    seen: int
    first_seconds: float  # seconds into the campaign when first met
    first_examples: int  # examples the campaign had run by then
    known: Optional[str] = None  # where a known finding is known from
    program_length: Optional[int] = None  # calls of the program as found
    shrunk_length: Optional[int] = None  # calls once shrunk (None: not saved yet)
    trace: Optional[str] = None  # the saved trace file
    note: Optional[str] = None  # shrinking stopped early, not shrunk, or a worker's death
    reproduced: Optional[int] = None  # confirmation replays that failed the same way, of ``replays``
    replays: int = 0
    program: Optional[str] = attrs.field(default=None, repr=False)  # the shrunk program, printed
    explanation: Optional[str] = attrs.field(default=None, repr=False)
    unsaved_trace: Optional[dict[str, Any]] = attrs.field(default=None, repr=False)

    @property
    def flaky(self) -> bool:
        return self.replays > 0 and self.reproduced != self.replays

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "flaky": self.flaky}


@attrs.frozen
class DeadWorker:
    """A worker process that died (the allocator killed it, or it hung past the campaign's patience) and was
    replaced; ``trace`` holds the program it was running."""

    slot: int
    pid: int
    how: str  # "killed by signal 11 (SIGSEGV)", "hung: no progress for 30 s, killed"
    trace: Optional[str]  # the trace recovered from its journal
    signature: Optional[str]  # key of the finding it became


@attrs.frozen
class CampaignResult:
    """A finished campaign. Invariant: ``findings`` holds one entry per distinct signature met, new ones first, in the
    order first met."""

    allocators: tuple[str, ...]
    workers: int
    seconds: float
    examples: int
    steps: int
    ended_by: str  # "duration", "max-examples", "stop-after", "interrupted", "workers failed"
    findings: tuple[Finding, ...]
    dead_workers: tuple[DeadWorker, ...] = ()
    errors: tuple[str, ...] = ()  # kvfuzz's own failures in workers (tracebacks), for a bug report
    corpus: str = ""
    rerun: Optional[Rerun] = None  # the settings it ran under, its seed among them: how to rerun it
    scheduler: Optional[str] = None  # a scheduler campaign's target (``allocators`` is empty then)
    batches: int = 0  # the campaign's batches, each on a configuration of its own
    refused: int = 0  # configurations a scheduler campaign drew and vLLM's validation refused (redrawn)
    batch_log: tuple[dict[str, Any], ...] = ()  # the last batches (BATCH_LOG_LIMIT): configuration, what each ran
    per_worker: tuple[dict[str, Any], ...] = ()  # each worker slot: its examples, steps and replacements
    coverage: Optional[CampaignCoverage] = None  # the code under test's, when measured (--coverage, --guided)
    pins: Pins = ()  # the swarm rows held at one value (--pin)

    @property
    def new(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.new)

    @property
    def known(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if not finding.new)

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "allocators": list(self.allocators),
            "scheduler": self.scheduler,
            "pins": dict(self.pins),  # --pin ROW=VALUE
            "batches": self.batches,
            "refused_configurations": self.refused,
            "batch_log": list(self.batch_log),
            "workers": self.workers,
            "seconds": round(self.seconds, 2),
            "examples": self.examples,
            "steps": self.steps,
            "steps_per_second": round(self.steps_per_second, 1),
            "per_worker": list(self.per_worker),
            "ended_by": self.ended_by,
            "corpus": self.corpus,
            "failures": [finding.to_json() for finding in self.new],
            "known": [finding.to_json() for finding in self.known],
            "dead_workers": [attrs.asdict(dead) for dead in self.dead_workers],
            "errors": list(self.errors),
            "seed": None if self.rerun is None else self.rerun.seed,
            "rerun": None if self.rerun is None else self.rerun.to_json(),
            "rerun_command": None if self.rerun is None else self.rerun.command(),
            "coverage": None if self.coverage is None else self.coverage.to_json(),
        }


ENDINGS = {
    "duration": "its duration was up",
    "max-examples": "its examples were run",
    "stop-after": "enough distinct failures found",
    "interrupted": "interrupted",
    "workers failed": "kvfuzz failed in every worker",
    "harness error": "kvfuzz's own code failed driving the engine: a harness error, not a finding",
}
"""Why a campaign ended, for a person, by :attr:`CampaignResult.ended_by`."""


def table(result: CampaignResult) -> list[str]:
    """The distinct failures for a person: one row each (signature, when first found, times seen, shrunk length,
    trace), new ones first, then the known ones the campaign met."""
    ending = ENDINGS.get(result.ended_by, result.ended_by)
    lines = [
        f"campaign ended ({ending}): {plural(result.examples, 'example')}, {plural(result.steps, 'step')} in "
        f"{result.seconds:.1f} s ({result.steps_per_second:.0f} steps/s) on {plural(result.workers, 'worker')}"
    ]
    lines.append(
        f"{plural(len(result.new), 'new distinct failure')}, {plural(len(result.known), 'known failure')} met again"
    )
    if result.known and not result.new:
        lines.append(
            f"the allocator still fails: {plural(len(result.known), 'known bug')} met again (listed below, each with "
            "the trace it is known from); the exit status counts new failures only"
        )
    if result.coverage is not None:
        lines.append(result.coverage.describe())
    if result.rerun is not None:
        lines.append(f"rerun: {result.rerun.command()}")
    if result.new:
        lines += ["", "new failures:"]
        lines += _rows(result.new, known=False)
    if result.known:
        lines += ["", "known failures (counted, not reported as new):"]
        lines += _rows(result.known, known=True)
    for dead in result.dead_workers:
        lines.append(f"worker {dead.slot} (pid {dead.pid}) {dead.how}; replaced; its program: {dead.trace or 'lost'}")
    for error in result.errors:
        where = "driving the engine" if result.ended_by == "harness error" else "in a worker"
        lines.append(f"kvfuzz failed {where} (a bug in kvfuzz, please report it):\n{error}")
    return lines


def _rows(findings: tuple[Finding, ...], known: bool) -> list[str]:
    header = ("signature", "first found", "seen", "shrunk", "known from" if known else "trace")
    rows = [header]
    for finding in findings:
        first = f"{finding.first_seconds:.1f} s, example {finding.first_examples}"
        if known:
            rows.append((finding.text, first, str(finding.seen), "", finding.known or ""))
            continue
        shrunk = "-" if finding.shrunk_length is None else plural(finding.shrunk_length, "call")
        trace = finding.trace or ("NOT SAVED" if finding.shrunk_length is not None else "(being shrunk)")
        rows.append((finding.text, first, str(finding.seen), shrunk, trace))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    notes = []
    for finding in findings:
        if finding.note:
            notes.append(f"  {finding.text}: {finding.note}")
        if finding.flaky:
            notes.append(f"  {finding.text}: FLAKY, reproduced in {finding.reproduced} of {finding.replays} replays")
    return lines + notes


def new_finding_lines(findings: tuple[Finding, ...]) -> list[str]:
    """What a campaign's text output says of each new finding after its table: its program, its explanation, and the
    command that replays its trace (or the whole trace, where the corpus could not be written)."""
    lines: list[str] = []
    for number, finding in enumerate(findings, 1):
        lines += ["", f"failure {number}: {finding.text}"]
        if finding.program:
            lines.append(finding.program)
        if finding.explanation:
            lines += ["", finding.explanation]
        if finding.trace:
            lines.append(replay_hint(Path(finding.trace), finding.signature.get("allocator")))
        elif finding.unsaved_trace is not None:
            lines.append(
                f"trace NOT saved (the corpus could not be written); here it is:\n{json.dumps(finding.unsaved_trace)}"
            )
    return lines
