"""A trace names code that its replay imports and calls: `kvfuzz replay`, `kvfuzz show`, the pytest plugin and a
campaign's known corpus load only allocators that are registered, `zoo:` names, kvfuzz's own, trusted by the user,
or named by the user; a trace naming anything else is refused with one line naming what it would import, and nothing
is imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import kvfuzz

from kvfuzz.campaign.allocators import AllocatorTraces
from kvfuzz.campaign.known import known_findings
from kvfuzz.registry import AllocatorTrust, UntrustedAllocator

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
KNOWN_BUG = ROOT / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"

# A module that leaves a mark when it is imported, and a factory that builds kvfuzz's correct allocator.
PLANTED = """\
from pathlib import Path

Path(__file__).with_name("IMPORTED").write_text("the trace's module was imported")

from kvfuzz.allocator.paged import paged_allocator as factory
"""


def _planted(directory: Path) -> Path:
    """A trace of the corpus's known bug whose allocator is ``planted:factory``, a module in ``directory``."""
    (directory / "planted.py").write_text(PLANTED)
    data = json.loads(KNOWN_BUG.read_text())
    trace = directory / "planted-trace.json"
    trace.write_text(json.dumps({**data, "allocator": "planted:factory", "known_bug": None}))
    return trace


@pytest.mark.parametrize(
    "spec",
    [
        "zoo:NoCopyOnWrite",
        "kvfuzz",  # a registered name
        "kvfuzz.allocator.paged:paged_allocator",  # kvfuzz's own, and a registered entry point's value
        "kvfuzz.allocator.hybrid:hybrid_allocator",
        "kvfuzz.adapters.vllm_v1:kv_cache_manager_priority",  # the corpus's traces of engine libraries
        "kvfuzz.zoo.combined:shallow_and_deep",  # a campaign's trace of the zoo's combined slips
        "no_such_registered_name",  # nothing is imported for a bare name: loading it fails
    ],
)
def test_registered_zoo_and_kvfuzz_own_allocators_are_trusted(spec: str) -> None:
    AllocatorTrust().check(spec)


@pytest.mark.parametrize("spec", ["os:system", "code:interact", "kvfuzz.cli:main", "kvfuzzx.allocator:f", "tests:f"])
def test_any_other_module_and_callable_is_refused_naming_what_it_would_import(spec: str) -> None:
    module, _, attribute = spec.partition(":")
    with pytest.raises(UntrustedAllocator, match=f"import the module '{module}' and call its '{attribute}'"):
        AllocatorTrust().check(spec)


def test_trusted_module_prefixes_cover_their_modules_and_nothing_else() -> None:
    trust = AllocatorTrust(("tests", "mypackage.kv"))
    for spec in ("tests:f", "tests.hostile:sometimes_leaks", "mypackage.kv:make", "mypackage.kv.inner:make"):
        trust.check(spec)
    for spec in ("testsuite:f", "mypackage:make", "mypackage.kvx:make"):
        with pytest.raises(UntrustedAllocator):
            trust.check(spec)
    AllocatorTrust(everything=True).check("os:system")
    with pytest.raises(ValueError, match="not a dotted module name"):
        AllocatorTrust(("tests.",))


