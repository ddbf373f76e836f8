"""The timeline as a PNG picture through matplotlib (the plot extra), for CI logs, issues and pull requests.

The picture draws what the page draws, without hovering: one lane per block, spans coloured by who holds the block,
one marker per event (keyed below the lanes), the failing column in red and the explanation's first lines below. A
timeline of more than :data:`MAX_PICTURE_COLUMNS` calls is drawn as the window of its last calls, which the title
says. Markers of one kind are one scatter collection and the layout is computed, not measured (no tight_layout),
so a picture takes about the same time whatever the trace's length.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from kvfuzz.timeline.model import Cell, Timeline

MAX_PICTURE_COLUMNS = 120
"""The most calls one picture draws legibly: a longer timeline is drawn from its last this many."""
LEGEND_COLUMN_INCHES = 2.0
"""The width a legend column takes, its longest label ("released, work in flight may land") at 6.5 points
included: the legend has as many columns as fit the picture, never running past its right edge."""
MAX_SPAN_LABELS = 80
"""Spans labelled with their holders, at most (a wrong refcount first, then the widest); the page has every one."""

_FILL = {
    "held": ("#bee3f8", "#3182ce", "held by one table entry"),
    "shared": ("#fbd38d", "#c05621", "shared"),
    "pending": ("#e2e8f0", "#718096", "released, work in flight may land"),
    "held-pending": ("#fed7d7", "#c53030", "referenced while work may land"),
    "cached": ("#c6f6d5", "#38a169", "in the allocator's cached set"),
}
# kind -> (marker, colour, size, label) of the markers drawn for each kind of mark
_MARKERS = {
    "hold": ("P", "#2d3748", 26, "takes the block"),
    "release": ("_", "#2d3748", 40, "lets go"),
    "scheduled": ("o", "none", 22, "next step writes here"),
    "write": ("o", "#2b6cb0", 26, "a step wrote"),
    "cow": ("s", "#805ad5", 30, "copy-on-write"),
    "fork-copy": ("D", "#805ad5", 26, "fork copy"),
    "swap-out": ("^", "#319795", 30, "swap-out"),
    "swap-in": ("v", "#319795", 30, "swap-in"),
    "pending": ("x", "#4a5568", 30, "released, work in flight"),
    "window-closed": ("|", "#4a5568", 40, "window closed"),
    "land": ("*", "#c05621", 60, "late work landed"),
    "cached": ("p", "#38a169", 30, "enters the cache"),
    "hit": ("h", "#2f855a", 34, "cache hit"),
    "evicted": ("X", "#38a169", 30, "evicted"),
    "failure": ("*", "#c53030", 110, "the failure"),
}
_UNFILLED = {"_", "x", "|"}  # markers drawn as lines: coloured, not outlined
_OFFSETS = {kind: index for index, kind in enumerate(_MARKERS)}


def _state(cell: Cell) -> str:
    """The cell's state, with a free block drawn as nothing."""
    return "" if cell.state == "free" else cell.state


def _labels(cell: Cell) -> tuple[str, ...]:
    """What a span may say, longest first: its holders with the allocator's refcount (``rcN(!)`` where it differs
    from the holders kvfuzz counts), then, for such a wrong refcount, the refcount alone, which the lane must show
    even where the holders do not fit."""
    holders = " ".join(map(str, cell.holders))
    refcount = cell.refcount
    if refcount is not None and refcount != len(cell.holders):
        return (f"{holders} rc{refcount}(!)".strip(), f"rc{refcount}(!)")
    return (f"{holders} rc{refcount}" if refcount is not None and refcount > 1 else holders,)


def span_label(cell: Cell, characters: float) -> str:
    """The longest of the span's labels that fits in ``characters`` characters ("" if none does)."""
    return next((label for label in _labels(cell) if label and characters >= len(label) + 1), "")


