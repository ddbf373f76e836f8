"""A scheduler trace's timeline as a PNG (matplotlib, the plot extra): the page's lanes, a row per request and a
column per step, coloured by state, the failing step outlined and the failing request's label in red, the legend
below the lanes (laid out to fit the picture's width) and the failure under it."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from kvfuzz.scheduler.snapshot import REQUEST_STATES
from kvfuzz.timeline.requests import RequestTimeline, block_label
from kvfuzz.timeline.requests_html import COLOURS

LEGEND_COLUMNS = 4
"""States per row of the legend: four fit the picture's narrowest width (8 inches) with their labels."""


def render_requests_png(timeline: RequestTimeline, path: Path) -> None:
    """Draw ``timeline`` into the PNG file ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    count = max(len(timeline.steps), 1)
    lanes = max(len(timeline.requests), 1)
    width = min(18.0, max(8.0, 1.2 + 0.3 * count))
    wrapped = [
        piece
        for line in (timeline.failure or "every check passed, the drain included").splitlines()
        for piece in textwrap.wrap(line, int(width * 14), subsequent_indent="    ") or [""]
    ]
    failure = "\n".join(wrapped[:10] + (["..."] if len(wrapped) > 10 else []))
    text_inches = 0.14 * (failure.count("\n") + 1) + 0.15
    legend_rows = -(-(len(REQUEST_STATES)) // LEGEND_COLUMNS)
    legend_inches = 0.22 * legend_rows + 0.1
    lanes_inches = 0.32 * lanes
    bottom_inches = 0.45 + legend_inches + text_inches
    height = 0.5 + lanes_inches + bottom_inches
    figure = plt.figure(figsize=(width, height), dpi=100)
    axes = figure.add_axes((0.8 / width, bottom_inches / height, 1 - 1.0 / width, lanes_inches / height))
    try:
        for row, cells in enumerate(timeline.cells):
            y = lanes - 1 - row
            for column, cell in enumerate(cells):
                if cell is None:
                    continue
                fill, stroke = COLOURS[cell.state]
                axes.add_patch(
                    Rectangle((column + 0.05, y - 0.38), 0.9, 0.76, facecolor=fill, edgecolor=stroke, lw=0.6)
                )
                if count <= 40:  # room for words: the tokens scheduled above, the blocks held below
                    if cell.scheduled:
                        axes.text(column + 0.5, y + 0.02, f"{cell.scheduled} tok", fontsize=6, ha="center")
                    if cell.blocks:
                        blocks = block_label(cell.blocks, width * 9 / count)
                        axes.text(column + 0.5, y - 0.3, blocks, fontsize=5.5, ha="center", color="#4a5568")
        failing = timeline.failing_column
        if failing is not None:
            axes.add_patch(Rectangle((failing, -0.5), 1, lanes, fill=False, edgecolor="#c53030", lw=2.0))
        axes.set_xlim(0, count)
        axes.set_ylim(-0.6, lanes - 0.4)
        axes.set_yticks(range(len(timeline.requests)))
        axes.set_yticklabels(list(reversed(timeline.requests)), fontsize=8)
        for tick_label, request in zip(axes.get_yticklabels(), reversed(timeline.requests)):
            if request == timeline.failing_request:
                tick_label.set_color("#c53030")
                tick_label.set_fontweight("bold")
        every = max(1, -(-count // 30))
        ticks = [column for column in range(len(timeline.steps)) if column % every == 0 or column == failing]
        axes.set_xticks([tick + 0.5 for tick in ticks])
        axes.set_xticklabels([str(timeline.steps[tick]) for tick in ticks], fontsize=7)
        axes.set_xlabel("step", fontsize=8)
        name = timeline.trace.rsplit("/", 1)[-1]
        axes.set_title(f"{name}: {timeline.verdict}", fontsize=9, loc="left")
        handles: list[Any] = [
            Patch(facecolor=COLOURS[state][0], edgecolor=COLOURS[state][1], label=f"{state}")
            for state in REQUEST_STATES
        ]
        figure.legend(
            handles=handles,
            loc="lower left",
            bbox_to_anchor=(0.01, (text_inches + 0.02) / height),
            ncol=LEGEND_COLUMNS,
            fontsize=7,
            frameon=False,
        )
        figure.text(0.01, 0.06 / height, failure, fontsize=7, family="monospace", va="bottom", color="#742a2a")
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
