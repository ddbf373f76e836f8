"""``--coverage-html DIR`` of ``kvfuzz campaign``, whatever its target: the directory checked before any work, and
the report written after the campaign's result is printed (docs/coverage.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvfuzz.campaign.report import CampaignResult


def coverage_html_problem(directory: Optional[str]) -> Optional[str]:
    """The one line ``--coverage-html DIR`` is refused with, if any, before the campaign: DIR exists and is no
    directory, or cannot be made (its nearest existing parent is no directory, or cannot be written)."""
    if directory is None:
        return None
    path = Path(directory)
    if path.exists():
        return None if path.is_dir() else f"--coverage-html {directory}: not a directory"
    parent = next(ancestor for ancestor in (path.absolute(), *path.absolute().parents) if ancestor.exists())
    if not parent.is_dir():
        return f"--coverage-html {directory}: cannot be made ({parent} is not a directory)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--coverage-html {directory}: cannot be made ({parent} cannot be written)"
    return None


def write_coverage_report(directory: Optional[str], result: CampaignResult, title: str) -> None:
    """With ``--coverage-html DIR``, the campaign's coverage as an HTML report in DIR, and a line saying where (or
    why it could not be written: the campaign's result is printed before)."""
    if directory is None or result.coverage is None:
        return
    from kvfuzz.coverage.report import write_html

    try:
        index = write_html(Path(directory), result.coverage.reached, result.coverage.files, title)
    except OSError as error:
        print(f"kvfuzz: --coverage-html {directory}: the report could not be written ({error})", file=sys.stderr)
        return
    print(f"coverage report: {index}", file=sys.stderr)
