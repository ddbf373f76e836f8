"""The timeline page in a real browser: headless Chromium at 1280x800 draws it (a screenshot with the lanes and the
failure in it), its DOM holds the lanes, and the console stays silent.

Chromium is a system component (``apt-get install chromium``, as ``.ci/run`` does): a machine without it fails
these tests, loudly; they never skip for its absence. They are slow (Chromium starts for each), so a plain
``pytest`` leaves them to ``pytest --slow``, which the second step of ``.ci/run`` runs.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from test_timeline import NO_COPY_ON_WRITE, Page

from kvfuzz.saved.trace import load
from kvfuzz.timeline.html import render_html
from kvfuzz.timeline.record import record

pytestmark = pytest.mark.slow

WINDOW = "--window-size=1280,800"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(
        "headless Chromium is not installed (apt-get install chromium): the page cannot be checked in a browser"
    )


def _run(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
    )


def console_messages(stderr: str) -> list[str]:
    """What the page printed on the console, or errors it raised (Chromium logs both as CONSOLE lines)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("timeline") / "page.html"
    path.write_text(render_html(record(load(NO_COPY_ON_WRITE), str(NO_COPY_ON_WRITE))), encoding="utf-8")
    return path


def test_the_console_check_catches_an_error(tmp_path: Path) -> None:
    """The check below can fail: a page that logs an error and raises one is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>console.error('x'); missing();</script></body></html>")
    messages = console_messages(_run(WINDOW, "--dump-dom", bad.as_uri()).stderr)
    assert len(messages) == 2, messages


def test_the_dom_holds_the_lanes_and_the_console_is_silent(page: Path) -> None:
    done = _run(WINDOW, "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert console_messages(done.stderr) == []
    dom = Page(done.stdout)
    assert "lane-device-0" in dom.lanes()  # the shared block the failure names
    assert {"failing-column", "explanation", "call-4", "col-4"} <= dom.ids()
    assert dom.marks("failure") == [4]


def test_the_screenshot_shows_the_lanes_and_the_failure(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    done = _run(WINDOW, f"--screenshot={shot}", page.as_uri())
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    assert console_messages(done.stderr) == []
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (800, 1280)
    drawn = (pixels.min(axis=2) < 0.9).mean()
    assert drawn > 0.03, f"the screenshot is nearly blank ({drawn:.1%} drawn)"

    def near(colour: str) -> np.ndarray:
        rgb = np.array([int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
        return np.abs(pixels - rgb).max(axis=2) < 0.03

    assert near("#bee3f8").sum() > 500, "no lane span of a held block in view"
    assert near("#fbd38d").sum() > 500, "no span of the shared block in view"
    red = near("#c53030")
    assert red.sum() > 200, "the failure is not highlighted"
    assert red[:, 800:].sum() > 100, "the explanation beside the lanes is not in view at 1280 pixels"
