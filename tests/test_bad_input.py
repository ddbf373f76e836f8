"""Bad input to the command line and the pytest plugin: one line on standard error, ``kvfuzz: ...``, exit status 2,
and no work (nothing on standard output, no run, no replay, nothing written); never a traceback, never "passed",
never a trace blaming the allocator.

Commands run in this process through :func:`kvfuzz.cli.main`. What would do the work (the runner, the zoo's runs,
the workload scheduler) is replaced by a function that fails the test if it is ever called, so "before any work" is
checked, not assumed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kvfuzz.runner
import kvfuzz.zoo_run
from kvfuzz.allocator.paged import paged_allocator
from kvfuzz.allocator.types import PoolSpec
from kvfuzz.cli import main
from kvfuzz.registry import AllocatorNotFound, AllocatorUnusable, load_factory, probe_allocator, registered_allocators
from kvfuzz.workload.format import FORMAT
from kvfuzz.workload.scheduler import Scheduler

REPOSITORY = Path(__file__).resolve().parent.parent
TRACE = REPOSITORY / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"

# -- factories that do not build a usable allocator (named as test_bad_input:NAME) ------------------------------------


def raises(spec: PoolSpec):
    raise RuntimeError("the pool is on fire\nsecond line of the message")


def returns_none(spec: PoolSpec):
    return None


def without_capabilities(spec: PoolSpec):
    return types.SimpleNamespace(block_size=spec.block_size, num_blocks=spec.num_blocks, num_host_blocks=0)


def takes_nothing():
    return paged_allocator(PoolSpec(4, 16, 4))


def takes_two(spec: PoolSpec, other: int):
    return paged_allocator(spec)


def ignores_block_size(spec: PoolSpec):
    return paged_allocator(PoolSpec(spec.block_size * 2, spec.num_blocks, spec.num_host_blocks))


def ignores_num_blocks(spec: PoolSpec):
    return paged_allocator(PoolSpec(spec.block_size, spec.num_blocks + 1, spec.num_host_blocks))


def ignores_host_blocks(spec: PoolSpec):
    return paged_allocator(PoolSpec(spec.block_size, spec.num_blocks, spec.num_host_blocks + 3))


def needs_a_missing_package(spec: PoolSpec):
    import kvfuzz_no_such_engine  # noqa: F401

    return paged_allocator(spec)


BAD_FACTORIES = {
    "raises": "the factory raised RuntimeError: the pool is on fire second line of the message",
    "returns_none": "returned None",
    "without_capabilities": "without 'capabilities'",
    "takes_nothing": "must take one argument, a PoolSpec",
    "takes_two": "must take one argument, a PoolSpec",
    "ignores_block_size": "block_size",
    "ignores_num_blocks": "num_blocks",
    "ignores_host_blocks": "num_host_blocks",
    "needs_a_missing_package": "needs a package that is not installed",
}


# -- the checks ----------------------------------------------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command gets as far as running the machine, the zoo or a workload."""

    def work(*args, **kwargs):
        raise AssertionError("bad input reached the work")

    monkeypatch.setattr(kvfuzz.runner, "run", work)  # kvfuzz run imports it when it runs
    monkeypatch.setattr(kvfuzz.zoo_run, "run_zoo", work)
    monkeypatch.setattr(Scheduler, "run", work)


