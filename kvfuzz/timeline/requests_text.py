"""A scheduler trace's request timeline (:class:`~kvfuzz.timeline.requests.RequestTimeline`) as plain text, for a
report: a row per request, a character per step (its state after that step's scheduling), the failing step marked
under the columns, then each request's state, tokens and blocks at the failing step (or the last step kept)."""

from __future__ import annotations

from kvfuzz.scheduler.snapshot import REQUEST_STATES
from kvfuzz.timeline.requests import RequestTimeline

LETTERS = {
    "waiting": "w",
    "loading": "l",
    "running": "R",
    "idle": "-",
    "preempted": "p",
    "finished": "F",
    "aborted": "A",
}
"""The character of each request state (:data:`~kvfuzz.scheduler.snapshot.REQUEST_STATES`); a space: not yet
arrived."""

MAX_COLUMNS = 80
"""The steps drawn: a longer timeline is drawn as its last this many steps (a hang's drain)."""


def render_requests_text(timeline: RequestTimeline) -> str:
    """The timeline as lines of text (no trailing newline)."""
    steps = timeline.steps[-MAX_COLUMNS:]
    first = len(timeline.steps) - len(steps)
    width = max((len(request) for request in timeline.requests), default=1)
    lines = [f"steps {steps[0]}..{steps[-1]} of {timeline.total_steps}" if steps else "no step ran"]
    if steps:
        tens = "".join(str(step // 10 % 10) if step % 10 == 0 else " " for step in steps)
        lines.append(f"{'':{width}}  {tens}")
        lines.append(f"{'step':{width}}  " + "".join(str(step % 10) for step in steps))
    for lane, request in enumerate(timeline.requests):
        cells = timeline.cells[lane][first:]
        lines.append(f"{request:{width}}  " + "".join(" " if c is None else LETTERS[c.state] for c in cells))
    column = timeline.failing_column
    if column is not None and column >= first:
        lines.append(
            f"{'':{width}}  " + " " * (column - first) + f"^ {timeline.verdict} at step {steps[column - first]}"
        )
    lines.append("")
    lines.append("  ".join(f"{LETTERS[state]} {state}" for state in REQUEST_STATES))
    at = column if column is not None else len(timeline.steps) - 1
    if at >= 0 and timeline.steps:
        lines.append("")
        lines.append(f"at step {timeline.steps[at]}:")
        for lane, request in enumerate(timeline.requests):
            cell = timeline.cells[lane][at]
            if cell is not None:
                blocks = f", blocks {list(cell.blocks)}" if cell.blocks else ""
                lines.append(
                    f"  {request}: {cell.status}, {cell.scheduled} scheduled, {cell.computed} computed{blocks}"
                )
    return "\n".join(lines)
