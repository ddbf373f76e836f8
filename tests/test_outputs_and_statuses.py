"""What the command line writes and what its exit status says (issue 28, items 1, 3 and 6).

* An output is never an input: ``show --html/--png``, ``export -o`` and ``replay-workload --plot`` refuse a file
  that is the trace or workload they read (the same path, a symbolic link to it, a hard link), and two outputs that
  are one file, in one line and exit status 2, before any work. Every output is written to a temporary file beside it
  and renamed over its name: a write that fails halfway leaves neither a partial file nor a temporary one, and the
  error names the path.
* ``--json`` keeps standard output for kvfuzz's JSON: whatever the allocator prints (Python's ``print``, a write to
  file descriptor 1, C's ``printf``), at import, construction or in an operation, goes to standard error.
* A factory that exits or raises anything while it is loaded or built is a usage error (2) for every command;
  ``replay`` replays every file whatever happens to one; a ``GeneratorExit`` from an operation is the allocator's
  crash.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from factories import kvfuzz as run_kvfuzz

from kvfuzz.cli import main

ROOT = Path(__file__).resolve().parent.parent
NO_COPY_ON_WRITE = ROOT / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"


def kvfuzz(*args: str, cwd: Path, **kwargs: object) -> subprocess.CompletedProcess:
    """``kvfuzz ARGS`` as :func:`factories.kvfuzz` runs it, with ``cwd`` and the repository importable."""
    return run_kvfuzz(
        *args, cwd=cwd, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT)])}, **kwargs
    )


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> str:
    """``kvfuzz ARGV`` in this process: exit status 2, nothing on standard output, one line on standard error
    starting ``kvfuzz: `` and holding ``words``. Returns the line."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (status, out, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfuzz: "), err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """A copy of a corpus trace that reproduces (NoCopyOnWrite), in its own directory."""
    path = tmp_path / "trace.json"
    shutil.copyfile(NO_COPY_ON_WRITE, path)
    return path


# -- item 1: an output is never an input ---------------------------------------------------------------------------


def _aliases(path: Path) -> dict[str, Path]:
    """Three names of the file ``path``: itself, a symbolic link to it, a hard link to it."""
    symlink = path.with_name("symlink.json")
    symlink.symlink_to(path.name)
    hardlink = path.with_name("hardlink.json")
    os.link(path, hardlink)
    return {"same path": path, "symbolic link": symlink, "hard link": hardlink}


@pytest.mark.parametrize("flag", ["--html", "--png"])
def test_show_refuses_to_draw_over_the_trace_it_reads(flag: str, trace: Path, capsys) -> None:
    """Before: the trace was overwritten with the HTML page or the PNG, and the command exited 0."""
    before = trace.read_bytes()
    for how, alias in _aliases(trace).items():
        line = refused(capsys, ["show", str(trace), flag, str(alias)], flag, str(alias), "is the input")
        assert trace.read_bytes() == before, how
        assert not line.endswith("None"), line


def test_show_refuses_a_default_page_that_is_the_trace(trace: Path, capsys, monkeypatch) -> None:
    """A trace named NAME.html is its own default page (NAME.html in the current directory)."""
    page_named = trace.rename(trace.with_name("failure.html"))
    before = page_named.read_bytes()
    monkeypatch.chdir(page_named.parent)
    refused(capsys, ["show", "failure.html"], "failure.html", "is the input")
    assert page_named.read_bytes() == before


def test_show_refuses_one_file_for_both_the_page_and_the_picture(trace: Path, capsys) -> None:
    out = trace.with_name("out")
    refused(capsys, ["show", str(trace), "--html", str(out), "--png", str(out)], "--png", "--html", "same file")
    assert not out.exists()


def test_export_refuses_to_write_over_the_trace_it_reads(trace: Path, capsys) -> None:
    """Before: the trace was replaced by the exported Python file, and the command exited 0."""
    before = trace.read_bytes()
    for how, alias in _aliases(trace).items():
        refused(capsys, ["export", str(trace), "-o", str(alias)], "-o", str(alias), "is the input")
        assert trace.read_bytes() == before, how


def test_replay_workload_refuses_to_plot_over_the_workload_it_reads(tmp_path: Path, capsys) -> None:
    workload = tmp_path / "uniform.json"
    shutil.copyfile(ROOT / "workloads" / "constructed" / "uniform.json", workload)
    before = workload.read_bytes()
    for how, alias in _aliases(workload).items():
        refused(capsys, ["replay-workload", str(workload), "--plot", str(alias)], "--plot", "is the input")
        assert workload.read_bytes() == before, how


