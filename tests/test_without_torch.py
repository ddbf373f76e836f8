"""kvfuzz where torch cannot be imported (not installed, or a CUDA build on a machine without the driver): --help,
usage errors and `kvfuzz account` work, every command that drives tensors says in one line what to install (exit
status 2), and the pytest plugin never breaks an unrelated session. Where torch works, --help and usage errors still
import neither torch nor Hypothesis, and replay-workload runs without Hypothesis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuzz import option_defaults

ROOT = Path(__file__).resolve().parent.parent

BROKEN_TORCH = {
    "missing": "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n",
    "cuda build without its driver": "raise OSError('libcuda.so.1: cannot open shared object file')\n",
}


COMMANDS_THAT_DRIVE_TENSORS = [
    ("run",),
    ("zoo", "--only", "NoCopyOnWrite"),
    ("campaign", "--duration", "1"),
    ("replay", "trace.json"),
    ("show", "trace.json"),
    ("export", "trace.json"),
    ("replay-workload", "constructed:uniform"),
    ("serve", "poisson:0.5:1"),
    ("capacity",),
    ("ablate",),
]
"""Every command that needs torch, with arguments that would otherwise do work."""

COMMANDS_THAT_DO_NOT = [
    ("--help",),
    ("run", "--help"),
    *[(command, "--help") for command in ("campaign", "replay", "show", "export", "zoo", "replay-workload")],
    *[(command, "--help") for command in ("serve", "capacity", "ablate")],
    ("run", "--examples", "0"),
    ("account", "--lengths", "37,91,128"),
]
"""--help, a usage error and ``kvfuzz account``: what works without torch."""

_DRIVER = """
import contextlib, io, json, sys
from kvfuzz.cli import main
outcomes = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    outcomes.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(outcomes))
"""
"""Runs kvfuzz's main() on each argument list of argv[1] (JSON) in turn, and prints each one's exit status, standard
output and standard error (JSON): one interpreter for all the commands, instead of one per command."""


def _environment(directory: Path, flavour: str) -> dict[str, str]:
    """An environment whose ``import torch`` fails: a package named torch, first on the path, that raises."""
    shadow = directory / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text(BROKEN_TORCH[flavour])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}


@pytest.fixture(params=sorted(BROKEN_TORCH))
def without_torch(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    return _environment(tmp_path, request.param)


Outcome = tuple[int, str, str]
"""A command's exit status, standard output and standard error."""


@pytest.fixture(scope="module", params=sorted(BROKEN_TORCH))
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, ...], Outcome]:
    """Each command of both lists, run where torch cannot be imported, in one child interpreter (``work/`` is its
    directory, which must stay empty: the commands that need torch do nothing); the key ``()`` holds what is left
    in ``work/`` afterwards, as the standard output of a status 0."""
    directory = tmp_path_factory.mktemp("without-torch")
    work = directory / "work"
    work.mkdir()
    commands = COMMANDS_THAT_DRIVE_TENSORS + COMMANDS_THAT_DO_NOT
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=work,
        env=_environment(directory, request.param),
    )
    assert done.returncode == 0, done.stderr
    found: dict[tuple[str, ...], Outcome] = {
        command: (status, out, err) for command, (status, out, err) in zip(commands, json.loads(done.stdout))
    }
    found[()] = (0, " ".join(sorted(path.name for path in work.iterdir())), "")
    return found


