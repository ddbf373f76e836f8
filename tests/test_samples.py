"""The documentation shows what kvfuzz prints now (its links and lengths: tests/test_docs.py).

Every sample output in README.md and docs/ is a marked region that ``scripts/samples.py`` writes by running its
command; the first test fails, with a diff, when a shown sample no longer matches (rewrite them with
``python scripts/samples.py``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script() -> ModuleType:
    """scripts/ is not a package: load samples.py by path (registered, so that its dataclass can resolve itself)."""
    name = "kvfuzz_docs_samples"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


samples = _load_script()


@pytest.mark.slow
def test_every_sample_matches_what_its_command_prints() -> None:
    verdicts = samples.judge(samples.markdown_files())
    assert any(verdict.region.kind == "sample" for verdict in verdicts), "no sample regions found"
    stale = [verdict for verdict in verdicts if verdict.stale]
    if stale:
        pytest.fail(
            "\n".join(verdict.describe() for verdict in stale)
            + f"\nrewrite them: python scripts/samples.py (samples are what {samples.installed_kvfuzz()} prints: "
            "if its kvfuzz is not this checkout's, pip install . first)"
        )


def test_the_readme_walks_through_a_caught_bug() -> None:
    markers = [region.marker for region in samples.regions(ROOT / "README.md")]
    assert any(marker.startswith("kvfuzz run --allocator zoo:NoCopyOnWrite") for marker in markers)


def test_timings_are_normalised_and_nothing_else() -> None:
    text = (
        "passed: 108 examples, 3547 steps in 1.5 s (2412 steps/s)\n"
        "invariant 5 (exclusive writes) (first failing example: #15, after 0.54 s)\n"
        "| NoCopyOnWrite | 10 copy-on-write missing | yes | invariant 5 (exclusive writes) | 15 | 0.35 | 8 |\n"
        "  pool: 16 blocks x 4 slots, 4 host blocks   \n"
        "  passed: 57 steps in 12 s, every invariant checked\n\n"
    )
    assert samples.normalise(text) == (
        "passed: 108 examples, 3547 steps in … s (… steps/s)\n"
        "invariant 5 (exclusive writes) (first failing example: #15, after … s)\n"
        "| NoCopyOnWrite | 10 copy-on-write missing | yes | invariant 5 (exclusive writes) | 15 | … | 8 |\n"
        "  pool: 16 blocks x 4 slots, 4 host blocks\n"
        "  passed: 57 steps in … s, every invariant checked\n"
    )


def test_a_region_shows_the_excerpt_its_marker_asks_for(tmp_path: Path) -> None:
    renderer = samples.Renderer()
    renderer.outputs["kvfuzz run"] = "header\nmore\ninvariant 5\nprogram\nexplanation\n"
    body = renderer.render("sample", "kvfuzz run; from: ^invariant; until: ^explanation")
    assert body == "```text\n$ kvfuzz run\n...\ninvariant 5\nprogram\n...\n```\n"
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- sample: kvfuzz run; from: ^invariant -->\nold\n<!-- /sample -->\noutro\n")
    verdicts = samples.judge([page], renderer)
    assert [verdict.stale for verdict in verdicts] == [True]
    samples.rewrite(verdicts)
    assert page.read_text() == (
        "intro\n<!-- sample: kvfuzz run; from: ^invariant -->\n"
        "```text\n$ kvfuzz run\n...\ninvariant 5\nprogram\nexplanation\n```\n<!-- /sample -->\noutro\n"
    )
    assert not any(verdict.stale for verdict in samples.judge([page], renderer))


def test_the_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_walkthrough_prose_and_picture_tell_the_program_the_sample_prints() -> None:
    """The paragraph under the README's walk-through sample, and the picture's caption, name the sequences, the
    operations and the blocks of the program the sample prints (regenerated, it may draw another)."""
    readme = ROOT / "README.md"
    (region,) = [r for r in samples.regions(readme) if r.marker.startswith("kvfuzz run --allocator zoo:NoCopyOnWrite")]
    text = readme.read_text()
    prose = text[text.index("<!-- /sample -->", region.span[1]) : text.index("\n## ", region.span[1])]
    calls = re.findall(r"^state\.(\w+)\((.*)\)$", region.body, flags=re.MULTILINE)
    sequences = set(re.findall(r"'(s\d+)'", " ".join(arguments for _, arguments in calls)))
    assert set(re.findall(r"\bs\d+\b", prose)) == sequences
    assert {name for name, _ in calls} - {"teardown"} <= set(re.findall(r"`(\w+)`", prose))
    explained = set(re.findall(r"\bblock (\d+)", region.body))
    assert explained and explained <= set(re.findall(r"\bblock (\d+)", prose))


def test_the_picture_is_of_the_walkthroughs_trace() -> None:
    spec = importlib.util.spec_from_file_location("kvfuzz_timeline_example", ROOT / "scripts" / "timeline_example.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    markers = [region.marker for region in samples.regions(ROOT / "README.md")]
    assert any(marker.split(";")[0] == script.WALKTHROUGH for marker in markers)


def test_a_sample_is_what_the_installed_kvfuzz_command_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user runs the ``kvfuzz`` their install put beside their Python, not the checkout's modules: the samples ran
    the checkout, so a sample could pass its check while an installed kvfuzz printed something else."""
    bin_directory = tmp_path / "bin"
    bin_directory.mkdir()
    (bin_directory / "python").symlink_to(sys.executable)
    (bin_directory / "kvfuzz").write_text("import sys\nprint('installed kvfuzz:', *sys.argv[1:])\n")
    monkeypatch.setattr(samples.sys, "executable", str(bin_directory / "python"))
    assert samples.run_command("kvfuzz account --lengths 3") == "installed kvfuzz: account --lengths 3\n"
    (bin_directory / "kvfuzz").unlink()
    with pytest.raises(samples.SampleError, match="no kvfuzz command beside"):
        samples.run_command("kvfuzz account --lengths 3")


def test_a_command_that_cannot_run_is_reported_in_its_region_after_the_others_ran(tmp_path: Path) -> None:
    renderer = samples.Renderer()
    renderer.outputs["kvfuzz run"] = "passed\n"
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- sample: ls -l -->\nold\n<!-- /sample -->\n<!-- sample: kvfuzz run -->\nold\n<!-- /sample -->\n"
    )
    bad, good = samples.judge([page], renderer)
    assert bad.want is None and bad.error is not None and "must start with 'kvfuzz'" in bad.error
    assert good.want == "```text\n$ kvfuzz run\npassed\n```\n" and good.error is None
