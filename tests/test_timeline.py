"""``kvfuzz show``: every corpus trace draws; three failures draw the lanes and marks their story needs; bad input is
one line and exit status 2.

The expectations come from the traces themselves (their programs and recorded explanations) and from what each zoo
variant's slip is, never from the timeline the code under test recorded.
"""

from __future__ import annotations

import json
import os
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional

import pytest
from factories import kvfuzz

from kvfuzz.cli import main
from kvfuzz.engine.arguments import system_prompts
from kvfuzz.engine.config import MachineConfig
from kvfuzz.program.call import Call
from kvfuzz.registry import AllocatorNotFound, load_factory
from kvfuzz.saved.corpus import replay_trace
from kvfuzz.saved.trace import Trace, load, save
from kvfuzz.timeline import record as recording
from kvfuzz.timeline.html import render_html
from kvfuzz.timeline.png import render_png
from kvfuzz.timeline.record import failure_blocks, record
from kvfuzz.trace_files import is_trace_file
from kvfuzz.trace_saving import show_hint

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
CORPUS_TRACES = sorted(path for path in CORPUS.glob("*.json") if is_trace_file(path))
NO_COPY_ON_WRITE = CORPUS / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"
IMMEDIATE_REUSE = CORPUS / "immediatereuse-non-reuse-window-c5830dcc5ed1.json"


