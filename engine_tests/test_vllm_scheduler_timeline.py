"""``kvfuzz show`` of a vLLM scheduler trace: the replay drawn as a timeline of requests over engine steps, as a page
(checked as HTML, and in headless Chromium: its DOM, a silent console and a screenshot with the lanes and the
failure in view) and a picture. The corpus trace of vLLM's waiting-queue bug is the subject: at step 6 request r2
waits in vLLM's waiting queue while vLLM still holds block 2 for it, which is the bug.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there, with Chromium from the
distribution); without vLLM, or without Chromium for the browser tests, it fails loudly rather than skipping."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler.snapshot import RequestAtStep
from kvfuzz.scheduler.trace import load
from kvfuzz.timeline.requests import record_requests
from kvfuzz.timeline.requests_html import COLOURS

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
WAITING_QUEUE = CORPUS / "vllm-v1-scheduler-offloading-waiting-queue-holds-blocks-a8dffbbfe266.json"
WINDOW = "--window-size=1280,800"


def test_the_timeline_shows_each_request_at_each_step_as_vllm_holds_it() -> None:
    trace = load(WAITING_QUEUE)
    timeline = record_requests(trace, str(WAITING_QUEUE))
    assert timeline.verdict == "reproduced" and timeline.failure == trace.failure.describe()  # observed, unchanged
    assert (timeline.failing_step, timeline.failing_request) == (6, "r2")
    assert timeline.requests == ("r0", "r1", "r2", "r3", "r4", "r5") and timeline.steps == (1, 2, 3, 4, 5, 6)
    lane = dict(zip(timeline.requests, timeline.cells))
    assert [cell.state if cell else None for cell in lane["r2"]] == [
        "waiting",
        "waiting",
        "loading",
        "loading",
        "loading",
        "waiting",
    ]
    assert lane["r2"][5] == RequestAtStep("waiting", "WAITING", 0, 0, (2,))  # the bug: waiting, and holding block 2
    first = lane["r0"][0]
    assert first is not None and (first.state, first.scheduled) == ("running", 2) and len(first.blocks) == 2
    assert all(cell is not None and cell.state == "finished" for cell in lane["r0"][1:])


def test_show_writes_the_page_beside_its_name_and_the_picture(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page, picture = tmp_path / "page.html", tmp_path / "timeline.png"
    assert main(["show", str(WAITING_QUEUE), "--html", str(page), "--png", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "replayed: reproduced at step 6, request r2 (6 steps)" in out and f"timeline: {page} and {picture}" in out
    text = page.read_text(encoding="utf-8")
    for element in ("lane-r2", "step-6", "failing-column", "explanation", "op-6"):
        assert f'id="{element}"' in text, element
    assert re.search(r'class="lane-label in-failure"[^>]*>r2<', text)
    assert "step 6: waiting (WAITING); 0 tokens scheduled, 0 computed; blocks held: 2" in text
    pixels = matplotlib.image.imread(picture)[..., :3]
    assert pixels.shape[1] >= 800 and _near(pixels, "#c53030").sum() > 100  # the failing step outlined in red
    assert _near(pixels, COLOURS["loading"][0]).sum() > 500  # r2's load


def _near(pixels: np.ndarray, colour: str) -> np.ndarray:
    rgb = np.array([int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return np.abs(pixels - rgb).max(axis=2) < 0.03


def _chromium(*arguments: str) -> subprocess.CompletedProcess:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            command = [found, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
            return subprocess.run([*command, *arguments], capture_output=True, text=True, timeout=120)
    pytest.fail("headless Chromium is not installed (apt-get install chromium): the page cannot be checked")


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("timeline") / "page.html"
    assert main(["show", str(WAITING_QUEUE), "--html", str(path)]) == 0
    return path


def test_chromium_draws_the_lanes_and_the_failure_with_a_silent_console(page: Path, tmp_path: Path) -> None:
    dom = _chromium(WINDOW, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert [line for line in dom.stderr.splitlines() if ":CONSOLE" in line] == []
    assert all(f'id="lane-r{n}"' in dom.stdout for n in range(6)) and 'id="failing-column"' in dom.stdout
    shot = tmp_path / "shot.png"
    done = _chromium(WINDOW, f"--screenshot={shot}", page.as_uri())
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (800, 1280)
    for state in ("waiting", "loading", "running", "finished"):
        assert _near(pixels, COLOURS[state][0]).sum() > 300, f"no {state} cell in view"
    red = _near(pixels, "#c53030")
    assert red.sum() > 200, "the failure is not highlighted"
    assert red[:, 800:].sum() > 100, "the explanation beside the lanes is not in view at 1280 pixels"
