"""A scheduler trace's timeline as one self-contained HTML page: inline CSS and SVG, no script, nothing fetched.

Top to bottom: what was replayed and what the replay found; the lanes (one per request, engine steps along the
horizontal axis, each cell coloured by the request's state and numbered with the tokens scheduled for it) with the
failing step and the failure beside them; the legend; the client's program, each operation placed between steps.
Hovering a cell shows the engine's status, the computed tokens and the blocks it holds. Element ids the tests (and
a reader's browser) rely on: ``lane-<request>``, ``step-<n>`` (n the step number, from 1), ``op-<n>`` (operations,
from 1), ``failing-column``, ``explanation``.
"""

from __future__ import annotations

import html
from typing import Iterator, Optional

from kvfuzz.scheduler.snapshot import REQUEST_STATES, RequestAtStep
from kvfuzz.timeline.requests import RequestTimeline, block_label

COLOURS = {  # fill and stroke of each state, in the page and the picture
    "waiting": ("#fefcbf", "#b7791f"),
    "loading": ("#e9d8fd", "#6b46c1"),
    "running": ("#bee3f8", "#2b6cb0"),
    "idle": ("#e2e8f0", "#4a5568"),
    "preempted": ("#fed7d7", "#c53030"),
    "finished": ("#c6f6d5", "#2f855a"),
    "aborted": ("#edf2f7", "#a0aec0"),
}
_LABEL = 70
_HEADER = 36
_LANE = 30

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px;color:#1d2330;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:20px 0 6px}.meta{color:#4a5568;margin:2px 0}
.note{background:#fff7d6;border-left:4px solid #d69e2e;padding:4px 8px;margin:6px 0}
.verdict-reproduced{color:#c53030;font-weight:600}.verdict-other{color:#2b6cb0;font-weight:600}
.main{display:flex;gap:16px;align-items:flex-start}
.chart{overflow-x:auto;flex:1 1 auto;min-width:0;border:1px solid #e2e8f0;border-radius:4px}
aside#explanation{flex:0 0 380px;max-width:380px;border:2px solid #c53030;border-radius:4px;padding:8px 10px;
background:#fff5f5}aside#explanation.quiet{border-color:#a0aec0;background:#f7fafc}
aside pre{white-space:pre-wrap;font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;margin:6px 0 0}
svg text{font:11px ui-monospace,Menlo,Consolas,monospace}.lane-label{font:12px system-ui,sans-serif;fill:#1d2330}
.lane-label.in-failure{fill:#c53030;font-weight:700}.cell-text{fill:#1a202c;text-anchor:middle;pointer-events:none}
.step-num{fill:#2d3748;text-anchor:middle}.holds{fill:#2d3748}
.cell-blocks{font-size:9px;fill:#4a5568;text-anchor:middle;pointer-events:none}.op-tick{stroke:#805ad5;stroke-width:2}
#failing-column{fill:none;stroke:#c53030;stroke-width:3}.failing-head{fill:#c53030;font-weight:700}
dl.legend{display:flex;flex-wrap:wrap;gap:4px 18px;margin:0}dl.legend div{display:flex;gap:6px;align-items:center}
dl.legend dd{margin:0}
ol.program{font:12px/1.5 ui-monospace,Menlo,Consolas,monospace;padding-left:48px;margin:0;max-height:420px;
overflow:auto}ol.program li.steps{color:#718096}
"""


def render_requests_html(timeline: RequestTimeline) -> str:
    """The whole page for ``timeline``."""
    return "".join(_page(timeline))


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _page(timeline: RequestTimeline) -> Iterator[str]:
    name = timeline.trace.rsplit("/", 1)[-1]
    yield f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>kvfuzz timeline: {_e(name)}</title>'
    yield f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head><body>'
    yield f"<h1>kvfuzz timeline: {_e(name)}</h1>"
    yield f'<p class="meta">{_e(timeline.title)}; {len(timeline.requests)} requests, {timeline.total_steps} steps.</p>'
    verdict_class = "verdict-reproduced" if timeline.verdict == "reproduced" else "verdict-other"
    yield f'<p class="meta">replay: <span class="{verdict_class}" id="verdict">{_e(timeline.verdict)}</span>'
    if timeline.failing_step is not None:
        yield f' at <a href="#step-{timeline.failing_step}">step {timeline.failing_step}</a>'
        if timeline.failing_request is not None:
            yield f', request <a href="#lane-{_e(timeline.failing_request)}">{_e(timeline.failing_request)}</a>'
    yield "</p>"
    if len(timeline.steps) < timeline.total_steps:
        yield (
            f'<p class="note">the replay ran {timeline.total_steps} steps: the lanes show the last '
            f"{len(timeline.steps)}.</p>"
        )
    yield '<div class="main"><div class="chart">'
    yield from _svg(timeline)
    quiet = "" if timeline.failure else ' class="quiet"'
    yield f'</div><aside id="explanation"{quiet}><b>{_e(timeline.verdict)}</b>'
    yield f"<pre>{_e(timeline.failure or 'every check passed, the drain included')}</pre></aside></div>"
    yield from _legend()
    yield from _program(timeline)
    yield "</body></html>\n"


def _column_width(count: int) -> int:
    for limit, width in ((12, 56), (30, 40), (80, 26), (200, 16)):
        if count <= limit:
            return width
    return 9


def _svg(timeline: RequestTimeline) -> Iterator[str]:
    width = _column_width(len(timeline.steps))
    total_width = _LABEL + width * max(len(timeline.steps), 1) + 8
    height = _HEADER + _LANE * max(len(timeline.requests), 1) + 8
    yield f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_width}" height="{height}" role="img">'
    every = -(-22 // width)  # a step number every this many columns, 22 pixels apart at least
    for column, step in enumerate(timeline.steps):
        x = _LABEL + column * width
        failing = step == timeline.failing_step
        text_class = "step-num failing-head" if failing else "step-num"
        label = str(step) if failing or column % every == 0 else ""
        yield f'<g id="step-{step}"><title>step {step}</title>'
        yield f'<text class="{text_class}" x="{x + width / 2}" y="{_HEADER - 12}">{label}</text></g>'
    for row, request in enumerate(timeline.requests):
        y = _HEADER + row * _LANE
        label_class = "lane-label in-failure" if request == timeline.failing_request else "lane-label"
        yield f'<g id="lane-{_e(request)}">'
        yield f'<text class="{label_class}" x="6" y="{y + _LANE / 2 + 4}">{_e(request)}</text>'
        for column, cell in enumerate(timeline.cells[row]):
            yield from _cell(cell, _LABEL + column * width, y, width, timeline.steps[column])
        yield "</g>"
    for line in timeline.program:
        if line.is_step:
            continue
        tick = _column_of(timeline, line.after_steps)
        if tick is not None:
            x = _LABEL + tick * width
            yield f'<line class="op-tick" x1="{x}" y1="{_HEADER - 6}" x2="{x}" y2="{_HEADER}">'
            yield f"<title>before step {line.after_steps + 1}: {_e(line.text)}</title></line>"
    failing_column = timeline.failing_column
    if failing_column is not None:
        x = _LABEL + failing_column * width
        lanes = _LANE * max(len(timeline.requests), 1)
        yield f'<rect id="failing-column" x="{x}" y="{_HEADER - 2}" width="{width}" height="{lanes + 4}"/>'
    yield "</svg>"


def _column_of(timeline: RequestTimeline, after_steps: int) -> Optional[int]:
    """The column of the first step that ran after ``after_steps`` steps, if it is kept."""
    step = after_steps + 1
    return timeline.steps.index(step) if step in timeline.steps else None


def _cell(cell: Optional[RequestAtStep], x: float, y: float, width: int, step: int) -> Iterator[str]:
    if cell is None:
        return
    fill, stroke = COLOURS[cell.state]
    blocks = ", ".join(map(str, cell.blocks)) or "none"
    tip = (
        f"step {step}: {cell.state} ({cell.status}); {cell.scheduled} tokens scheduled, {cell.computed} computed; "
        f"blocks held: {blocks}"
    )
    yield f'<rect x="{x + 1}" y="{y + 3}" width="{width - 2}" height="{_LANE - 6}" fill="{fill}" stroke="{stroke}">'
    yield f"<title>{_e(tip)}</title></rect>"
    if cell.scheduled and width >= 16:
        yield f'<text class="cell-text" x="{x + width / 2}" y="{y + _LANE / 2 + 1}">{cell.scheduled}</text>'
    if cell.blocks and width >= 40:  # the blocks its engine holds, as far as they fit
        label = block_label(cell.blocks, width / 6.5)
        yield f'<text class="cell-blocks" x="{x + width / 2}" y="{y + _LANE - 6}">{_e(label)}</text>'
    elif cell.blocks:  # a dot: the engine holds blocks for it (which: in the tooltip)
        yield f'<circle class="holds" cx="{x + width - 5}" cy="{y + 7}" r="2.5"/>'


def _legend() -> Iterator[str]:
    yield '<h2>Legend</h2><dl class="legend">'
    for state, text in REQUEST_STATES.items():
        fill, stroke = COLOURS[state]
        yield f'<div><svg width="18" height="12"><rect x="1" y="1" width="16" height="10" fill="{fill}" '
        yield f'stroke="{stroke}"/></svg><dt>{_e(state)}</dt><dd>{_e(text)}</dd></div>'
    yield "<div><dt>number</dt><dd>tokens scheduled for the request in the step</dd></div>"
    yield "<div><dt>b3,7</dt><dd>the blocks its engine holds (a dot where they do not fit; hover: which)</dd></div>"
    yield '<div><svg width="18" height="12"><line class="op-tick" x1="9" y1="0" x2="9" y2="12"/></svg>'
    yield "<dd>the client added or aborted a request before this step</dd></div></dl>"


def _program(timeline: RequestTimeline) -> Iterator[str]:
    yield '<h2>Program</h2><ol class="program">'
    for line in timeline.program:
        where = f" (before step {line.after_steps + 1})" if not line.is_step else f" (step {line.after_steps + 1})"
        yield f'<li id="op-{line.number}">{_e(line.text)}<span class="steps">{_e(where)}</span></li>'
    yield '</ol><p class="meta">then the drain: steps until every request has finished.</p>'
