"""``kvfuzz campaign --coverage`` on allocators: each worker measures its allocators' own code over every batch (the
measurers of docs/coverage.md), never kvfuzz's harness, and the campaign reports the union in its table and its
``--json``, and as an HTML report with ``--coverage-html``, as a scheduler campaign does. Which code is an
allocator's: kvfuzz/coverage/scope.py's ``allocator_scope``."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

import kvfuzz
from kvfuzz.coverage.scope import Scope, allocator_scope
from kvfuzz.registry import load_factory

KVFUZZ = os.path.realpath(Path(kvfuzz.__file__).parent)

USER_ALLOCATOR = """
from kvfuzz.allocator.paged import paged_allocator


def factory(spec):
    return paged_allocator(spec)


def never_called():
    return "a line no campaign reaches"
"""


def test_kvfuzz_s_own_allocator_is_its_allocator_package_and_a_zoo_one_adds_the_zoo() -> None:
    assert allocator_scope(load_factory("kvfuzz")).roots == (os.path.join(KVFUZZ, "allocator"),)
    assert allocator_scope(load_factory("zoo:NoCopyOnWrite")).roots == (
        os.path.join(KVFUZZ, "allocator"),
        os.path.join(KVFUZZ, "zoo"),
    )


@pytest.fixture
def importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tmp_path`` on ``sys.path``; the modules imported from it are forgotten after the test (pytester's runs in
    this process would find them under their names)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def test_a_user_s_allocator_is_its_module_or_its_package(importable: Path) -> None:
    (importable / "scope_module.py").write_text(USER_ALLOCATOR)
    (importable / "scope_package").mkdir()
    (importable / "scope_package" / "__init__.py").write_text("")
    (importable / "scope_package" / "pool.py").write_text(USER_ALLOCATOR)
    real = os.path.realpath(importable)
    assert allocator_scope(load_factory("scope_module:factory")).roots == (os.path.join(real, "scope_module.py"),)
    assert allocator_scope(load_factory("scope_package.pool:factory")).roots == (os.path.join(real, "scope_package"),)


def test_an_adapter_s_scope_is_the_engine_package_it_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter is kvfuzz's code, never measured: its module's CODE_UNDER_TEST names the engine's package (attrs
    stands in for the engine here); an adapter that declares none (llama.cpp's, whose allocator is C++) has none."""
    adapter = ModuleType("kvfuzz.adapters.stand_in")
    adapter.__file__ = os.path.join(KVFUZZ, "adapters", "stand_in.py")
    adapter.CODE_UNDER_TEST = ("attr", ("_make.py",))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, adapter.__name__, adapter)

    def factory(spec: object) -> None: ...

    factory.__module__ = adapter.__name__
    import attr as engine

    assert allocator_scope(factory).roots == (os.path.realpath(Path(engine.__file__).parent / "_make.py"),)
    del adapter.CODE_UNDER_TEST  # type: ignore[attr-defined]
    assert allocator_scope(factory) == Scope(())


def test_the_harness_is_in_no_scope_even_under_a_root_that_holds_it() -> None:
    files = Scope((KVFUZZ,)).files()
    assert files and all(Path(file).relative_to(KVFUZZ).parts[0] in ("allocator", "zoo") for file in files), (
        "kvfuzz's engine, machine and campaign are the harness"
    )