def test_export_to_a_place_it_cannot_write_is_one_line(trace: Path, capsys) -> None:
    """Before: a PermissionError traceback (root included: /proc takes no new files)."""
    refused(capsys, ["export", str(trace), "-o", "/proc/test_kvfuzz_export.py"], "/proc/test_kvfuzz_export.py")


def _small_files() -> None:
    """In the child: any regular file written past 1 KiB fails with EFBIG, as a write to a full disk fails."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["show", "trace.json", "--html", "out.html"], marks=pytest.mark.slow),
        ["export", "trace.json", "-o", "out.html"],
    ],
    ids=["show", "export"],
)
def test_a_write_that_fails_halfway_keeps_the_old_file_and_leaves_nothing_else(command: list[str], trace: Path) -> None:
    """Before: ``show`` left a page cut at the limit and said "cannot write None"; ``export`` left a partial file and
    a traceback."""
    old = trace.with_name("out.html")
    old.write_text("the previous page\n")
    done = kvfuzz(*command, cwd=trace.parent, preexec_fn=_small_files)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfuzz: cannot write out.html: "), done.stderr
    assert "None" not in lines[0] and "Traceback" not in done.stderr
    assert old.read_text() == "the previous page\n"
    assert sorted(path.name for path in trace.parent.iterdir()) == ["out.html", "trace.json"]


def test_outputs_that_are_not_inputs_are_still_written(trace: Path) -> None:
    """The refusals above refuse only what they must: a new file beside the trace is written, a link to another
    file is followed (its target is the file written, the link kept)."""
    other = trace.with_name("other.py")
    other.write_text("# old\n")
    link = trace.with_name("link.py")
    link.symlink_to(other.name)
    done = kvfuzz("export", "trace.json", "-o", "link.py", cwd=trace.parent)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and "def test_" in other.read_text()


def _read_fifo(path: Path) -> tuple[threading.Thread, list[bytes]]:
    """A reader of the FIFO ``path`` in a thread (the writer's open waits for it); what it read, once joined."""
    received: list[bytes] = []

    def read() -> None:
        with open(path, "rb") as fifo:
            received.append(fifo.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, received


def test_an_output_that_is_a_fifo_is_written_into_not_replaced(trace: Path, capsys) -> None:
    """Before: the temporary file was renamed over the FIFO (or a device: as root, ``-o /dev/full`` destroyed
    /dev/full), which became a regular file, and the command said "wrote"."""
    fifo = trace.with_name("pipe")
    os.mkfifo(fifo)
    reader, received = _read_fifo(fifo)
    assert main(["export", str(trace), "-o", str(fifo)]) == 0
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced"
    assert received and b"def test_" in received[0]
    assert f"wrote {fifo}" in capsys.readouterr().out
    assert sorted(path.name for path in trace.parent.iterdir()) == ["pipe", "trace.json"]


def test_a_special_file_that_refuses_the_write_is_one_line_and_stays_what_it_was(
    trace: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device that refuses the bytes (``/dev/full``: no space left), here a FIFO whose copy fails so: one line
    naming it, exit status 2, the FIFO still a FIFO."""
    fifo = trace.with_name("full")
    os.mkfifo(fifo)
    reader, _ = _read_fifo(fifo)

    def no_space(source: object, sink: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfileobj", no_space)
    refused(capsys, ["export", str(trace), "-o", str(fifo)], f"cannot write {fifo}: No space left on device")
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_an_output_naming_a_pipe_s_descriptor_is_written_into_it(trace: Path, capsys) -> None:
    """``-o /dev/stdout`` when standard output is a pipe (here ``/dev/fd/N`` of a pipe this test reads). Before: the
    name was resolved to ``pipe:[...]``, which no directory holds, and the write refused."""
    read_end, write_end = os.pipe()
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(os.fdopen(read_end, "rb").read()), daemon=True)
    reader.start()
    try:
        assert main(["export", str(trace), "-o", f"/dev/fd/{write_end}"]) == 0
    finally:
        os.close(write_end)
    reader.join(timeout=30)
    assert received and b"def test_" in received[0]
    assert f"wrote /dev/fd/{write_end}" in capsys.readouterr().out


def test_an_output_naming_a_regular_file_s_descriptor_writes_that_file_not_a_new_one(trace: Path, capsys) -> None:
    """``-o /dev/stdout`` when standard output is a file (a shell's ``> log``). Before: the temporary file was renamed
    over the file's name, so the descriptor (the shell's) kept the old file, unlinked, and what it wrote was lost."""
    log = trace.with_name("log.txt")
    descriptor = os.open(log, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert main(["export", str(trace), "-o", f"/dev/fd/{descriptor}"]) == 0
        assert os.fstat(descriptor).st_nlink == 1, "the descriptor's file was replaced"
        written = os.pread(descriptor, 1 << 20, 0)
    finally:
        os.close(descriptor)
    assert b"def test_" in written and log.read_bytes() == written
    assert sorted(path.name for path in trace.parent.iterdir()) == ["log.txt", "trace.json"]
    capsys.readouterr()


# -- item 3: --json output is JSON alone ---------------------------------------------------------------------------

NOISY = """
import ctypes
import json
import os

from kvfuzz.allocator.paged import PagedAllocator

print("noise: print at import")
os.write(1, b"noise: descriptor 1 at import\\n")


class Noisy(PagedAllocator):
    def admit(self, seq, namespace, tokens):
        print("noise: print in admit")
        os.write(1, b"noise: descriptor 1 in admit\\n")
        return super().admit(seq, namespace, tokens)


def factory(spec):
    print("noise: print when built")
    ctypes.CDLL(None).printf(b"noise: C printf when built\\n")
    return Noisy(spec.block_size, spec.num_blocks, spec.num_host_blocks)
"""

JSON_COMMANDS = {
    "run": ["run", "--allocator", "noisy:factory", "--examples", "4", "--steps", "10", "--json"],
    "replay-workload": ["replay-workload", "constructed:uniform", "--allocator", "noisy:factory", "--json"],
    "serve": ["serve", "poisson:0.5:1", "--requests", "5", "--allocator", "noisy:factory", "--json"],
    "campaign workers": [
        "campaign", "--allocator", "noisy:factory", "--workers", "1", "--max-examples", "3", "--corpus", "found",
        "--json",
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    "command", [name if name == "run" else pytest.param(name, marks=pytest.mark.slow) for name in sorted(JSON_COMMANDS)]
)
def test_json_output_stays_json_whatever_the_allocator_prints(command: str, tmp_path: Path) -> None:
    """Before: the allocator's lines came first on standard output and ``json.loads`` failed on them (a campaign's
    workers printed there too)."""
    (tmp_path / "noisy.py").write_text(NOISY)
    done = kvfuzz(*JSON_COMMANDS[command], cwd=tmp_path)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "noise" not in done.stdout
    json.loads(done.stdout)  # one JSON document, nothing else
    for noise in ("print at import", "descriptor 1 at import", "print when built", "C printf when built"):
        assert f"noise: {noise}" in done.stderr, noise
    assert "noise: print in admit" in done.stderr and "noise: descriptor 1 in admit" in done.stderr


def test_without_json_the_allocator_prints_where_it_always_did(tmp_path: Path) -> None:
    """The redirection is for --json alone: a run without it leaves the allocator's standard output alone."""
    (tmp_path / "noisy.py").write_text(NOISY)
    done = kvfuzz("run", "--allocator", "noisy:factory", "--examples", "2", "--steps", "5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "noise: print in admit" in done.stdout and "noise: C printf when built" in done.stdout


# -- item 6: every exit status means one thing ---------------------------------------------------------------------

EXITING = """
import sys

import pytest


def exits(spec):
    sys.exit(0)


def exits_with_3(spec):
    sys.exit(3)


def generator_exit(spec):
    raise GeneratorExit


def skips(spec):
    pytest.skip("the factory called pytest.skip")


BUILT = []


def exits_on_its_sixth_build(spec):  # one build checked, two probed for the swarm's pools: the sixth, a program's
    from kvfuzz.allocator.paged import paged_allocator

    BUILT.append(spec)
    if len(BUILT) == 6:
        sys.exit(0)
    return paged_allocator(spec)
"""

FACTORY_ESCAPES = {"exits": "SystemExit", "exits_with_3": "SystemExit: 3", "generator_exit": "GeneratorExit",
                   "skips": "Skipped"}  # fmt: skip


@pytest.fixture
def exiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``exiting:NAME`` importable: factories that exit or raise a BaseException when called, and
    ``exits_at_import:factory``, whose module exits when imported."""
    (tmp_path / "exiting.py").write_text(EXITING)
    (tmp_path / "exits_at_import.py").write_text("import sys\n\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("exiting", "exits_at_import"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    return tmp_path


@pytest.mark.parametrize("name", sorted(FACTORY_ESCAPES))
@pytest.mark.parametrize(
    "command",
    [
        ["run"],
        ["campaign", "--max-examples", "1"],
        ["replay-workload", "constructed:uniform"],
        ["serve", "poisson:0.5:1", "--requests", "2"],
    ],
    ids=["run", "campaign", "replay-workload", "serve"],
)
def test_a_factory_that_exits_while_it_is_built_is_a_usage_error(name, command, exiting: Path, capsys) -> None:
    """Before: sys.exit(0) in the factory ended ``kvfuzz run`` with exit status 0, having run nothing; GeneratorExit
    and pytest.skip were tracebacks."""
    corpus = ["--corpus", str(exiting / "corpus")] if command[0] in ("run", "campaign") else []
    refused(capsys, [*command, *corpus, "--allocator", f"exiting:{name}"], f"exiting:{name}", FACTORY_ESCAPES[name])
    assert not (exiting / "corpus").exists()


@pytest.mark.parametrize("command", [["run"], ["campaign", "--max-examples", "1"]], ids=["run", "kvfuzz campaign"])
def test_a_module_that_exits_when_imported_is_a_usage_error(command, exiting: Path, capsys) -> None:
    refused(
        capsys,
        [*command, "--corpus", str(exiting / "corpus"), "--allocator", "exits_at_import:factory"],
        "exits_at_import",
        "SystemExit",
    )


def _trace_of(allocator: str, directory: Path) -> Path:
    """The NoCopyOnWrite trace, recorded against ``allocator`` instead."""
    data = json.loads(NO_COPY_ON_WRITE.read_text())
    path = directory / f"{allocator.replace(':', '-')}.json"
    path.write_text(json.dumps({**data, "allocator": allocator}))
    return path


def test_replay_replays_every_file_whatever_happens_to_one(exiting: Path, capsys) -> None:
    """Before: the first factory that exited ended the whole replay with exit status 0, the files after it never
    replayed and no summary printed."""
    good = _trace_of("zoo:NoCopyOnWrite", exiting)
    files = [good, *(_trace_of(f"exiting:{name}", exiting) for name in sorted(FACTORY_ESCAPES))]
    files += [_trace_of("exits_at_import:factory", exiting), good]
    status = main(["replay", *map(str, files)])
    out, err = capsys.readouterr()
    assert status == 2, out + err
    assert out.count("REPRODUCED at call 4") == 2, out
    errors = err.splitlines()
    assert len(errors) == 5 and all(line.startswith("kvfuzz: ") for line in errors), err
    for line, name in zip(errors, [*sorted(FACTORY_ESCAPES), "exits_at_import"]):
        assert name in line and "Traceback" not in line, line
    assert (
        "7 traces: 2 reproduced, 0 failed differently, 0 no longer reproduce, 0 skipped, 5 could not be replayed; "
        "exit status 2" in out
    )


def test_show_reports_a_factory_that_exits_in_one_line(exiting: Path, capsys) -> None:
    """Before: sys.exit(0) in the factory ended ``kvfuzz show`` with exit status 0 and no page."""
    page = exiting / "page.html"
    argv = ["show", str(NO_COPY_ON_WRITE), "--allocator", "exiting:exits", "--html", str(page)]
    refused(capsys, argv, "replay could not start", "SystemExit")
    assert not page.exists()


@pytest.mark.slow
def test_the_plugin_reports_a_factory_that_exits_in_one_line(exiting: Path) -> None:
    """Before: the factory's SystemExit failed the item with a traceback (pytest.skip skipped it); now it is pytest's
    usage error, one line, as a factory that raises is for kvfuzz run."""
    for name in ("exits", "skips"):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(exiting),
             f"--kvfuzz-allocator=exiting:{name}", f"--kvfuzz-corpus={exiting / 'corpus'}", str(exiting)],
            cwd=exiting, capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(exiting), str(ROOT)])},
        )  # fmt: skip
        output = done.stdout + done.stderr
        assert done.returncode == pytest.ExitCode.USAGE_ERROR, output  # as kvfuzz run's 2: before any run
        assert f"--allocator 'exiting:{name}': the factory raised {FACTORY_ESCAPES[name]}" in output, output
        assert "Traceback" not in output and "failed" not in output


def test_a_factory_that_exits_on_a_later_build_is_a_crash_finding_not_the_run_s_exit(exiting: Path, capsys) -> None:
    """Before: the first build is checked, but sys.exit(0) in a later one (a new example's allocator) ended
    ``kvfuzz run`` with exit status 0 in the middle of its search."""
    status = main(["run", "--allocator", "exiting:exits_on_its_sixth_build", "--corpus", str(exiting / "corpus")])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert "crash (SystemExit)" in out, out


def test_generator_exit_from_an_operation_is_a_crash_finding_with_its_trace(tmp_path: Path, capsys) -> None:
    """Before: GeneratorExit passed through kvfuzz as if it were its own, and ended the run with a traceback."""
    status = main(["run", "--allocator", "tests.hostile:generator_exit_on_fork", "--corpus", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert "crash (GeneratorExit)" in out and "state.fork(" in out
    (trace,) = tmp_path.glob("*.json")
    assert json.loads(trace.read_text())["program"]
