"""Running the standalone reproducers ``kvfuzz report`` writes: generate one for a corpus trace, run it under the
engine's environment's Python with kvfuzz not importable (a meta-path hook refuses it, and the run proves the refusal
before the reproducer starts), and read the failure it ends with. Shared by the engine families' report tests
(test_vllm_reports.py, test_vllm_v0_reports.py, test_sglang_reports.py, tests/test_torch_reports.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from kvfuzz.cli import main

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus"

WITHOUT_KVFUZZ = r"""
import runpy, sys

class NoKvfuzz:
    def find_spec(self, name, path=None, target=None):
        if name == "kvfuzz" or name.startswith("kvfuzz."):
            raise ImportError(f"kvfuzz is not importable here ({name})")
        return None

sys.meta_path.insert(0, NoKvfuzz())
try:
    import kvfuzz
except ImportError:
    pass
else:
    raise SystemExit("kvfuzz is importable: the reproducer would not be standalone")
reproducer, patch = sys.argv[1], sys.argv[2]
if patch:
    import pytest
    sys.path.insert(0, sys.argv[3])
    import vllm_history
    getattr(vllm_history, patch)(pytest.MonkeyPatch())
sys.argv = [reproducer]
runpy.run_path(reproducer, run_name="__main__")
assert not [name for name in sys.modules if name == "kvfuzz" or name.startswith("kvfuzz.")]
"""


def trace_json(name: str) -> dict[str, Any]:
    return json.loads((CORPUS / name).read_text())


def real_bugs(pattern: str) -> list[str]:
    """The corpus traces matching ``pattern`` that record a real engine bug (a ``known_bug`` explanation)."""
    return sorted(path.name for path in CORPUS.glob(pattern) if json.loads(path.read_text())["known_bug"])


def report(name: str, directory: Path) -> Path:
    """``kvfuzz report`` of a corpus trace into ``directory``; the reproducer it wrote."""
    output = directory / "report.md"
    assert main(["report", str(CORPUS / name), "-o", str(output)]) == 0
    text = output.read_text()
    reproducer = directory / "report_reproducer.py"
    assert reproducer.exists(), text[-2000:]
    assert reproducer.read_text() in text  # the report holds the reproducer too
    assert "import kvfuzz" not in reproducer.read_text() and "from kvfuzz" not in reproducer.read_text()
    return reproducer


def run_without_kvfuzz(reproducer: Path, patch: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    """The reproducer under this environment's Python in isolated mode (-I: no PYTHONPATH, no user site, no script
    directory), from a directory outside the repository, with kvfuzz's imports refused; ``patch`` names a function of
    engine_tests/vllm_history.py applied first (a fixed bug put back)."""
    command = [sys.executable, "-I", "-c", WITHOUT_KVFUZZ, str(reproducer), patch or "", str(ROOT / "engine_tests")]
    return subprocess.run(command, cwd=reproducer.parent, capture_output=True, text=True, timeout=600)


def last_line(ran: subprocess.CompletedProcess[str]) -> str:
    lines = ran.stderr.strip().splitlines()
    return lines[-1] if lines else ""


CHECK_WORDS = {1: "content", 2: "attention", 9: "cache soundness", 13: "eviction order"}
"""An allocator trace's invariant, as kvfuzz's explanation names it: the words a reproducer's Failure starts with."""


def check_allocator_failure(name: str, ran: subprocess.CompletedProcess[str]) -> None:
    """The reproducer of allocator trace ``name`` failed as the trace records: with the engine's exception of the
    recorded type for a crash (raised in the function the recorded traceback ends in, where it holds one), else
    with ``Failure: <the invariant's name>`` naming the sequence of the failing
    operation (or, for a step's failure, a sequence the explanation names)."""
    failure = trace_json(name)["failure"]
    assert ran.returncode == 1, ran.stdout + ran.stderr[-3000:]
    assert "kvfuzz is importable" not in ran.stderr
    last = last_line(ran)
    if failure["invariant"] is None:
        exception = re.fullmatch(r"crash \((\w+)\)", failure["title"])
        assert exception is not None, failure["title"]
        assert last.startswith(exception.group(1)), ran.stderr[-3000:]
        frames = re.findall(r"line \d+, in (\w+)", failure["explanation"])
        if frames:  # the recorded traceback's innermost frame: the engine function that raised
            assert f", in {frames[-1]}\n" in ran.stderr, ran.stderr[-3000:]
        return
    assert f"({CHECK_WORDS[failure['invariant']]})" in failure["explanation"].splitlines()[0]
    assert last.startswith(f"Failure: {CHECK_WORDS[failure['invariant']]} "), ran.stderr[-3000:]
    named = re.findall(r"\bs\d+\b", failure["operation"] or "") or re.findall(r"\bs\d+\b", failure["explanation"])
    assert named and named[0] in last, (named, last)