def usage_error(capsys, argv: list[str]) -> str:
    """Run ``kvfuzz argv``: exit status 2, nothing on standard output, exactly one line on standard error starting
    ``kvfuzz: `` and no traceback. Returns that line."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (status, out, err)
    assert out == "", out  # no header, no report: nothing started
    assert "Traceback" not in err and "passed" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvfuzz: "), lines[0]
    return lines[0]


RUN_ARGUMENTS = [
    (["--examples", "0"], "--examples: must be >= 1, got 0"),
    (["--examples", "-1"], "--examples: must be >= 1, got -1"),
    (["--examples", "many"], "--examples: expected an integer >= 1, got 'many'"),
    (["--steps", "0"], "--steps: must be >= 1"),
    (["--layers", "0"], "--layers: must be >= 1"),
    (["--kv-heads", "0"], "--kv-heads: must be >= 1"),
    (["--query-heads", "0"], "--query-heads: must be >= 1"),
    (["--head-dim", "0"], "--head-dim: must be >= 1"),
    (["--block-size", "0"], "--block-size: must be >= 1"),
    (["--num-blocks", "0"], "--num-blocks: must be >= 1"),
    (["--host-blocks", "-1"], "--host-blocks: must be >= 0"),
    (["--kv-heads", "2", "--query-heads", "3"], "--query-heads 3 is not a multiple of --kv-heads 2"),
    (["--device", "tpu"], "--device 'tpu' is not a torch device"),
    (["--device", "meta"], "--device 'meta' holds no data"),
    (["--dtype", "float64"], "--dtype: invalid choice"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
]


@pytest.mark.parametrize("arguments, message", RUN_ARGUMENTS, ids=[" ".join(a) for a, _ in RUN_ARGUMENTS])
def test_run_refuses_bad_machine_arguments_in_one_line(arguments, message, capsys, tmp_path, no_work):
    """Before: --examples 0 ran and said "passed: 0 examples"; --kv-heads 0 raised ZeroDivisionError; --layers 0 or
    --head-dim 0 ran on empty tensors; --device tpu raised a RuntimeError traceback from torch."""
    corpus = tmp_path / "corpus"
    assert message in usage_error(capsys, ["run", "--corpus", str(corpus), *arguments])
    assert not corpus.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_run_refuses_cuda_where_torch_sees_none(capsys, no_work):
    assert "torch sees no CUDA device here" in usage_error(capsys, ["run", "--device", "cuda"])


@pytest.mark.parametrize("arguments, message", RUN_ARGUMENTS[:12], ids=[" ".join(a) for a, _ in RUN_ARGUMENTS[:12]])
def test_zoo_refuses_bad_machine_arguments_in_one_line(arguments, message, capsys, no_work):
    """Before: the zoo ran every variant with them (or raised ZeroDivisionError)."""
    assert message in usage_error(capsys, ["zoo", "--only", "LeakOnCancel", *arguments])


def test_run_refuses_a_seed_with_a_database_before_printing_its_header(capsys, tmp_path, no_work):
    """Before: the header (saying "seed 1") was printed first, then the refusal."""
    database = tmp_path / "db"
    line = usage_error(capsys, ["run", "--seed", "1", "--database", str(database)])
    assert "--seed and --database cannot be combined" in line
    assert not database.exists()


@pytest.mark.parametrize("name", sorted(BAD_FACTORIES))
@pytest.mark.parametrize(
    "command",
    [
        ["run"],
        ["replay-workload", "constructed:uniform"],
        ["replay-workload", "constructed:uniform", "--block-sizes", "8,16"],
    ],
    ids=["run", "replay-workload", "replay-workload sweep"],
)
def test_an_unusable_factory_is_one_line_naming_the_allocator(command, name, capsys, tmp_path, no_work):
    """Before: a factory that raised, returned None, lacked capabilities or took the wrong arguments was a Python
    traceback (run) or a replay "crash" blaming the allocator; one that ignored the pool it was given ran and was
    reported as a crash (GeometryMismatch) with a trace saved to the corpus."""
    corpus = ["--corpus", str(tmp_path / "corpus")] if command == ["run"] else []
    line = usage_error(capsys, [*command, *corpus, "--allocator", f"test_bad_input:{name}"])
    assert f"--allocator 'test_bad_input:{name}'" in line
    assert BAD_FACTORIES[name] in line
    assert not (tmp_path / "corpus").exists()


def test_the_transformers_adapter_without_transformers_is_one_line(capsys, monkeypatch, no_work):
    """Before: ModuleNotFoundError with a traceback, from inside the factory."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    line = usage_error(capsys, ["run", "--allocator", "kvfuzz.adapters.hf_transformers:paged_attention_cache"])
    assert "needs transformers: pip install 'kvfuzz[transformers]'" in line