def render_png(timeline: Timeline, path: Path) -> None:
    """Draw ``timeline`` into the PNG file ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    first = max(0, len(timeline.columns) - MAX_PICTURE_COLUMNS)
    columns = timeline.columns[first:]
    lanes = timeline.lanes
    count = max(len(columns), 1)
    width = min(18.0, max(8.0, 1.6 + 0.45 * count))
    wrapped = [
        piece
        for line in timeline.outcome.explanation.splitlines()
        for piece in textwrap.wrap(line, int(width * 16), subsequent_indent="    ") or [""]
    ]
    explanation = "\n".join(wrapped[:12] + (["..."] if len(wrapped) > 12 else []))
    text_inches = 0.13 * (explanation.count("\n") + 1) + 0.2
    legend_columns = max(2, int((width - 0.2) / LEGEND_COLUMN_INCHES))  # as many as fit the picture's width
    legend_rows = -(-(len(_FILL) + len(_MARKERS)) // legend_columns)
    legend_inches = 0.15 * legend_rows + 0.15
    lanes_inches = 0.42 * max(len(lanes), 1)
    bottom_inches = 0.55 + legend_inches + text_inches
    height = 0.45 + lanes_inches + bottom_inches
    figure = plt.figure(figsize=(width, height), dpi=100)
    axes = figure.add_axes((1.4 / width, bottom_inches / height, 1 - 1.55 / width, lanes_inches / height))
    column_inches = (width - 1.55) / count
    try:
        failing = timeline.outcome.column
        if failing is not None and failing >= first:
            axes.axvspan(failing - first, failing - first + 1, color="#fed7d7", zorder=0)
        spans: dict[str, list[tuple[int, tuple[float, float]]]] = {state: [] for state in _FILL}
        labels: list[tuple[bool, float, int, int, str]] = []
        for row, cells in enumerate(timeline.cells):
            y = len(lanes) - 1 - row
            cells = cells[first:]
            start = 0
            for index in range(1, len(cells) + 1):
                if index < len(cells) and cells[index] == cells[start]:
                    continue
                state = _state(cells[start])
                if state:
                    spans[state].append((y, (start + 0.04, index - start - 0.08)))
                    text = span_label(cells[start], (index - start) * column_inches * 72 / 4.4)
                    if text:  # a wrong refcount first, then the widest spans
                        labels.append(("(!)" in text, index - start, start, y, text))
                start = index
        for state, (face, edge, _) in _FILL.items():
            for y, extent in spans[state]:
                axes.broken_barh([extent], (y - 0.34, 0.68), facecolors=face, edgecolors=edge, linewidth=0.8)
        for _, _, start, y, text in sorted(labels, reverse=True)[:MAX_SPAN_LABELS]:
            axes.text(start + 0.1, y - 0.2, text, fontsize=7, family="monospace")
        row_of = {lane.key: len(lanes) - 1 - row for row, lane in enumerate(lanes)}
        points: dict[str, tuple[list[float], list[float]]] = {kind: ([], []) for kind in _MARKERS}
        arrows: list[Any] = []
        for mark in timeline.marks:
            if mark.column < first:
                continue
            x = mark.column - first + 0.1 + 0.8 * _OFFSETS[mark.kind] / len(_MARKERS)
            mark_y = row_of[(mark.pool, mark.block)] + 0.17
            points[mark.kind][0].append(x)
            points[mark.kind][1].append(mark_y)
            if mark.partner is not None and mark.partner in row_of:
                arrows.append(((x, row_of[mark.partner]), (x, mark_y)))
        for start_point, end_point in arrows:
            axes.annotate(
                "", xy=end_point, xytext=start_point, arrowprops={"arrowstyle": "->", "color": "#805ad5", "lw": 1.1}
            )
        handles: list[Any] = [
            Patch(facecolor=face, edgecolor=edge, label=label) for state, (face, edge, label) in _FILL.items()
        ]
        for kind, (marker, colour, size, label) in _MARKERS.items():
            edge = "#2b6cb0" if colour == "none" else colour
            xs, ys = points[kind]
            if xs:
                if marker in _UNFILLED:
                    axes.scatter(xs, ys, marker=marker, s=size, c=edge, zorder=3)
                else:
                    axes.scatter(xs, ys, marker=marker, s=size, c=colour, edgecolors=edge, zorder=3)
            handles.append(Line2D([], [], marker=marker, linestyle="", color=edge, markerfacecolor=colour, label=label))
        axes.set_yticks(range(len(lanes)))
        axes.set_yticklabels(
            [lane.label + (f"\n{lane.library_name}" if lane.library_name else "") for lane in reversed(lanes)],
            fontsize=8,
        )
        for tick_label, lane in zip(axes.get_yticklabels(), reversed(lanes)):
            if lane.in_failure:
                tick_label.set_color("#c53030")
                tick_label.set_fontweight("bold")
        every = max(1, -(-count // 24))
        ticks = list(range(0, len(columns), every))
        axes.set_xticks([tick + 0.5 for tick in ticks])
        axes.set_xticklabels([f"{columns[tick].call_index + 1}\n{columns[tick].rule}" for tick in ticks], fontsize=7)
        axes.set_xlim(0, count)
        axes.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
        outcome = timeline.outcome
        shown = first or len(timeline.columns) < timeline.total_calls
        window = (
            f" (calls {columns[0].call_index + 1}-{columns[-1].call_index + 1} of {timeline.total_calls})"
            if shown and columns
            else ""
        )
        badge = f"invariant {outcome.invariant}" if outcome.invariant is not None else "crash"
        axes.set_title(
            f"{timeline.allocator}: {badge}, {outcome.title} ({outcome.verdict}){window}", fontsize=10, loc="left"
        )
        figure.legend(
            handles=handles,
            loc="lower left",
            bbox_to_anchor=(0.01, (text_inches + 0.02) / height),
            ncol=legend_columns,
            fontsize=6.5,
            frameon=False,
            handlelength=1.2,
            columnspacing=1.0,
        )
        figure.text(0.01, 0.06 / height, explanation, fontsize=7, family="monospace", va="bottom", color="#742a2a")
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