class Page(HTMLParser):
    """The elements of a page that the tests look at: every element's attributes, and the lane each is inside."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str], Optional[str]]] = []  # (tag, attributes, enclosing lane id)
        self._lanes: list[Optional[str]] = [None]
        self._void = {"meta", "line", "circle", "path", "br"}
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        attributes = {name: value or "" for name, value in attrs}
        lane = attributes["id"] if attributes.get("class") == "lane" else self._lanes[-1]
        self.elements.append((tag, attributes, lane))
        if tag not in self._void:
            self._lanes.append(lane)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        self.elements.append((tag, {name: value or "" for name, value in attrs}, self._lanes[-1]))

    def handle_endtag(self, tag: str) -> None:
        if tag not in self._void and len(self._lanes) > 1:
            self._lanes.pop()

    def lanes(self) -> set[str]:
        return {attributes["id"] for _, attributes, _ in self.elements if attributes.get("class") == "lane"}

    def marks(self, kind: str, lane: Optional[str] = None) -> list[int]:
        """The calls (numbered from 1) with a mark of ``kind`` (on ``lane``, ``device-3``, if given)."""
        return [
            int(attributes["data-call"])
            for _, attributes, _ in self.elements
            if attributes.get("data-kind") == kind and (lane is None or attributes.get("data-lane") == lane)
        ]

    def spans(self, lane: str) -> list[tuple[str, str, tuple[int, int]]]:
        """(class, holders, (first call, last call)) of every drawn span of the lane ``lane-device-3``."""
        found = []
        for tag, attributes, inside in self.elements:
            if tag == "rect" and inside == lane and "span" in attributes.get("class", "").split():
                first, last = attributes["data-calls"].split("-")
                found.append((attributes["class"], attributes["data-holders"], (int(first), int(last))))
        return found

    def holders_at(self, lane: str, call: int) -> tuple[str, str]:
        for span_class, holders, (first, last) in self.spans(lane):
            if first <= call <= last:
                return span_class, holders
        return "", ""

    def ids(self) -> set[str]:
        return {attributes["id"] for _, attributes, _ in self.elements if "id" in attributes}


def _loads_here(trace: Trace) -> bool:
    try:
        load_factory(trace.allocator)
    except AllocatorNotFound:
        return False
    return True


@pytest.mark.parametrize("path", CORPUS_TRACES, ids=lambda path: path.stem)
def test_every_corpus_trace_renders(path: Path) -> None:
    trace = load(path)
    page = render_html(record(trace, str(path)))
    parsed = Page(page)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert {"explanation", f"call-{len(trace.program)}"} <= parsed.ids()
    assert not [a for _, a, _ in parsed.elements if a.get("src") or a.get("rel") == "stylesheet"], "fetches something"
    if _loads_here(trace):
        # Every corpus trace is a known bug that still reproduces: its failing call is drawn, on lanes.
        assert parsed.lanes(), "no block lanes"
        assert "failing-column" in parsed.ids()
        assert 'id="verdict">reproduced<' in page
        named = {f"lane-{pool}-{block}" for pool, block in failure_blocks(trace.failure.get("explanation", ""))}
        assert named <= parsed.lanes(), f"blocks the recorded failure names have no lane: {named - parsed.lanes()}"
    else:
        assert "not replayed: cannot load the allocator" in page
        assert len(parsed.marks("write")) == 0


def test_copy_on_write_miss() -> None:
    """NoCopyOnWrite: s0 is admitted and written, forked into s1 (sharing block 0, which the recorded explanation
    names), then grown in place: the lane of block 0 shows both holders at the failing grow, and no copy."""
    trace = load(NO_COPY_ON_WRITE)
    assert [call.rule for call in trace.program] == ["admit", "step", "fork", "grow"]
    assert failure_blocks(trace.failure["explanation"]) == {("device", 0)}
    parsed = Page(render_html(record(trace, str(NO_COPY_ON_WRITE))))
    assert "lane-device-0" in parsed.lanes()
    assert parsed.marks("write", "device-0") == [2]  # the step writes s0's token
    assert 3 in parsed.marks("hold", "device-0")  # the fork shares it with s1
    assert parsed.holders_at("lane-device-0", 2)[1] == "s0/0"
    assert parsed.holders_at("lane-device-0", 4) == ("span span-shared", "s0/0 s1/0")
    assert parsed.marks("scheduled", "device-0")[-1] == 4  # the grow schedules s0's write into the shared block
    assert parsed.marks("failure") == [4]
    assert parsed.marks("cow") == [] and parsed.marks("fork-copy") == []  # the slip: no copy at all


def test_reuse_inside_the_inflight_window() -> None:
    """ImmediateReuse (W = 1): s0 is preempted before any step completed, and its block 2 (named by the recorded
    explanation) is handed to s1 at once: the lane shows the pending window opened by the preempt and still open
    when s1 takes the block at the failing readmit."""
    trace = load(IMMEDIATE_REUSE)
    rules = [call.rule for call in trace.program]
    assert "step" not in rules  # no step ever completes: every window opened stays open
    preempt_s0 = next(
        i for i, call in enumerate(trace.program, 1) if call.rule == "preempt" and dict(call.arguments)["seq"] == "s0"
    )
    assert ("device", 2) in failure_blocks(trace.failure["explanation"])
    parsed = Page(render_html(record(trace, str(IMMEDIATE_REUSE))))
    lane = "lane-device-2"
    assert lane in parsed.lanes()
    assert parsed.marks("pending", "device-2") == [preempt_s0]
    assert parsed.holders_at(lane, preempt_s0)[0] == "span span-pending"
    failing = len(trace.program)
    assert parsed.holders_at(lane, failing) == ("span span-held-pending", "s1/3")
    assert failing in parsed.marks("hold", "device-2")
    assert parsed.marks("failure", "device-2") == [failing]
    assert parsed.marks("window-closed") == []


def _stale_hit_trace() -> Trace:
    """MatchableAtAllocation registers full blocks when they are allocated: s1, admitted with s0's 8-token system
    prompt before any step, is told 8 tokens are cached that nobody wrote."""
    system = next(prompt for prompt in system_prompts(4) if len(prompt) == 8)
    program = [
        Call("admit", {"seq": "s0", "namespace": (), "system": system, "suffix": [1]}),
        Call("admit", {"seq": "s1", "namespace": (), "system": system, "suffix": [2]}),
    ]
    return Trace("zoo:MatchableAtAllocation", MachineConfig(), program, {"invariant": 9, "title": "cache soundness"}, 1)


def test_stale_cache_hit() -> None:
    parsed = Page(render_html(record(_stale_hit_trace(), "stale-hit.json")))
    hits = {
        lane
        for _, attributes, _ in parsed.elements
        if attributes.get("data-kind") == "hit"
        for lane in [attributes["data-lane"]]
    }
    assert len(hits) == 2  # s0's two full blocks, both served to s1 at its admission
    for lane in hits:
        assert parsed.marks("hit", lane) == [2]
        assert parsed.marks("hold", lane) == [1, 2]  # s0 took it, then s1
        index = parsed.holders_at(f"lane-{lane}", 2)[1].split()[0].split("/")[1]
        assert parsed.holders_at(f"lane-{lane}", 2) == ("span span-shared", f"s0/{index} s1/{index}")
    assert parsed.marks("write") == []  # no step ran: nothing was ever written
    assert parsed.marks("failure") == [2] and {parsed_lane for parsed_lane in hits} >= {
        attributes["data-lane"] for _, attributes, _ in parsed.elements if attributes.get("data-kind") == "failure"
    }
    assert "no write has put K/V here yet" in render_html(record(_stale_hit_trace(), "stale-hit.json"))


def test_swap_draws_host_lanes(tmp_path: Path) -> None:
    """A swap-out and swap-in draw the host block as a lane, with the copies both ways."""
    program = [
        Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1, 2, 3]}),
        Call("step", {}),
        Call("swap_out", {"seq": "s0"}),
        Call("swap_in", {"seq": "s0"}),
        Call("free", {"seq": "s0"}),
    ]
    trace = Trace("zoo:ImmediateReuse", MachineConfig(), program, {"invariant": 6, "title": "non-reuse window"}, 1)
    parsed = Page(render_html(record(trace, "swap.json")))
    host = [lane for lane in parsed.lanes() if lane.startswith("lane-host-")]
    assert len(host) == 1
    assert parsed.marks("swap-out", host[0].removeprefix("lane-")) == [3]
    assert len(parsed.marks("swap-in")) == 1 and parsed.marks("swap-in")[0] == 4


def test_png(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    render_png(record(load(NO_COPY_ON_WRITE), str(NO_COPY_ON_WRITE)), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    red = (pixels[..., 0] > 0.7) & (pixels[..., 1] < 0.35) & (pixels[..., 2] < 0.35)
    assert red.sum() > 20, "the failure is not drawn in red"


def test_show_command_writes_page_and_picture(tmp_path: Path) -> None:
    done = kvfuzz("show", str(NO_COPY_ON_WRITE), "--html", "page.html", "--png", "page.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "reproduced at call 4" in done.stdout
    assert (tmp_path / "page.html").read_text().startswith("<!DOCTYPE html>")
    assert (tmp_path / "page.png").stat().st_size > 1000


def test_show_defaults_to_a_page_beside_its_trace(tmp_path: Path) -> None:
    """Before: the page went into the current directory, wherever the trace was."""
    (tmp_path / "traces").mkdir()
    (tmp_path / "elsewhere").mkdir()
    trace = tmp_path / "traces" / NO_COPY_ON_WRITE.name
    trace.write_bytes(NO_COPY_ON_WRITE.read_bytes())
    done = kvfuzz("show", str(trace), cwd=tmp_path / "elsewhere")
    assert done.returncode == 0, done.stderr
    assert trace.with_suffix(".html").is_file() and not list((tmp_path / "elsewhere").iterdir())


def test_show_of_a_file_name_that_is_not_utf8_writes_its_page_and_prints_the_name_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a UnicodeEncodeError traceback (the name went into the page, which is written as UTF-8)."""
    name = os.fsdecode(b"tr\xffce.json")  # the byte 0xff, as Python reads it from the file system
    (tmp_path / name).write_bytes(NO_COPY_ON_WRITE.read_bytes())
    monkeypatch.chdir(tmp_path)
    assert main(["show", name]) == 0
    out = capsys.readouterr().out
    assert "tr\\udcffce.json: exclusive writes: reproduced at call 4" in out, out
    assert "timeline: tr\\udcffce.html" in out, out
    page = (tmp_path / os.fsdecode(b"tr\xffce.html")).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "tr\\udcffce.json" in page