def test_a_module_that_fails_to_import_is_one_line(capsys, tmp_path, monkeypatch, no_work):
    """Before: the module's own exception (not an ImportError) escaped as a traceback."""
    (tmp_path / "broken_allocator_module.py").write_text("raise RuntimeError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = usage_error(capsys, ["run", "--allocator", "broken_allocator_module:factory"])
    assert "importing 'broken_allocator_module' raised RuntimeError: half-installed" in line


def test_an_unknown_allocator_name_lists_the_registered_names_and_the_accepted_forms(capsys, no_work):
    """Before: "expected MODULE:FACTORY" only, naming neither the registered allocators nor zoo:NAME."""
    line = usage_error(capsys, ["run", "--allocator", "kvfuzz-synchronus"])
    assert set(registered_allocators()) >= {"kvfuzz", "kvfuzz-synchronous"}
    for name in registered_allocators():
        assert name in line
    assert "MODULE:FACTORY" in line and "zoo:NAME" in line
    assert "no zoo variant named 'Nope'" in usage_error(capsys, ["run", "--allocator", "zoo:Nope"])


def test_probe_allocator_returns_the_allocator_and_raises_typed_errors():
    pool = PoolSpec(4, 16, 4)
    assert probe_allocator("kvfuzz", load_factory("kvfuzz"), pool).num_blocks == 16
    # num_host_blocks may be 0: an allocator without swap keeps no host pool
    assert probe_allocator("none", lambda spec: paged_allocator(PoolSpec(4, 16, 0)), pool).num_host_blocks == 0
    with pytest.raises(AllocatorUnusable, match="returned None"):
        probe_allocator("x", returns_none, pool)
    with pytest.raises(AllocatorNotFound, match="not installed"):
        probe_allocator("x", needs_a_missing_package, pool)


def test_export_into_a_missing_directory_is_one_line(capsys, tmp_path):
    """Before: FileNotFoundError with a traceback."""
    target = tmp_path / "missing" / "test_x.py"
    line = usage_error(capsys, ["export", str(TRACE), "-o", str(target)])
    assert "-o" in line and "does not exist" in line
    assert not target.parent.exists()


def test_a_plot_into_a_missing_directory_is_refused_before_the_replay(capsys, tmp_path, no_work):
    """Before: the whole replay ran, then the plot raised FileNotFoundError with a traceback."""
    line = usage_error(capsys, ["replay-workload", "constructed:uniform", "--plot", str(tmp_path / "no" / "p.png")])
    assert "--plot" in line and "does not exist" in line


def test_a_plot_without_matplotlib_is_refused_before_the_replay(capsys, tmp_path, monkeypatch, no_work):
    """Before: the whole replay ran before the missing plot extra was noticed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    line = usage_error(capsys, ["replay-workload", "constructed:uniform", "--plot", str(tmp_path / "p.png")])
    assert "pip install 'kvfuzz[plot]'" in line


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--block-size", "0"], "--block-size: must be >= 1"),
        (["--num-blocks", "0"], "--num-blocks: must be >= 1"),
        (["--max-running", "0"], "--max-running: must be >= 1"),
        (["--pool-positions", "0"], "--pool-positions: must be >= 1"),
        (["--block-sizes", "8,0"], "--block-sizes: a block size must be >= 1"),
    ],
)
def test_replay_workload_refuses_bad_pool_arguments(arguments, message, capsys, no_work):
    """Before: --num-blocks 0 was taken as "not given" and replayed a default pool."""
    assert message in usage_error(capsys, ["replay-workload", "constructed:uniform", *arguments])


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--layers", "0"], "--layers: must be >= 1"),
        (["--kv-heads", "-1"], "--kv-heads: must be >= 1"),
        (["--head-dim", "0"], "--head-dim: must be >= 1"),
        (["--reserve", "0"], "--reserve: must be >= 1"),
        (["--table-entry-bytes", "0"], "--table-entry-bytes: must be >= 1"),
        (["--block-sizes", "8,0"], "--block-sizes: a block size must be >= 1"),
    ],
)
def test_account_refuses_bad_sizes_in_one_line(arguments, message, capsys):
    """Before: --table-entry-bytes 0 printed a table of zero-byte block tables, and the other refusals began
    "kvfuzz account:" rather than "kvfuzz:"."""
    assert message in usage_error(capsys, ["account", "--lengths", "5,9", *arguments])


REQUEST = {"id": "r7", "arrival": 2, "prompt_len": 4, "output_len": 3}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"output_len": None}, "request 'r7' (#1): 'output_len' is required"),
        (
            {"output_len": None, "ouput_len": 3},
            "request 'r7' (#1): unknown field 'ouput_len' (did you mean 'output_len'?)",
        ),
        ({"cancel_at": 1}, "request 'r7' (#1): 'cancel_at' 1 is before its 'arrival' 2"),
    ],
    ids=["missing output_len", "misspelled output_len", "cancel_at before arrival"],
)
def test_a_bad_workload_file_names_the_request_and_the_field(change, message, capsys, tmp_path, no_work):
    """Before: a missing output_len silently became 1, a misspelled field was ignored, and a cancellation before
    arrival was accepted: all three replayed and exited 0."""
    request = {key: value for key, value in {**REQUEST, **change}.items() if value is not None}
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"format": FORMAT, "name": "w", "origin": "recorded", "requests": [request]}))
    assert message in usage_error(capsys, ["replay-workload", str(path)])


def test_a_misspelled_top_level_field_is_refused(capsys, tmp_path, no_work):
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"format": FORMAT, "name": "w", "origin": "recorded", "request": [REQUEST]}))
    assert "unknown field 'request' (did you mean 'requests'?)" in usage_error(capsys, ["replay-workload", str(path)])


# -- the header and plurals ----------------------------------------------------------------------------------------


def test_the_run_header_says_derandomized_only_when_it_is(capsys, tmp_path, monkeypatch):
    """Before: a --database run (random: Hypothesis ignores derandomize with a database) said "derandomized"."""

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(kvfuzz.runner, "run", stop)  # the header is printed before the run starts
    headers = {}
    for name, extra in {"plain": [], "seed": ["--seed", "7"], "database": ["--database", str(tmp_path / "db")]}.items():
        with pytest.raises(Stop):
            main(
                ["run", "--examples", "1", "--steps", "1", "--num-blocks", "1", "--block-size", "1"]
                + ["--corpus", str(tmp_path / "corpus"), *extra]
            )
        headers[name] = capsys.readouterr().out
    assert headers["plain"].rstrip().endswith("1 example of up to 1 step, derandomized")
    assert headers["seed"].rstrip().endswith("1 example of up to 1 step, seed 7")
    assert "derandomized" not in headers["database"] and "random, example database" in headers["database"]
    assert "pool: 1 block x 1 slot, 4 host blocks" in headers["plain"]


# -- the pytest plugin ---------------------------------------------------------------------------------------------


def _pytest(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    """pytest in a fresh directory with one trivial test; this file's factories importable as test_bad_input."""
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    here = str(Path(__file__).resolve().parent)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))},
    )