def test_an_allocator_campaign_reports_the_coverage_of_the_user_s_allocator(
    importable: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import _parser, main

    tmp_path = importable
    (tmp_path / "campaign_allocator.py").write_text(USER_ALLOCATOR)
    monkeypatch.chdir(tmp_path)
    argv = [
        "campaign",
        "--allocator",
        "campaign_allocator:factory",
        "--workers",
        "1",
        "--max-examples",
        "20",
        "--seed",
        "5",
    ]
    status = main([*argv, "--no-known", "--corpus", "c", "--coverage-html", "report", "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    coverage = json.loads(captured.out)["coverage"]
    [measured] = coverage["files"]
    assert measured["path"] == os.path.realpath(tmp_path / "campaign_allocator.py")
    assert (measured["lines"], measured["lines_reached"]) == (4, 2), measured
    reached = set(coverage["points"][measured["path"]]["lines"])
    assert reached == {5, 6}, "factory's lines (def and return), never never_called's (9 and 10)"
    assert [entry["new_lines"] for entry in coverage["timeline"]] == [2], "all of it in the first batch"
    assert "coverage report: report/index.html" in captured.err
    assert "campaign_allocator.py" in (tmp_path / "report" / "index.html").read_text()
    rerun = shlex.split(json.loads(captured.out)["rerun_command"])
    assert "--coverage" in rerun and _parser().parse_args(rerun[1:]).coverage


def test_the_table_says_the_coverage_and_a_guided_campaign_keeps_its_seeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import _parser, main

    monkeypatch.chdir(tmp_path)
    argv = ["campaign", "--workers", "1", "--max-examples", "10", "--seed", "5", "--no-known"]
    assert main([*argv, "--corpus", "c", "--coverage"]) == 0
    out = capsys.readouterr().out
    assert "coverage of the allocators' own code measured" in out
    [line] = [line for line in out.splitlines() if line.startswith("coverage: ")]
    assert "files of the code under test" in line and not line.startswith("coverage: 0 of")
    assert not (tmp_path / "c" / ".kvfuzz-campaign" / "seeds").exists(), "--coverage alone keeps no seeds"
    assert main([*argv, "--corpus", "g", "--guided", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["coverage"]["lines_reached"] > 0 and result["rerun"]["guided"]
    assert _parser().parse_args(shlex.split(result["rerun_command"])[1:]).guided
    seeds = [json.loads(path.read_text()) for path in (tmp_path / "g" / ".kvfuzz-campaign" / "seeds").iterdir()]
    assert seeds and {seed["config"]["allocator"] for seed in seeds} == set(result["allocators"])


@pytest.mark.parametrize(
    "spec, measured",
    [
        (
            "kvfuzz.adapters.hf_transformers:paged_attention_cache",
            "transformers/generation/continuous_batching/cache.py",
        ),
        ("kvfuzz.adapters.torch_paged:paged_attention", "torch/nn/attention/experimental/_paged_attention.py"),
    ],
)
def test_the_adapters_of_this_environment_declare_their_engine_s_code(spec: str, measured: str) -> None:
    """The README's test environment has transformers and torch; the engines' adapters are checked in theirs
    (engine_tests/test_vllm_v1.py, test_vllm_v0.py, test_sglang.py)."""
    files = allocator_scope(load_factory(spec)).files()
    assert any(file.endswith(measured) for file in files), files
    assert not any(file.startswith(KVFUZZ + os.sep) for file in files), "the adapter itself is harness"


def test_a_partial_or_a_wrapped_factory_is_measured_where_its_function_lives() -> None:
    """Before: a functools.partial's module is functools, so Python's own functools.py was measured."""
    import functools

    from kvfuzz.allocator.paged import paged_allocator

    own = (os.path.join(KVFUZZ, "allocator"),)
    assert allocator_scope(functools.partial(paged_allocator)).roots == own
    assert allocator_scope(functools.partial(functools.partial(paged_allocator))).roots == own
    assert allocator_scope(functools.wraps(paged_allocator)(lambda spec: paged_allocator(spec))).roots == own
    assert allocator_scope(functools.lru_cache(paged_allocator)).roots == own
    assert allocator_scope(functools.partial(dict)) == Scope(()), "Python's own code is nobody's allocator"


def test_coverage_of_an_allocator_with_no_code_to_measure_is_refused_before_any_work(
    importable: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "coverage: 0 of 0 lines ... (100.0% line + branch)". A factory of kvfuzz's harness stands in for
    llama.cpp's adapter, whose allocator is C++."""
    tmp_path = importable
    (tmp_path / "harness_made.py").write_text(USER_ALLOCATOR + "\nfactory.__module__ = 'kvfuzz.registry'\n")
    monkeypatch.chdir(tmp_path)
    from kvfuzz.cli import main

    argv = ["campaign", "--allocator", "harness_made:factory", "--workers", "1", "--max-examples", "5"]
    assert main([*argv, "--coverage"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("kvfuzz: --coverage: harness_made:factory: no Python code under test to measure")
    assert not (tmp_path / "corpus").exists() and not (tmp_path / ".kvfuzz").exists()
    assert main([*argv, "--guided"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("kvfuzz: --guided: harness_made:factory: no Python code under test to measure")


def test_a_report_directory_that_cannot_be_made_is_refused_first_and_a_failed_write_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: --coverage-html under a file ran the whole campaign, then raised NotADirectoryError before the table
    was printed."""
    from kvfuzz.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a file").write_text("")
    argv = ["campaign", "--workers", "1", "--max-examples", "10", "--seed", "5", "--no-known", "--corpus", "c"]
    assert main([*argv, "--coverage-html", "a file/report"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvfuzz: --coverage-html a file/report: cannot be made ({tmp_path / 'a file'} is not a directory)"
    ]
    assert not (tmp_path / "c").exists()

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvfuzz.coverage.report.write_html", full_disk)
    assert main([*argv, "--coverage-html", "report"]) == 0
    captured = capsys.readouterr()
    assert "coverage: " in captured.out and "rerun: kvfuzz campaign" in captured.out
    assert captured.err.splitlines()[-1] == (
        "kvfuzz: --coverage-html report: the report could not be written ([Errno 28] No space left on device)"
    )
