"""Write docs/images/serving-capacity.png: the plot of the capacity table docs/serving.md shows, from the same
command (read from that page's sample marker, so the two cannot drift apart), with ``--plot``.

Usage: ``python scripts/capacity_plot.py`` (needs matplotlib: ``pip install '.[plot]'``).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "serving.md"
IMAGE = ROOT / "docs" / "images" / "serving-capacity.png"
MARKER = re.compile(r"^<!-- sample: (kvfuzz capacity[^;]*?) -->$", re.MULTILINE)


def capacity_command() -> list[str]:
    """The arguments of the capacity sample on docs/serving.md (after ``kvfuzz``)."""
    found = MARKER.search(PAGE.read_text())
    if found is None:
        raise SystemExit(f"{PAGE}: no 'kvfuzz capacity' sample marker")
    return shlex.split(found.group(1))[1:]


def main() -> int:
    from kvfuzz.cli import main as kvfuzz

    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    return kvfuzz([*capacity_command(), "--plot", str(IMAGE.relative_to(ROOT))])


if __name__ == "__main__":
    sys.exit(main())
