"""Draw the example timeline the README and docs/timeline.md show: ``docs/timeline.png``, the picture
``kvfuzz show --png`` draws of the trace that the README's walk-through (``kvfuzz run --allocator zoo:NoCopyOnWrite``)
saves, so that the picture tells the story of the program the README prints and explains.

Usage::

    python scripts/timeline_example.py            rewrite docs/timeline.png
    python scripts/timeline_example.py --check    change nothing; exit 1 if the committed picture differs from a
                                                  fresh one by more than font rendering does (see ``differs``)

``tests/test_timeline_example.py`` runs the check.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's kvfuzz, whatever copy is installed

from kvfuzz.commands.options import DEFAULT_CORPUS  # noqa: E402 -- after the path that finds it

PICTURE = ROOT / "docs" / "timeline.png"
WALKTHROUGH = "kvfuzz run --allocator zoo:NoCopyOnWrite"
"""The README's walk-through, as its sample region names it."""


def walkthrough_trace(corpus: Path) -> Path:
    """Run the walk-through as ``scripts/samples.py`` runs the README's sample (a fresh Python process from the
    repository root, derandomized, saving into ``corpus``) and return the trace it saved."""
    command = "import sys; from kvfuzz.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", command, *shlex.split(WALKTHROUGH)[1:], "--corpus", str(corpus)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    traces = sorted(corpus.glob("*.json"))
    if done.returncode != 1 or len(traces) != 1:
        raise RuntimeError(f"{WALKTHROUGH!r} exited {done.returncode} saving {len(traces)} traces:\n{done.stderr}")
    return traces[0]


def draw(out: Path) -> None:
    from kvfuzz.saved.trace import load
    from kvfuzz.timeline.png import render_png
    from kvfuzz.timeline.record import record

    with tempfile.TemporaryDirectory() as corpus:
        trace = walkthrough_trace(Path(corpus))
        render_png(record(load(trace), f"{DEFAULT_CORPUS}/{trace.name}"), out)  # as the README's reader names it


def differs(committed: Path, fresh: Path) -> Optional[str]:
    """Why ``committed`` is not the picture ``fresh`` is, or None: the same size, and pixels that differ by less than
    another machine's font rendering makes them (a mean difference under 2%)."""
    import matplotlib.image
    import numpy as np

    old, new = matplotlib.image.imread(committed), matplotlib.image.imread(fresh)
    if old.shape != new.shape:
        return f"size {old.shape[1]}x{old.shape[0]}, a fresh drawing is {new.shape[1]}x{new.shape[0]}"
    difference = float(np.abs(old - new).mean())
    return None if difference < 0.02 else f"pixels differ by {difference:.1%} on average"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/timeline.png is stale; change nothing")
    args = parser.parse_args(argv)
    if not args.check:
        draw(PICTURE)
        print(f"wrote {PICTURE.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as directory:
        fresh = Path(directory) / "timeline.png"
        draw(fresh)
        problem = differs(PICTURE, fresh) if PICTURE.is_file() else "missing"
    if problem is not None:
        print(f"{PICTURE.relative_to(ROOT)} is stale: {problem}; rewrite it with python scripts/timeline_example.py")
        return 1
    print(f"{PICTURE.relative_to(ROOT)} is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
