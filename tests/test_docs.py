"""The documentation is a manual: pages of a readable length, a table of contents that lists every page, links
between pages that resolve to a file and a heading, and a command-line reference that is the parser itself.

The CLI reference (docs/cli.md) is a generated region, ``<!-- table: cli -->``, that ``scripts/samples.py`` writes
from kvfuzz's argparse parser; rewrite it with ``python scripts/samples.py docs/cli.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _samples() -> ModuleType:
    """scripts/samples.py, which renders the CLI reference (loaded by path under the name tests/test_samples.py
    gives it, so that both share one module)."""
    name = "kvfuzz_docs_samples"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "samples.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


MAX_LINES = 600
"""The longest a manual page may be: past it, split the page by what its readers come for."""


def manual_pages() -> list[Path]:
    """The pages a reader navigates: docs/*.md and the results log (the engine reports under docs/reports/ are
    generated one per finding)."""
    return sorted(DOCS.glob("*.md")) + sorted((DOCS / "results").glob("*.md"))


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, code marks and punctuation dropped, spaces as hyphens; a repeated
    heading's anchor gets ``-1``, ``-2``, ..."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", _FENCE.sub("", page.read_text()), flags=re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        repeat, unique = 0, anchor
        while unique in found:
            repeat += 1
            unique = f"{anchor}-{repeat}"
        found.add(unique)
    return found


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    """Every relative link of ``pages`` (outside code blocks) whose file does not exist, or whose ``#anchor`` names
    no heading of the markdown page it points to."""
    problems = []
    for page in pages:
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # an external URL
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = page.relative_to(root)
            if root not in resolved.parents:
                problems.append(f"{where}: {target} points outside the repository")
            elif not resolved.exists():
                problems.append(f"{where}: {target} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: {target} names no heading of {resolved.relative_to(root)}")
    return problems


def test_no_manual_page_is_longer_than_600_lines() -> None:
    long = [
        f"{page.relative_to(ROOT)}: {n} lines"
        for page in manual_pages()
        if (n := len(page.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"pages over {MAX_LINES} lines (split them by what their readers come for):\n" + "\n".join(long)


def test_every_link_between_pages_resolves_to_a_file_and_a_heading() -> None:
    problems = broken_links([ROOT / "README.md", *sorted(DOCS.glob("**/*.md"))])
    assert not problems, "\n".join(problems)


def test_no_page_mentions_a_design_document_outside_the_repository() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("**/*.md"))]
    assert [page.name for page in pages if "DESIGN.md" in page.read_text() or "shared/" in page.read_text()] == []


def test_a_link_to_a_missing_page_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Same\n\n## Same\n\n```\n# Not a heading\n```\n")
    page.write_text(
        "[ok](b.md#same) [ok](b.md#same-1) [ok](#a) [gone](c.md) [no heading](b.md#not-a-heading) [out](../../x.md)\n"
        "```\n[in code](nowhere.md)\n```\n# A\n"
    )
    assert broken_links([page], tmp_path) == [
        "docs/a.md: c.md does not exist",
        "docs/a.md: b.md#not-a-heading names no heading of docs/b.md",
        "docs/a.md: ../../x.md points outside the repository",
    ]


def test_the_table_of_contents_lists_every_page() -> None:
    contents = (DOCS / "README.md").read_text()
    linked = {target.partition("#")[0] for target in _LINK.findall(contents)}
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if page.name != "README.md" and page.name not in linked]
    assert not missing, f"docs/README.md does not list: {', '.join(missing)}"
    assert "results/README.md" in linked


def _cli_region() -> str:
    region = re.search(r"^<!-- table: cli -->\n(.*?)^<!-- /table -->$", (DOCS / "cli.md").read_text(), re.M | re.S)
    assert region is not None, "docs/cli.md has no generated CLI region (<!-- table: cli -->)"
    return region.group(1)


def test_the_cli_reference_is_what_the_parser_accepts() -> None:
    assert _cli_region() == _samples().cli_reference(), "stale: python scripts/samples.py docs/cli.md"


def test_every_subcommand_and_option_is_in_the_cli_reference() -> None:
    """Read from the parser here, not from the page's renderer: a subcommand or an option the rendering leaves out
    fails even when the page is current."""
    from kvfuzz.cli import _parser

    shown = _cli_region()
    commands = next(action for action in _parser()._actions if isinstance(action, argparse._SubParsersAction))
    missing = []
    for name, command in commands.choices.items():
        section = shown.partition(f"## `kvfuzz {name}`\n")[2].partition("\n## `kvfuzz ")[0]
        if not section:
            missing.append(f"kvfuzz {name}")
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings or [action.metavar or action.dest]:
                if f"`{flag}`" not in section:
                    missing.append(f"kvfuzz {name} {flag}")
    assert not missing, "not in docs/cli.md: " + ", ".join(missing)