def _kvfuzz(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvfuzz.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_the_command_line_starts_without_torch(without_torch: dict[str, str], tmp_path: Path) -> None:
    """``python -m kvfuzz.cli`` itself, in a fresh process: its --help, and a command that needs torch."""
    top = _kvfuzz(without_torch, "--help", cwd=tmp_path)
    assert top.returncode == 0 and "replay-workload" in top.stdout, top.stderr
    run = _kvfuzz(without_torch, "run", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == "" and "kvfuzz: run needs torch" in run.stderr


def test_help_usage_errors_and_account_work_without_torch(outcomes: dict[tuple[str, ...], Outcome]) -> None:
    status, out, err = outcomes[("--help",)]
    assert status == 0 and "replay-workload" in out, err
    status, out, err = outcomes[("run", "--help")]
    assert status == 0 and "--block-size" in out, err
    for command in ("campaign", "replay", "show", "export", "zoo", "replay-workload", "serve", "capacity", "ablate"):
        assert outcomes[(command, "--help")][0] == 0, command
    status, out, err = outcomes[("run", "--examples", "0")]
    assert status == 2 and len(err.splitlines()) == 1 and "--examples" in err
    status, out, err = outcomes[("account", "--lengths", "37,91,128")]
    assert status == 0 and "3 sequences" in out, err


@pytest.mark.parametrize("args", COMMANDS_THAT_DRIVE_TENSORS)
def test_commands_that_drive_tensors_say_what_to_install(
    outcomes: dict[tuple[str, ...], Outcome], args: tuple[str, ...]
) -> None:
    status, out, err = outcomes[args]
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert (
        line.startswith(f"kvfuzz: {args[0]} needs torch, which cannot be imported here (")
        and "pip install torch" in line
    )


def test_the_commands_that_need_torch_did_nothing(outcomes: dict[tuple[str, ...], Outcome]) -> None:
    assert outcomes[()][1] == ""  # no corpus, no output file: nothing was done


def _pytest(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "kvfuzz.pytest_plugin", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


@pytest.mark.parametrize(
    "without_torch",
    # Three pytest sessions each: the second flavour, which the plugin handles as the first, waits for --slow.
    [pytest.param("missing"), pytest.param("cuda build without its driver", marks=pytest.mark.slow)],
    indirect=True,
)
def test_the_plugin_leaves_an_unrelated_session_alone(without_torch: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "test_unrelated.py").write_text("def test_arithmetic():\n    assert 1 + 1 == 2\n")
    (tmp_path / "package.json").write_text('{"name": "not a trace"}')
    done = _pytest(without_torch, cwd=tmp_path)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
    # A kvfuzz option that needs torch is a usage error of one line; a collected trace fails with that line.
    option = _pytest(without_torch, "--kvfuzz-allocator=kvfuzz", cwd=tmp_path)
    assert option.returncode == 4 and "--kvfuzz-allocator needs torch" in option.stderr
    (tmp_path / "trace.json").write_text(
        (ROOT / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json").read_text()
    )
    traced = _pytest(without_torch, cwd=tmp_path)
    assert traced.returncode == 1 and "1 failed, 1 passed" in traced.stdout
    assert "replaying a trace needs torch, which cannot be imported here" in traced.stdout


def test_help_and_usage_errors_import_neither_torch_nor_hypothesis() -> None:
    script = (
        "import sys\nfrom kvfuzz.cli import main\n"
        "assert main(['run', '--help']) == 0 and main(['zoo', '--examples', 'x']) == 2\n"
        "assert main(['replay-workload', '--help']) == 0 and main(['campaign', '--help']) == 0\n"
        "print(sorted(m for m in ('torch', 'hypothesis', 'kvfuzz.engine') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_replay_workload_runs_without_hypothesis(tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "from kvfuzz.cli import main\n"
        "sys.exit(main(['replay-workload', 'constructed:uniform', '--json']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert '"failure": null' in done.stdout


def test_the_defaults_the_parsers_show_are_the_code_s() -> None:
    """option_defaults spells what --help shows without importing torch: each value equals its source."""
    from kvfuzz.campaign.supervisor import DEFAULT_DURATION
    from kvfuzz.engine.config import DTYPES, MachineConfig
    from kvfuzz.kernels import KERNEL_NAMES
    from kvfuzz.profiles import PROFILES
    from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT
    from kvfuzz.reference.content import ModelShape
    from kvfuzz.scheduler.command import SCHEDULERS
    from kvfuzz.scheduler.config import POLICIES as SCHEDULER_POLICIES
    from kvfuzz.scheduler.config import SchedulerSetup
    from kvfuzz.scheduler.models import MODELS as SCHEDULER_MODELS
    from kvfuzz.workload.budget import POLICIES

    machine, shape = MachineConfig(), ModelShape()
    assert (option_defaults.BLOCK_SIZE, option_defaults.NUM_BLOCKS, option_defaults.NUM_HOST_BLOCKS) == (
        machine.block_size,
        machine.num_blocks,
        machine.num_host_blocks,
    )
    assert (
        option_defaults.NUM_LAYERS,
        option_defaults.NUM_KV_HEADS,
        option_defaults.NUM_QUERY_HEADS,
        option_defaults.HEAD_DIM,
    ) == (shape.num_layers, shape.num_kv_heads, shape.num_query_heads, shape.head_dim)
    assert option_defaults.DTYPE_NAMES == tuple(DTYPES)
    assert option_defaults.KERNEL_NAMES == KERNEL_NAMES
    assert option_defaults.CALL_TIMEOUT == DEFAULT_CALL_TIMEOUT
    assert option_defaults.CAMPAIGN_DURATION == DEFAULT_DURATION
    assert option_defaults.PROFILE_NAMES == tuple(PROFILES)
    assert option_defaults.POLICY_NAMES == POLICIES
    assert option_defaults.SCHEDULER_NAMES == tuple(SCHEDULERS)
    assert option_defaults.SCHEDULER_POLICIES == SCHEDULER_POLICIES
    assert option_defaults.SCHEDULER_MODELS == tuple(SCHEDULER_MODELS)
    assert (option_defaults.SCHEDULER_TOKEN_BUDGET, option_defaults.SCHEDULER_MAX_SEQS) == (
        SchedulerSetup().max_num_batched_tokens,
        SchedulerSetup().max_num_seqs,
    )
