"""The known findings, one stage for every target (kvfuzz/campaign/known.py): which trace a finding is credited to
(the one recorded closest to where it was met), and a fixed bug's trace that reproduces, a regression reported as new
and never counted as known, for allocator campaigns as for scheduler ones (whose own tests are
engine_tests/test_vllm_scheduler_findings.py and tests/test_scheduler_redis.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest
from test_campaign_redis import redis_url  # noqa: F401 -- the fixture: a real redis-server on a free port

from kvfuzz.campaign.allocators import AllocatorTraces
from kvfuzz.campaign.known import Judged, KnownFindings, KnownTrace, Recorded, known_findings
from kvfuzz.cli import main
from kvfuzz.saved.corpus import trace_signature
from kvfuzz.saved.trace import TraceError, load, save

REPOSITORY = Path(__file__).resolve().parent.parent
NO_COPY_ON_WRITE = REPOSITORY / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"


CAUSE = "writes scheduled by grow into a block another table entry references"
"""The zoo slip's cause: the signature the corpus trace records."""


def _entry(where: str, kind: str, **fields: object) -> KnownTrace:
    return KnownTrace(where, Recorded(kind, fields))


def test_a_finding_is_credited_to_the_trace_recorded_closest_to_where_it_was_met() -> None:
    small = _entry("small.json", "V1", num_blocks=4, block_size=2, prefix_caching=True)
    large = _entry("large.json", "V1", num_blocks=64, block_size=2, prefix_caching=True)
    other_kind = _entry("v2.json", "V2", num_blocks=64, block_size=16, prefix_caching=False)
    known = KnownFindings.of([Judged("k", small), Judged("k", large), Judged("k", other_kind)])

    met_large = Recorded("V1", {"num_blocks": 64, "block_size": 2, "prefix_caching": True})
    assert known.credit("k", met_large) == "large.json; also small.json, v2.json"
    # the kind first: a V2 batch equal in every field to large.json is credited to the V2 trace
    met_v2 = Recorded("V2", {"num_blocks": 64, "block_size": 2, "prefix_caching": True})
    assert known.credit("k", met_v2).startswith("v2.json;")
    # among equals, the first judged (file-name order)
    assert known.credit("k", Recorded("V1", {"num_blocks": 16, "block_size": 2})).startswith("small.json;")


def test_a_regression_is_never_known_and_a_later_corpus_adds_traces_after_the_first() -> None:
    first = KnownFindings.of([Judged("a", _entry("a.json", "x")), Judged("b", _entry("b.json", "x"))])
    fixed = KnownFindings.of([Judged("a", _entry("a-fixed.json", "x"), regression=True)])
    later = KnownFindings.of([Judged("b", _entry("b-later.json", "x"))])

    both = first.then(fixed).then(later)
    assert "a" not in both and "a" in both.regressions  # a fixed bug back: reported, whatever else knows it
    assert [trace.where for trace in both.known["b"]] == ["b.json", "b-later.json"]
    assert both.where() == {"b": "b.json"}


def _regression_trace(directory: Path) -> Path:
    """The zoo slip's corpus trace, as a fixed bug's regression trace."""
    data = json.loads(NO_COPY_ON_WRITE.read_text())
    data.update(known_bug=None, fixed="the slip's fix, commit abc123")
    path = directory / NO_COPY_ON_WRITE.name
    path.write_text(json.dumps(data))
    return path


def test_an_allocator_trace_of_a_fixed_bug_loads_saves_and_refuses_to_be_a_known_bug_too(tmp_path: Path) -> None:
    trace = load(_regression_trace(tmp_path))
    assert trace.fixed == "the slip's fix, commit abc123" and trace.known_bug is None
    saved, _ = save(trace, tmp_path / "again")
    assert load(saved) == trace and json.loads(saved.read_text())["fixed"] == trace.fixed
    assert "fixed" not in json.loads(NO_COPY_ON_WRITE.read_text())  # absent unless set: older traces unchanged
    assert load(NO_COPY_ON_WRITE).fixed is None

    both = json.loads(NO_COPY_ON_WRITE.read_text())
    both["fixed"] = "a fix"
    (tmp_path / "both.json").write_text(json.dumps(both))
    with pytest.raises(TraceError, match="fixed: a trace of a fixed bug cannot be a known"):
        load(tmp_path / "both.json")


