"""The version matrix and harness errors without an engine installed: the one line an untested engine version gets
(kvfuzz.scheduler.engines) from ``run`` and ``campaign``, the protocol kvfuzz speaks to each vLLM release
(kvfuzz.scheduler.vllm_release), and which exceptions are kvfuzz's own (kvfuzz.scheduler.harness). The engines
themselves are tested in their environments (engine_tests/test_vllm_scheduler_versions.py,
engine_tests/test_vllm_scheduler_harness.py, engine_tests/test_sglang_scheduler_versions.py)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler import engines, vllm_release
from kvfuzz.scheduler.harness import KVFUZZ_PACKAGE, HarnessError, raise_if_kvfuzz_s, raised_by_kvfuzz
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], None]]:
    """``installed(package, version)``: the engine's installed version as kvfuzz reads it (without importing it)."""
    versions: dict[str, str] = {}
    monkeypatch.setattr(engines.Engine, "installed", lambda self: versions.get(self.package))
    monkeypatch.setattr(vllm_release, "installed_version", lambda package: versions.get(package, "unknown"))
    vllm_release.vllm_release.cache_clear()
    yield versions.__setitem__
    vllm_release.vllm_release.cache_clear()


UNTESTED = [
    ("vllm-v1", "vllm", "0.35.0", "vLLM", "0.33.0 and 0.34.0"),
    ("sglang", "sglang", "0.5.21", "SGLang", "0.5.22 and 0.5.23"),
]


@pytest.mark.parametrize("command", ["run", "campaign"])
@pytest.mark.parametrize(("scheduler", "package", "version", "engine", "tested"), UNTESTED)
def test_an_untested_engine_version_is_one_line_naming_both_and_the_option(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    installed: Callable[[str, str], None],
    command: str,
    scheduler: str,
    package: str,
    version: str,
    engine: str,
    tested: str,
) -> None:
    installed(package, version)
    monkeypatch.chdir(tmp_path)
    status = main([command, "--scheduler", scheduler, "--corpus", str(tmp_path / "corpus")])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.splitlines() == [
        f"kvfuzz: --scheduler {scheduler}: {engine} {version} is installed, and kvfuzz is tested on {engine} "
        f"{tested} only; run it anyway with --untested-engine (a failure may then be kvfuzz not speaking this "
        "version)"
    ]
    assert not (tmp_path / "corpus").exists() and not (tmp_path / ".kvfuzz").exists()


@pytest.mark.parametrize(("scheduler", "package", "version", "engine", "tested"), UNTESTED)
def test_untested_engine_runs_it_after_a_warning_and_a_tested_version_needs_neither(
    installed: Callable[[str, str], None], scheduler: str, package: str, version: str, engine: str, tested: str
) -> None:
    installed(package, version)
    assert engines.engine_problem(scheduler, untested_engine=True) is None
    assert engines.untested_warning(scheduler) == (
        f"kvfuzz: warning: {engine} {version} is not a version kvfuzz is tested on ({tested}); its findings and "
        "harness errors may be kvfuzz not speaking it; its traces record the version"
    )
    for release in engines.ENGINES[scheduler].tested:
        installed(package, release)
        assert engines.engine_problem(scheduler, untested_engine=False) is None
        assert engines.untested_warning(scheduler) is None


@pytest.mark.parametrize(
    ("version", "spoken"),
    [("0.33.0", "0.33.0"), ("0.34.0", "0.34.0"), ("0.33.1", "0.33.0"), ("0.35.0", "0.34.0"), ("0.32.2", "0.33.0"),
     ("0.34.0rc1+cpu", "0.34.0"), ("unknown", "0.33.0")],
)  # fmt: skip
def test_each_vllm_release_is_spoken_to_with_its_own_or_the_nearest_older_tested_protocol(
    installed: Callable[[str, str], None], version: str, spoken: str
) -> None:
    installed("vllm", version)
    assert vllm_release.vllm_release() is vllm_release.TESTED[spoken]