@pytest.mark.slow
def test_replay_refuses_an_untrusted_allocator_without_importing_it(tmp_path: Path) -> None:
    trace = _planted(tmp_path)
    refused = kvfuzz("replay", trace.name, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert "'planted'" in line and "'factory'" in line and "--trust-allocator" in line
    assert not (tmp_path / "IMPORTED").exists()
    # Against an allocator the user names, the trace replays without its own being imported.
    named = kvfuzz("replay", trace.name, "--allocator", "zoo:NoCopyOnWrite", cwd=tmp_path)
    assert named.returncode == 1 and "REPRODUCED" in named.stdout
    assert not (tmp_path / "IMPORTED").exists()
    trusted = kvfuzz("replay", trace.name, "--trust-allocator", cwd=tmp_path)
    assert trusted.returncode == 0 and "no longer reproduces" in trusted.stdout
    assert (tmp_path / "IMPORTED").exists()


def test_show_draws_an_untrusted_trace_without_replaying_it(tmp_path: Path) -> None:
    trace = _planted(tmp_path)
    shown = kvfuzz("show", trace.name, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "not replayed: the trace names the allocator 'planted:factory'" in shown.stdout
    assert not (tmp_path / "IMPORTED").exists()
    trusted = kvfuzz("show", trace.name, "--trust-allocator", cwd=tmp_path)
    assert trusted.returncode == 0 and "not replayed" not in trusted.stdout
    assert (tmp_path / "IMPORTED").exists()


def test_the_plugin_fails_an_untrusted_trace_without_importing_it(pytester: pytest.Pytester) -> None:
    _planted(pytester.path)
    pytester.syspathinsert()
    refused = pytester.runpytest("planted-trace.json", "-p", "no:cacheprovider")
    refused.assert_outcomes(failed=1)
    refused.stdout.fnmatch_lines(["*import the module 'planted' and call its 'factory'*kvfuzz_trusted_allocators*"])
    assert not (pytester.path / "IMPORTED").exists()
    trusted = pytester.runpytest("planted-trace.json", "-p", "no:cacheprovider", "--kvfuzz-trust-allocator")
    trusted.assert_outcomes(passed=1)
    assert (pytester.path / "IMPORTED").exists()


def test_the_plugin_trusts_the_module_prefixes_a_project_lists(pytester: pytest.Pytester) -> None:
    _planted(pytester.path)
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nkvfuzz_trusted_allocators =\n    planted\n")
    pytester.runpytest("planted-trace.json", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert (pytester.path / "IMPORTED").exists()
    pytester.makeini("[pytest]\nkvfuzz_trusted_allocators =\n    planted.\n")
    bad = pytester.runpytest("planted-trace.json", "-p", "no:cacheprovider")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*kvfuzz_trusted_allocators*'planted.' is not a dotted module name*"])


def test_a_campaign_passes_over_an_untrusted_trace_in_its_known_corpus(tmp_path: Path, monkeypatch) -> None:
    """Before: every trace of a known corpus had its allocator built, to compare classes with the campaign's."""
    _planted(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert known_findings([tmp_path], AllocatorTraces(["zoo:NoCopyOnWrite"], 10.0)).where() == {}
    assert not (tmp_path / "IMPORTED").exists()
    # A trace recorded against an allocator the campaign itself runs is the user's own: it is replayed.
    assert (
        known_findings([tmp_path], AllocatorTraces(["planted:factory"], 10.0)).where() == {}
    )  # the correct allocator: nothing reproduces
    assert (tmp_path / "IMPORTED").exists()


def test_export_refuses_an_untrusted_allocator_unless_trusted_or_named(tmp_path: Path) -> None:
    """Before: the exported test imported and called whatever the trace named (running it opened a Python console
    for ``code:interact``). Now export applies replay's trust policy: one line, nothing written."""
    trace = _planted(tmp_path)
    out = tmp_path / "test_exported.py"
    refused = kvfuzz("export", trace.name, "-o", out.name, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert "'planted'" in line and "'factory'" in line and "--trust-allocator" in line and "--allocator" in line
    assert not out.exists() and not (tmp_path / "IMPORTED").exists()
    named = kvfuzz("export", trace.name, "-o", out.name, "--allocator", "zoo:NoCopyOnWrite", cwd=tmp_path)
    assert named.returncode == 0 and "load_factory('zoo:NoCopyOnWrite')" in out.read_text()
    trusted = kvfuzz("export", trace.name, "-o", out.name, "--trust-allocator", cwd=tmp_path)
    assert trusted.returncode == 0 and "load_factory('planted:factory')" in out.read_text()
    assert not (tmp_path / "IMPORTED").exists()  # exporting never imports it: running the test would
