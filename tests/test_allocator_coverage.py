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


def test_a_user_s_allocator_is_its_module_or_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lonely.py").write_text(USER_ALLOCATOR)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "pool.py").write_text(USER_ALLOCATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    real = os.path.realpath(tmp_path)
    assert allocator_scope(load_factory("lonely:factory")).roots == (os.path.join(real, "lonely.py"),)
    assert allocator_scope(load_factory("mine.pool:factory")).roots == (os.path.join(real, "mine"),)


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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import _parser, main

    (tmp_path / "campaign_allocator.py").write_text(USER_ALLOCATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
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


def test_the_table_says_the_coverage_and_guided_search_stays_a_scheduler_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["campaign", "--workers", "1", "--max-examples", "10", "--seed", "5", "--no-known", "--corpus", "c"]
    assert main([*argv, "--coverage"]) == 0
    out = capsys.readouterr().out
    assert "coverage of the allocators' own code measured" in out
    [line] = [line for line in out.splitlines() if line.startswith("coverage: ")]
    assert "files of the code under test" in line and not line.startswith("coverage: 0 of")
    assert main([*argv, "--guided"]) == 2
    assert capsys.readouterr().err.splitlines() == ["kvfuzz: --guided needs --scheduler"]


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