def test_the_releases_protocols_differ_where_vllm_0_34_removed_model_runner_v1() -> None:
    v033, v034 = vllm_release.TESTED["0.33.0"], vllm_release.TESTED["0.34.0"]
    config = types.SimpleNamespace(use_v2_model_runner=False)
    assert not v033.runner_v2(config) and v033.runner_v2(types.SimpleNamespace(use_v2_model_runner=True))
    assert v034.runner_v2(types.SimpleNamespace())  # 0.34.0's VllmConfig has no use_v2_model_runner
    cached = types.SimpleNamespace(resumed_req_ids={"r1"})
    assert v033.resumed(cached) == {"r1"} and v034.resumed(types.SimpleNamespace()) == ()

    def output(**fields: Any) -> dict[str, Any]:
        return fields

    made = v033.runner_output(output, ["a", "b"], [[1], [2]], None)
    assert made == {"req_ids": ["a", "b"], "sampled_token_ids": [[1], [2]], "kv_connector_output": None,
                    "req_id_to_index": {"a": 0, "b": 1}}  # fmt: skip
    assert "req_id_to_index" not in v034.runner_output(output, ["a"], [[1]], None)


def _raised(action: Callable[[], Any]) -> BaseException:
    try:
        action()
    except BaseException as error:  # noqa: BLE001 -- the test classifies whatever it raised
        return error
    raise AssertionError("nothing was raised")


def _raised_in(filename: str, source: str, **names: Any) -> BaseException:
    """What ``source`` raises, run as code of ``filename`` (the classifier reads where a frame's code lives)."""
    return _raised(lambda: exec(compile(source, filename, "exec"), dict(names)))  # noqa: S102 -- the test's own


RENAMED = types.SimpleNamespace(scheduled_new_requests=[])  # a SchedulerOutput whose scheduled_new_reqs is renamed


def test_a_renamed_attribute_kvfuzz_reads_is_a_harness_error_naming_kvfuzz_s_line() -> None:
    error = _raised(lambda: vllm_release.TESTED["0.33.0"].resumed(RENAMED))  # kvfuzz's read of resumed_req_ids
    assert isinstance(error, AttributeError) and raised_by_kvfuzz(error)
    with pytest.raises(HarnessError) as raised:
        raise_if_kvfuzz_s(error, lambda: "vLLM 0.35.0")
    harness = raised.value
    assert isinstance(harness, HarnessError) and not isinstance(harness, Exception)  # Hypothesis never catches it
    assert harness.hint.startswith(
        "kvfuzz: harness error, not a finding: kvfuzz's own code raised AttributeError at "
        "kvfuzz/scheduler/vllm_release.py:"
    )
    assert " in resumed while driving vLLM 0.35.0; either kvfuzz has a bug or it does not speak this engine " in (
        harness.hint
    )
    assert "resumed_req_ids" in harness.traceback_text and harness.describe().endswith(harness.hint)


def test_an_exception_the_standard_library_raises_for_kvfuzz_s_call_is_kvfuzz_s() -> None:
    @dataclasses.dataclass
    class CachedRequestData:
        req_ids: list[str]

    worker = str(KVFUZZ_PACKAGE / "scheduler" / "worker.py")
    error = _raised_in(worker, "replace(cached, resumed_req_ids=set())", replace=dataclasses.replace,
                       cached=CachedRequestData([]))  # fmt: skip
    assert isinstance(error, TypeError) and raised_by_kvfuzz(error)
    assert "kvfuzz/scheduler/worker.py:1 in <module>" in HarnessError.of(error, "vLLM 0.35.0").hint


def test_the_engine_s_own_exceptions_and_kvfuzz_s_verdicts_stay_findings(tmp_path: Path) -> None:
    engine = str(tmp_path / "site-packages" / "vllm" / "v1" / "core" / "sched" / "scheduler.py")
    vllm_own = _raised_in(engine, "output.scheduled_new_reqs", output=RENAMED)
    assert isinstance(vllm_own, AttributeError) and not raised_by_kvfuzz(vllm_own)
    raise_if_kvfuzz_s(vllm_own, lambda: "vLLM 0.34.0")  # returns: the caller reports the engine's exception
    verdict = _raised(lambda: _violate())
    assert not raised_by_kvfuzz(verdict)
    raise_if_kvfuzz_s(verdict, lambda: "vLLM 0.34.0")
    typed_in = _raised_in("<stdin>", "output.scheduled_new_reqs", output=RENAMED)  # a monkeypatch typed at a prompt
    assert not raised_by_kvfuzz(typed_in)
    interrupt = _raised_in(str(KVFUZZ_PACKAGE / "scheduler" / "session.py"), "raise KeyboardInterrupt")
    assert not raised_by_kvfuzz(interrupt)


def _violate() -> None:
    raise SchedulerViolation(Check.OUTPUTS, 3, "r0", "expected token 5, found nothing")
