"""The timeline as a PNG picture through matplotlib (the plot extra), for CI logs, issues and pull requests.

The picture draws what the page draws, without hovering: one lane per block, spans coloured by who holds the block,
a letter per event (the page's legend), the failing column in red and the violated invariant's first lines below.
A timeline of more than :data:`MAX_PICTURE_COLUMNS` calls is drawn as the window of its last calls, which the
title says.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from kvfuzz.timeline.html import GLYPHS
from kvfuzz.timeline.model import Cell, Timeline

MAX_PICTURE_COLUMNS = 120
"""The most calls one picture draws legibly: a longer timeline is drawn from its last this many."""

_FILL = {
    "held": ("#bee3f8", "#3182ce"),
    "shared": ("#fbd38d", "#c05621"),
    "pending": ("#e2e8f0", "#718096"),
    "held-pending": ("#fed7d7", "#c53030"),
    "cached": ("#c6f6d5", "#38a169"),
}
_MARK_COLOURS = {
    "write": "#2b6cb0",
    "cow": "#805ad5",
    "fork-copy": "#805ad5",
    "swap-in": "#319795",
    "swap-out": "#319795",
    "land": "#c05621",
    "failure": "#c53030",
}


def _state(cell: Cell) -> str:
    if cell.holders and cell.pending:
        return "held-pending"
    if len(cell.holders) > 1:
        return "shared"
    if cell.holders:
        return "held"
    if cell.pending:
        return "pending"
    return "cached" if cell.cached else ""


def render_png(timeline: Timeline, path: Path) -> None:
    """Draw ``timeline`` into the PNG file ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = max(0, len(timeline.columns) - MAX_PICTURE_COLUMNS)
    columns = timeline.columns[first:]
    lanes = timeline.lanes
    count = max(len(columns), 1)
    width = min(18.0, max(7.0, 2.2 + 0.5 * count))
    wrapped = [
        piece
        for line in timeline.outcome.explanation.splitlines()
        for piece in textwrap.wrap(line, int(width * 16), subsequent_indent="    ") or [""]
    ]
    explanation = "\n".join(wrapped[:14] + (["..."] if len(wrapped) > 14 else []))
    text_lines = explanation.count("\n") + 1
    height = 1.6 + 0.42 * max(len(lanes), 1) + 0.16 * text_lines
    figure, axes = plt.subplots(figsize=(width, height), dpi=100)
    try:
        failing = timeline.outcome.column
        if failing is not None and failing >= first:
            axes.axvspan(failing - first, failing - first + 1, color="#fed7d7", zorder=0)
        for row, (lane, cells) in enumerate(zip(lanes, timeline.cells)):
            y = len(lanes) - 1 - row
            cells = cells[first:]
            start = 0
            for index in range(1, len(cells) + 1):
                if index < len(cells) and cells[index] == cells[start]:
                    continue
                state = _state(cells[start])
                if state:
                    face, edge = _FILL[state]
                    axes.broken_barh(
                        [(start + 0.04, index - start - 0.08)], (y - 0.34, 0.68), facecolors=face, edgecolors=edge
                    )
                    holders = " ".join(map(str, cells[start].holders))
                    if holders and (index - start) * 0.5 * 72 / 6.5 >= len(holders):
                        axes.text(start + 0.1, y - 0.22, holders, fontsize=7, family="monospace")
                start = index
        row_of = {lane.key: len(lanes) - 1 - row for row, lane in enumerate(lanes)}
        stacked: dict[tuple[int, tuple[str, int]], int] = {}
        for mark in timeline.marks:
            if mark.column < first:
                continue
            key = (mark.pool, mark.block)
            order = stacked.get((mark.column, key), 0)
            stacked[(mark.column, key)] = order + 1
            x = mark.column - first + 0.16 + 0.22 * (order % 4)
            y = row_of[key] + 0.18
            colour = _MARK_COLOURS.get(mark.kind, "#4a5568")
            if mark.partner is not None and mark.partner in row_of:
                axes.annotate(
                    "",
                    xy=(x, y),
                    xytext=(x, row_of[mark.partner]),
                    arrowprops={"arrowstyle": "->", "color": "#805ad5", "lw": 1.2},
                )
            axes.text(x, y, GLYPHS[mark.kind], fontsize=8, color=colour, ha="center", va="center", weight="bold")
        axes.set_yticks(range(len(lanes)))
        axes.set_yticklabels(
            [lane.label + (f"\n{lane.library_name}" if lane.library_name else "") for lane in reversed(lanes)],
            fontsize=8,
        )
        for label, lane in zip(axes.get_yticklabels(), reversed(lanes)):
            if lane.in_failure:
                label.set_color("#c53030")
                label.set_fontweight("bold")
        every = max(1, count // 30)
        ticks = list(range(0, len(columns), every))
        axes.set_xticks([tick + 0.5 for tick in ticks])
        axes.set_xticklabels(
            [f"{columns[tick].call_index + 1}\n{columns[tick].rule}" for tick in ticks], fontsize=7
        )
        axes.set_xlim(0, count)
        axes.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
        axes.set_xlabel("call (and its operation)", fontsize=8)
        outcome = timeline.outcome
        window = f" (calls {columns[0].call_index + 1}-{columns[-1].call_index + 1} of {timeline.total_calls})" if first or len(timeline.columns) < timeline.total_calls else ""
        badge = f"invariant {outcome.invariant}" if outcome.invariant is not None else "crash"
        axes.set_title(
            f"{timeline.allocator}: {badge}, {outcome.title} ({outcome.verdict}){window}", fontsize=10, loc="left"
        )
        figure.text(0.01, 0.01, explanation, fontsize=7, family="monospace", va="bottom", color="#742a2a")
        figure.tight_layout(rect=(0, 0.16 * text_lines / height + 0.02, 1, 1))
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