@pytest.mark.parametrize("option", ["--kvfuzz-examples=0", "--kvfuzz-steps=0"])
def test_the_plugin_refuses_zero_examples_or_steps_as_a_usage_error(option, tmp_path):
    """Before: 0 fell back to the profile's count (``option or profile.max_examples``) and the session ran."""
    result = _pytest(tmp_path, option)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert errors == [f"ERROR: {option}: must be >= 1"]


def test_the_plugin_reports_an_unusable_factory_in_one_line(tmp_path):
    """Before: the probe in MachineItem called the factory bare, so its exception failed the item with a
    traceback; then it failed the item (exit 1, a finding's status). Now it is pytest's usage error, before any run."""
    result = _pytest(tmp_path, "--kvfuzz-allocator=test_bad_input:raises")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, output
    assert "--allocator 'test_bad_input:raises': the factory raised RuntimeError" in output
    assert "Traceback" not in output and "site-packages" not in output


def test_show_of_a_trace_whose_name_is_not_utf_8_prints_its_name_escaped(tmp_path: Path) -> None:
    """Before: a ``UnicodeEncodeError`` traceback as the command printed the name (it comes in with surrogate
    escapes). Now every unencodable character prints as its escape, and the page is written."""
    import shutil

    root = Path(__file__).resolve().parent.parent
    name = b"trace-\xff.json"
    shutil.copyfile(root / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json", bytes(tmp_path) + b"/" + name)
    environment = {**os.environ, "PYTHONPATH": str(root), "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        [sys.executable, "-m", "kvfuzz.cli", "show", name, "--html", "page.html"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"Traceback" not in done.stderr and b"trace-\\udcff.json" in done.stdout
    assert (tmp_path / "page.html").is_file()