def _refused(done, *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfuzz: "), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    for word in words:
        assert word in lines[0]


@pytest.mark.slow
def test_bad_input(tmp_path: Path) -> None:
    newer = json.loads(NO_COPY_ON_WRITE.read_text())
    newer["format"] = "kvfuzz-trace/2"
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    (tmp_path / "corrupt.json").write_text(NO_COPY_ON_WRITE.read_text()[:200])
    _refused(kvfuzz("show", "newer.json", cwd=tmp_path), "newer kvfuzz")
    _refused(kvfuzz("show", "corrupt.json", cwd=tmp_path), "not valid JSON")
    _refused(kvfuzz("show", "missing.json", cwd=tmp_path), "cannot read")
    _refused(kvfuzz("show", str(NO_COPY_ON_WRITE), "--html", "no/such/dir/page.html", cwd=tmp_path), "does not exist")
    assert not list(tmp_path.glob("*.html"))


def long_trace(calls_before: int) -> Trace:
    """NoCopyOnWrite's four failing calls after ``calls_before`` (a multiple of 3) harmless ones."""
    short = load(NO_COPY_ON_WRITE)
    program = []
    for number in range(calls_before // 3):
        seq = f"r{number}"
        program += [
            Call("admit", {"seq": seq, "namespace": (), "system": (), "suffix": [number % 4]}),
            Call("step", {}),
            Call("free", {"seq": seq}),
        ]
    return Trace(short.allocator, short.config, program + list(short.program), short.failure, short.declared_window)


def test_a_trace_over_the_limit_shows_the_window_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The limit is 10,000 calls (benchmarks/timeline.py draws such a trace); here it is lowered to 30, so that a
    40-call trace is over it, and the command is run in this process."""
    monkeypatch.setattr(recording, "MAX_COLUMNS", 30)
    path, _ = save(long_trace(36), tmp_path)
    assert main(["show", str(path), "--html", str(tmp_path / "page.html")]) == 0
    said = "the trace has 40 calls, more than the 30 a timeline shows: showing calls 11-40"
    assert said in capsys.readouterr().out
    page = (tmp_path / "page.html").read_text()
    assert said in page
    parsed = Page(page)
    assert "call-11" in parsed.ids() and "call-10" not in parsed.ids()
    assert parsed.marks("failure") == [40]
    # The block the failure names, from a plain replay: shared by s0 and s1 at the failing call.
    ((pool, block),) = failure_blocks(replay_trace(load(path)).outcome.failure.explain())
    assert parsed.holders_at(f"lane-{pool}-{block}", 40)[1] == "s0/0 s1/0"


def test_run_and_replay_point_at_the_timeline(tmp_path: Path) -> None:
    done = kvfuzz("replay", str(NO_COPY_ON_WRITE), cwd=tmp_path)
    assert show_hint(NO_COPY_ON_WRITE) in done.stdout
    run = kvfuzz("run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "30", "--seed", "1", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    saved = next((tmp_path / ".kvfuzz" / "corpus").glob("*.json"))
    assert show_hint(Path(".kvfuzz") / "corpus" / saved.name) in run.stdout


def test_an_allocator_that_cannot_be_built_is_one_line(tmp_path: Path) -> None:
    """A trace whose allocator raises when it is built is one line on standard error, not a traceback."""
    trace = load(NO_COPY_ON_WRITE)
    (tmp_path / "broken.py").write_text("def factory(spec):\n    raise RuntimeError('no pool for you')\n")
    path, _ = save(Trace("broken:factory", trace.config, trace.program, trace.failure, 1), tmp_path)
    done = kvfuzz(
        "show",
        str(path),
        "--html",
        "page.html",
        "--trust-allocator",
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(CORPUS.parent)])},
    )
    _refused(done, "replay could not start", "no pool for you")


def teardown_refcount_trace() -> Trace:
    """FreeForgetsSharedRefcount skips the decrement of blocks a sibling shares: ``s0`` is forked into ``s1``, the
    teardown frees ``s0``, and block 0 keeps refcount 2 with ``s1`` its only holder."""
    program = [
        Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1, 2, 3]}),
        Call("step", {}),
        Call("fork", {"child": "s1", "parent": "s0"}),
    ]
    return Trace("zoo:FreeForgetsSharedRefcount", MachineConfig(), program, {"invariant": 3, "title": "refcounts"}, 1)


def test_a_refcount_found_wrong_is_drawn_in_its_lane_not_only_in_hover_text(tmp_path: Path) -> None:
    """The teardown's column is one call wide: too narrow for ``s1/0 rc2≠1``, yet the refcount the failure is about
    must be on the lane (in red), not only in the span's title."""
    trace = teardown_refcount_trace()
    page = render_html(record(trace, "refcount.json"))
    lane = page.split('id="lane-device-0"', 1)[1].split("</g>", 1)[0]
    teardown = lane.rsplit("<rect ", 1)[1]
    assert 'data-calls="4-4"' in teardown and "refcount 2" in teardown  # the hover text had it already
    assert '<text class="span-text rc-bad"' in teardown and "rc2\u22601</text>" in teardown


def test_a_picture_labels_a_wrong_refcount_where_the_holders_do_not_fit() -> None:
    from kvfuzz.timeline.model import Cell, Holding
    from kvfuzz.timeline.png import span_label

    wrong = Cell((Holding("s1", 0),), refcount=2)
    assert span_label(wrong, 40) == "s1/0 rc2(!)"
    assert span_label(wrong, 8) == "rc2(!)"
    assert span_label(Cell((Holding("s1", 0),), refcount=1), 4) == ""


def test_the_picture_s_legend_stays_inside_it(tmp_path: Path) -> None:
    """Before: the legend's last columns ran past the picture's right edge ("enters the", "cache hit" cut off).
    Nothing is drawn in the picture's rightmost pixels: the legend has as many columns as fit."""
    import matplotlib.image

    from kvfuzz.timeline.png import render_png

    picture = tmp_path / "timeline.png"
    render_png(record(load(NO_COPY_ON_WRITE), str(NO_COPY_ON_WRITE)), picture)
    pixels = matplotlib.image.imread(picture)[..., :3]
    assert (pixels[:, -4:].min(axis=2) > 0.8).all(), "something is drawn at the picture's right edge"
