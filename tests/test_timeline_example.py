"""docs/timeline.png, the README's example picture, is what scripts/timeline_example.py draws now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_example_picture_is_current() -> None:
    spec = importlib.util.spec_from_file_location("kvfuzz_timeline_example", ROOT / "scripts" / "timeline_example.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0


def test_the_readme_shows_it() -> None:
    assert "](docs/timeline.png)" in (ROOT / "README.md").read_text()
