"""The timeline as one self-contained HTML page: inline CSS and SVG, no script, nothing fetched.

The page holds, top to bottom: what was replayed and what the replay found; the lanes (one per block, calls along
the horizontal axis) with the failing column and the explanation beside them; the legend; the program, each call
linked to its column (and each column's number linked back); the block tables after each call. Hovering a lane's
span shows its holders and refcount, a mark what happened, a column's header the block tables after its call.
Element ids the tests (and a reader's browser) rely on: ``lane-<pool>-<block>``, ``col-<n>`` and ``call-<n>``
(n counted from 1, as the program listing numbers calls), ``failing-column``, ``explanation``.
"""

from __future__ import annotations

import html
from typing import Iterator

from kvfuzz.timeline.model import DEVICE, MARK_KINDS, Cell, Column, Lane, Timeline

MAX_TABLE_ROWS = 200
"""Block tables listed below the lanes: those after each of the last this many calls. Up to this many calls, a
column's header hovers every table after its call; beyond, only the tables its call changed (the page stays small)."""

GLYPHS = {  # the letter of each kind of mark, in the page, its legend and the picture
    "hold": "+",
    "release": "\u2212",
    "scheduled": "w",
    "write": "W",
    "cow": "C",
    "fork-copy": "F",
    "swap-out": "O",
    "swap-in": "I",
    "pending": "P",
    "window-closed": "|",
    "land": "L",
    "cached": "c",
    "hit": "H",
    "evicted": "E",
    "failure": "!",
}
_LABEL_WIDTH = 150
_HEADER = 50
_LANE = 38

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px;color:#1d2330;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:20px 0 6px}
.meta{color:#4a5568;margin:2px 0}.note{background:#fff7d6;border-left:4px solid #d69e2e;padding:4px 8px;margin:6px 0}
.verdict-reproduced{color:#c53030;font-weight:600}.verdict-other{color:#2b6cb0;font-weight:600}
.main{display:flex;gap:16px;align-items:flex-start}
.chart{overflow-x:auto;flex:1 1 auto;min-width:0;border:1px solid #e2e8f0;border-radius:4px}
aside#explanation{flex:0 0 400px;max-width:400px;border:2px solid #c53030;border-radius:4px;padding:8px 10px;
background:#fff5f5}
aside#explanation.quiet{border-color:#a0aec0;background:#f7fafc}
aside pre{white-space:pre-wrap;font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;margin:6px 0 0}
.badge{display:inline-block;background:#c53030;color:#fff;border-radius:3px;padding:1px 6px;font-weight:600}
svg text{font:11px ui-monospace,Menlo,Consolas,monospace}
.lane-label{font:12px system-ui,sans-serif;fill:#1d2330}.lane-label.in-failure{fill:#c53030;font-weight:700}
.library{font:10px system-ui,sans-serif;fill:#718096}
.span-held{fill:#bee3f8;stroke:#3182ce}.span-shared{fill:#fbd38d;stroke:#c05621}
.span-pending{fill:#e2e8f0;stroke:#718096;stroke-dasharray:3 2}.span-cached{fill:#c6f6d5;stroke:#38a169}
.span-held-pending{fill:#fed7d7;stroke:#c53030;stroke-dasharray:3 2}.span-free{fill:none;stroke:none}
.span-text{fill:#1a202c;pointer-events:none}.rc-bad{fill:#c53030;font-weight:700}
.mark circle{stroke:#2d3748;stroke-width:1}.mark text{font:bold 10px system-ui,sans-serif;text-anchor:middle;
pointer-events:none}
.mark-write circle{fill:#2b6cb0}.mark-write text,.mark-failure text,.mark-cow text,.mark-fork-copy text,
.mark-swap-in text,.mark-swap-out text,.mark-land text{fill:#fff}
.mark-scheduled circle{fill:#fff;stroke:#2b6cb0}.mark-scheduled text{fill:#2b6cb0}
.mark-cow circle,.mark-fork-copy circle{fill:#805ad5}.mark-swap-in circle,.mark-swap-out circle{fill:#319795}
.mark-hold circle{fill:#fff}.mark-release circle{fill:#edf2f7}.mark-pending circle{fill:#e2e8f0}
.mark-window-closed circle{fill:#fff}.mark-land circle{fill:#c05621}
.mark-cached circle,.mark-hit circle,.mark-evicted circle{fill:#9ae6b4}
.mark-failure circle{fill:#c53030;stroke:#742a2a;stroke-width:2}
.copy-line{stroke:#805ad5;stroke-width:2;marker-end:url(#arrow)}
.col-head{fill:transparent}.col-head:hover{fill:#edf2f7}
.col-num{fill:#2d3748}.col-rule{fill:#718096;font-size:10px}.step-line{stroke:#cbd5e0}
#failing-column{fill:#fed7d7;opacity:.55}.failing-head{fill:#c53030;font-weight:700}
.lane-sep{stroke:#edf2f7}
ol.program{font:12px/1.5 ui-monospace,Menlo,Consolas,monospace;padding-left:48px;margin:0;max-height:420px;
overflow:auto}
ol.program li.failing{background:#fed7d7;font-weight:700}ol.program li:target{background:#fefcbf}
table.tables{border-collapse:collapse;font:12px ui-monospace,Menlo,Consolas,monospace}
table.tables td,table.tables th{border:1px solid #e2e8f0;padding:2px 6px;text-align:left;vertical-align:top}
table.tables tr.failing{background:#fed7d7}table.tables tr:target{background:#fefcbf}
dl.legend{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:2px 16px;margin:0}
dl.legend div{display:flex;gap:6px;align-items:center}dl.legend dt{font:bold 11px monospace;width:18px;
text-align:center;border:1px solid #2d3748;border-radius:50%}dl.legend dd{margin:0;font-size:12px}
"""


def render_html(timeline: Timeline) -> str:
    """The whole page for ``timeline``."""
    return "".join(_page(timeline))


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _page(timeline: Timeline) -> Iterator[str]:
    outcome = timeline.outcome
    name = timeline.source.rsplit("/", 1)[-1]
    yield f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>kvfuzz timeline: {_e(name)}</title>'
    yield '<meta name="viewport" content="width=device-width, initial-scale=1">'
    yield f"<style>{_CSS}</style></head><body>"
    yield f"<h1>kvfuzz timeline: {_e(outcome.title)}</h1>"
    yield f'<p class="meta">trace <code>{_e(timeline.source)}</code>, '
    yield f"replayed against <code>{_e(timeline.allocator)}</code>"
    yield f" ({_e(timeline.setting)}); {timeline.total_calls} calls.</p>"
    verdict_class = "verdict-reproduced" if outcome.verdict == "reproduced" else "verdict-other"
    yield f'<p class="meta">replay: <span class="{verdict_class}" id="verdict">{_e(outcome.verdict)}</span>'
    if outcome.column is not None:
        column = timeline.columns[outcome.column]
        number = column.call_index + 1
        yield f' at <a href="#call-{number}">call {number}</a>, <code>{_e(column.call)}</code>'
    yield "</p>"
    for note in timeline.notes:
        yield f'<p class="note">{_e(note)}</p>'
    yield '<div class="main"><div class="chart">'
    yield from _svg(timeline)
    quiet = "" if outcome.column is not None else ' class="quiet"'
    badge = f"invariant {outcome.invariant}" if outcome.invariant is not None else "crash"
    yield f'</div><aside id="explanation"{quiet}><span class="badge">{_e(badge)}</span> <b>{_e(outcome.title)}</b>'
    yield f"<pre>{_e(outcome.explanation)}</pre></aside></div>"
    yield from _legend()
    yield from _program(timeline)
    yield from _tables(timeline)
    yield "</body></html>\n"


def _column_width(count: int) -> int:
    for limit, width in ((12, 64), (24, 48), (60, 36), (200, 22), (1000, 10)):
        if count <= limit:
            return width
    return 5


def _span_class(cell: Cell) -> str:
    return f"span-{cell.state}"


def _svg(timeline: Timeline) -> Iterator[str]:
    columns, lanes = timeline.columns, timeline.lanes
    width_of = _column_width(len(columns))
    width = _LABEL_WIDTH + width_of * len(columns) + 10
    height = _HEADER + _LANE * max(len(lanes), 1) + 10
    yield f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
    yield f'aria-label="block lanes over {len(columns)} calls">'
    yield '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
    yield 'orient="auto-start-reverse"><path d="M0 0L10 5L0 10z" fill="#805ad5"/></marker></defs>'
    failing = timeline.outcome.column
    if failing is not None:
        x = _LABEL_WIDTH + failing * width_of
        yield f'<rect id="failing-column" x="{x}" y="0" width="{width_of}" height="{height}"/>'
    yield from _column_heads(columns, width_of, height, failing)
    for row, (lane, cells) in enumerate(zip(lanes, timeline.cells)):
        yield from _lane(row, lane, cells, columns, width_of)
    if not lanes:
        yield f'<text x="{_LABEL_WIDTH}" y="{_HEADER + 22}">no block lanes: the trace was not replayed here</text>'
    yield from _marks(timeline, width_of)
    yield "</svg>"


def _column_heads(columns: tuple[Column, ...], width_of: int, height: int, failing: object) -> Iterator[str]:
    every = max(1, 40 // width_of)
    every_table = len(columns) <= MAX_TABLE_ROWS  # else a column's hover lists only the tables its call changed
    before: set[int] = set()
    for index, column in enumerate(columns):
        x = _LABEL_WIDTH + index * width_of
        number = column.call_index + 1
        shown = [t for t in column.tables if every_table or id(t) not in before]
        before = {id(t) for t in column.tables}
        tables = "; ".join(f"{t.seq} ({t.status}): {list(t.table) or list(t.host_table)}" for t in shown)
        which = "block tables after it" if every_table else "block tables it changed"
        tip = f"call {number}: {column.call}\n{which}: {tables or 'none'}"
        yield f'<g id="col-{number}"><rect class="col-head" x="{x}" y="0" width="{width_of}" height="{_HEADER}">'
        yield f"<title>{_e(tip)}</title></rect>"
        if column.rule == "step":
            yield f'<line class="step-line" x1="{x + width_of}" y1="{_HEADER}" x2="{x + width_of}" y2="{height}"/>'
        if index % every == 0 or index == failing:
            head = ' class="col-num failing-head"' if index == failing else ' class="col-num"'
            yield f'<a href="#call-{number}"><text{head} x="{x + 2}" y="16">{number}</text></a>'
            if width_of >= 22:
                yield f'<text class="col-rule" x="{x + 2}" y="30">{_e(column.rule[: width_of // 7])}</text>'
        yield "</g>"


def _refcount_text(cell: Cell, pool: str) -> str:
    """The allocator's refcount as a span shows it: ``rcN≠M`` where it differs from the M holders kvfuzz counts (a
    device block), ``rcN`` for a shared block, else nothing."""
    if cell.refcount is not None and pool == DEVICE and cell.refcount != len(cell.holders):
        return f"rc{cell.refcount}\u2260{len(cell.holders)}"
    return f"rc{cell.refcount}" if cell.refcount is not None and len(cell.holders) > 1 else ""


def _lane(row: int, lane: Lane, cells: tuple[Cell, ...], columns: tuple[Column, ...], width_of: int) -> Iterator[str]:
    y = _HEADER + row * _LANE
    in_failure = " in-failure" if lane.in_failure else ""
    yield f'<g class="lane" id="lane-{lane.pool}-{lane.block}" data-pool="{lane.pool}" data-block="{lane.block}">'
    right = _LABEL_WIDTH + width_of * len(columns)
    yield f'<line class="lane-sep" x1="0" y1="{y + _LANE}" x2="{right}" y2="{y + _LANE}"/>'
    yield f'<text class="lane-label{in_failure}" x="6" y="{y + 16}">{_e(lane.label)}</text>'
    if lane.library_name:
        yield f'<text class="library" x="6" y="{y + 30}">{_e(lane.library_name)}</text>'
    start = 0
    for index in range(1, len(cells) + 1):
        if index < len(cells) and cells[index] == cells[start]:
            continue
        cell = cells[start]
        span_class = _span_class(cell)
        if span_class != "span-free":
            x, w = _LABEL_WIDTH + start * width_of, (index - start) * width_of
            calls = f"{columns[start].call_index + 1}-{columns[index - 1].call_index + 1}"
            tip = f"{lane.label}, calls {calls}: {cell.describe()}"
            yield f'<rect class="span {span_class}" x="{x + 1}" y="{y + 4}" width="{max(w - 2, 1)}" '
            yield f'height="{_LANE - 8}" '
            yield f'data-holders="{_e(" ".join(map(str, cell.holders)))}" data-calls="{calls}">'
            yield f"<title>{_e(tip)}</title></rect>"
            holders, refcount = " ".join(map(str, cell.holders)), _refcount_text(cell, lane.pool)
            wrong = "\u2260" in refcount
            # The holders and the refcount where both fit; else a wrong refcount alone, which the lane must show.
            for text in (f"{holders} {refcount}".strip(), refcount if wrong else ""):
                if text and w >= 7 * len(text) + 4:
                    bad = " rc-bad" if wrong else ""
                    yield f'<text class="span-text{bad}" x="{x + 4}" y="{y + _LANE - 10}">{_e(text)}</text>'
                    break
        start = index
    yield "</g>"


def _marks(timeline: Timeline, width_of: int) -> Iterator[str]:
    row_of = {lane.key: row for row, lane in enumerate(timeline.lanes)}
    stacked: dict[tuple[int, tuple[str, int]], int] = {}
    radius = 6 if width_of >= 22 else max(2, width_of // 2)
    for mark in timeline.marks:
        key = (mark.pool, mark.block)
        row = row_of[key]
        order = stacked.get((mark.column, key), 0)
        stacked[(mark.column, key)] = order + 1
        per_row = max(1, width_of // (2 * radius + 1))
        x = _LABEL_WIDTH + mark.column * width_of + radius + 1 + (order % per_row) * (2 * radius + 1)
        y = _HEADER + row * _LANE + 4 + radius + (order // per_row) * (2 * radius + 1) % (_LANE - 8)
        if mark.partner is not None and mark.partner in row_of:
            y0 = _HEADER + row_of[mark.partner] * _LANE + _LANE // 2
            yield f'<line class="copy-line" x1="{x}" y1="{y0}" x2="{x}" y2="{y}"/>'
        column = timeline.columns[mark.column]
        tip = f"call {column.call_index + 1} ({column.rule}): {mark.text}"
        yield f'<g class="mark mark-{mark.kind}" data-kind="{mark.kind}" data-call="{column.call_index + 1}" '
        yield f'data-lane="{mark.pool}-{mark.block}"><circle cx="{x}" cy="{y}" r="{radius}"/>'
        if radius >= 5:
            yield f'<text x="{x}" y="{y + 3.5}">{_e(GLYPHS[mark.kind])}</text>'
        yield f"<title>{_e(tip)}</title></g>"


def _legend() -> Iterator[str]:
    yield '<h2>Legend</h2><dl class="legend">'
    spans = (
        ("span-held", "held by one table entry (sequence/logical block)"),
        ("span-shared", "shared: several entries (refcount shown; red when the allocator's differs)"),
        ("span-pending", "released, in-flight work may still land"),
        ("span-held-pending", "referenced again while in-flight work may still land (a write breaks invariant 6)"),
        ("span-cached", "unreferenced, in the allocator's cached set"),
    )
    for span_class, text in spans:
        yield f'<div><svg width="18" height="12"><rect class="{span_class}" x="1" y="1" width="16" height="10"/></svg>'
        yield f"<dd>{_e(text)}</dd></div>"
    for kind, text in MARK_KINDS.items():
        yield f'<div class="mark-{kind}"><dt>{_e(GLYPHS[kind])}</dt><dd>{_e(text)}</dd></div>'
    yield "</dl>"


def _program(timeline: Timeline) -> Iterator[str]:
    yield "<h2>Program</h2>"
    first = timeline.columns[0].call_index + 1 if timeline.columns else 1
    yield f'<ol class="program" start="{first}">'
    failing = timeline.outcome.column
    for index, column in enumerate(timeline.columns):
        number = column.call_index + 1
        failing_class = ' class="failing"' if index == failing else ""
        yield f'<li id="call-{number}"{failing_class}><a href="#col-{number}">{_e(column.call)}</a></li>'
    yield "</ol>"


def _tables(timeline: Timeline) -> Iterator[str]:
    columns = timeline.columns
    if not columns or not any(column.tables for column in columns):
        return
    shown = columns[-MAX_TABLE_ROWS:]
    yield "<h2>Block tables after each call</h2>"
    if len(shown) < len(columns):
        yield f'<p class="note">after the last {len(shown)} calls; hover a column header for the tables each other '
        yield "call changed</p>"
    seqs = sorted({table.seq for column in shown for table in column.tables}, key=lambda s: (len(s), s))
    yield '<table class="tables"><tr><th>call</th><th>step</th>'
    yield "".join(f"<th>{_e(seq)}</th>" for seq in seqs) + "</tr>"
    failing = timeline.outcome.column
    offset = len(columns) - len(shown)
    for index, column in enumerate(shown, start=offset):
        by_seq = {table.seq: table for table in column.tables}
        failing_class = ' class="failing"' if index == failing else ""
        number = column.call_index + 1
        cells = []
        for seq in seqs:
            table = by_seq.get(seq)
            if table is None:
                cells.append("<td></td>")
            elif table.status == "swapped out":
                cells.append(f"<td>host {_e(list(table.host_table))}</td>")
            else:
                suffix = "" if table.status == "running" else f" ({table.status})"
                cells.append(f"<td>{_e(list(table.table))}{_e(suffix)}</td>")
        step = column.step if column.step >= 0 else ""
        yield f'<tr id="tables-{number}"{failing_class}><td><a href="#col-{number}">{number}</a> {_e(column.rule)}</td>'
        yield f"<td>{step}</td>{''.join(cells)}</tr>"
    yield "</table>"
