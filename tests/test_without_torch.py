"""kvfuzz where torch cannot be imported (not installed, or a CUDA build on a machine without the driver): --help,
usage errors and `kvfuzz account` work, every command that drives tensors says in one line what to install (exit
status 2), and the pytest plugin never breaks an unrelated session. Where torch works, --help and usage errors still
import neither torch nor Hypothesis, and replay-workload runs without Hypothesis."""

from __future__ import annotations

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


@pytest.fixture(params=sorted(BROKEN_TORCH))
def without_torch(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """An environment whose ``import torch`` fails: a package named torch, first on the path, that raises."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text(BROKEN_TORCH[request.param])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}


def _kvfuzz(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvfuzz.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_help_usage_errors_and_account_work_without_torch(without_torch: dict[str, str], tmp_path: Path) -> None:
    top = _kvfuzz(without_torch, "--help", cwd=tmp_path)
    assert top.returncode == 0 and "replay-workload" in top.stdout, top.stderr
    run_help = _kvfuzz(without_torch, "run", "--help", cwd=tmp_path)
    assert run_help.returncode == 0 and "--block-size" in run_help.stdout, run_help.stderr
    for command in ("campaign", "replay", "show", "export", "zoo", "replay-workload", "serve", "capacity", "ablate"):
        assert _kvfuzz(without_torch, command, "--help", cwd=tmp_path).returncode == 0, command
    usage = _kvfuzz(without_torch, "run", "--examples", "0", cwd=tmp_path)
    assert usage.returncode == 2 and len(usage.stderr.splitlines()) == 1 and "--examples" in usage.stderr
    account = _kvfuzz(without_torch, "account", "--lengths", "37,91,128", cwd=tmp_path)
    assert account.returncode == 0 and "3 sequences" in account.stdout, account.stderr


@pytest.mark.parametrize(
    "args",
    [
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
    ],
)
def test_commands_that_drive_tensors_say_what_to_install(
    without_torch: dict[str, str], tmp_path: Path, args: tuple[str, ...]
) -> None:
    done = _kvfuzz(without_torch, *args, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert (
        line.startswith(f"kvfuzz: {args[0]} needs torch, which cannot be imported here (")
        and "pip install torch" in line
    )
    assert not (tmp_path / "corpus").exists()  # nothing was done


def _pytest(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "kvfuzz.pytest_plugin", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
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
    from kvfuzz.scheduler.config import SchedulerSetup
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
    assert (option_defaults.SCHEDULER_TOKEN_BUDGET, option_defaults.SCHEDULER_MAX_SEQS) == (
        SchedulerSetup().max_num_batched_tokens,
        SchedulerSetup().max_num_seqs,
    )