def test_an_allocator_trace_of_a_fixed_bug_that_reproduces_is_a_regression_not_known(tmp_path: Path) -> None:
    path = _regression_trace(tmp_path)
    signature = trace_signature(load(path), 10.0)
    assert signature is not None

    found = known_findings([tmp_path], AllocatorTraces(["zoo:NoCopyOnWrite"], 10.0))

    assert signature.key() not in found and not found.known  # counting it as known would hide the regression
    [(key, [trace])] = found.regressions.items()
    assert key == signature.key() and trace.where.endswith("(fixed: the slip's fix, commit abc123)")
    # the same trace without its fix: known, as every reproducing trace is
    plain = attrs.evolve(load(path), fixed=None)
    shutil.rmtree(tmp_path / "plain", ignore_errors=True)
    save(plain, tmp_path / "plain")
    assert signature.key() in known_findings([tmp_path / "plain"], AllocatorTraces(["zoo:NoCopyOnWrite"], 10.0))


def test_an_allocator_campaign_reports_a_fixed_bug_that_comes_back_as_a_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "known").mkdir()
    _regression_trace(tmp_path / "known")
    argv = ["campaign", "--allocator", "zoo:NoCopyOnWrite", "--max-examples", "60", "--workers", "1", "--seed", "1"]
    status = main([*argv, "--known", str(tmp_path / "known"), "--corpus", str(tmp_path / "corpus"), "--json"])
    result = json.loads(capsys.readouterr().out)

    [back] = [entry for entry in result["failures"] if entry["signature"]["cause"] == CAUSE]
    assert status == 1 and not any(entry["signature"]["cause"] == CAUSE for entry in result["known"]), result
    assert back["note"].startswith("REGRESSION: a fixed bug is back, "), back
    assert f"{NO_COPY_ON_WRITE.name} (fixed: the slip's fix, commit abc123)" in back["note"]


def test_a_regression_is_reported_though_a_shared_redis_claimed_the_bug_when_it_was_first_found(
    redis_url: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The claim the first campaign made when it found the bug outlives it in Redis: the regression is claimed on its
    # own, or it would be counted as "found earlier" and never reported.
    argv = ["campaign", "--allocator", "zoo:NoCopyOnWrite", "--max-examples", "60", "--workers", "1", "--seed", "1"]
    argv += ["--database", redis_url, "--json"]
    assert main([*argv, "--no-known", "--corpus", str(tmp_path / "first")]) == 1
    first = json.loads(capsys.readouterr().out)
    assert any(entry["signature"]["cause"] == CAUSE for entry in first["failures"]), first
    (tmp_path / "known").mkdir()
    _regression_trace(tmp_path / "known")

    main([*argv, "--known", str(tmp_path / "known"), "--corpus", str(tmp_path / "second")])
    second = json.loads(capsys.readouterr().out)

    [back] = [entry for entry in second["failures"] if entry["signature"]["cause"] == CAUSE]
    assert back["note"].startswith("REGRESSION: a fixed bug is back, "), back


def test_a_directory_named_twice_is_read_once(tmp_path: Path) -> None:
    # the campaign's own corpus is among its known ones (./corpus, the default of both): one trace, credited once
    shutil.copy(NO_COPY_ON_WRITE, tmp_path)
    found = known_findings([tmp_path, tmp_path / ".." / tmp_path.name], AllocatorTraces(["zoo:NoCopyOnWrite"], 10.0))
    [(key, traces)] = found.known.items()
    assert len(traces) == 1 and "; also" not in found.credit(key, traces[0].recorded)
