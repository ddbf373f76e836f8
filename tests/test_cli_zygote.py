"""The command-line tests' warm parent (tests/cli_zygote.py) must answer as a fresh interpreter would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import _ZYGOTE, kvfuzz


def _fresh(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("run", "--examples", "-3"),  # a usage error: one line, exit status 2
        ("show", "no-such-trace.json"),
        ("run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "30", "--seed", "1", "--no-shrink"),
    ],
    ids=["help", "usage-error", "missing-trace", "a-failing-run-saves-its-trace"],
)
def test_a_forked_command_answers_as_a_fresh_interpreter(args: tuple[str, ...], tmp_path: Path) -> None:
    (tmp_path / "fresh").mkdir()
    (tmp_path / "forked").mkdir()
    fresh = _fresh(*args, cwd=tmp_path / "fresh")
    forked = kvfuzz(*args, cwd=tmp_path / "forked")
    assert _ZYGOTE.process is not None and _ZYGOTE.process.poll() is None, "no warm parent served the command"
    assert (forked.returncode, _untimed(forked.stdout), forked.stderr) == (
        fresh.returncode,
        _untimed(fresh.stdout),
        fresh.stderr,
    )
    assert _files(tmp_path / "forked") == _files(tmp_path / "fresh")


def _untimed(text: str) -> str:
    """``text`` without its durations and rates, the one thing two runs of a command may print differently."""
    return re.sub(r"\d+(\.\d+)?(?= s\b| steps/s)", "N", text)


def _files(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in directory.rglob("*") if path.is_file()}


def test_a_changed_environment_restarts_the_warm_parent_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a command reads at import must be what a fresh interpreter would read: the caller's environment."""
    kvfuzz("--help", cwd=Path.cwd())
    assert _ZYGOTE.process is not None
    before = _ZYGOTE.process.pid
    kvfuzz("--help", cwd=Path.cwd())
    assert _ZYGOTE.process.pid == before, "an unchanged environment restarted the warm parent"
    monkeypatch.setenv("KVFUZZ_ZYGOTE_TEST", "1")
    kvfuzz("--help", cwd=Path.cwd())
    assert _ZYGOTE.process.pid != before
    parent_environ = Path(f"/proc/{_ZYGOTE.process.pid}/environ").read_bytes().split(b"\0")
    assert b"KVFUZZ_ZYGOTE_TEST=1" in parent_environ
