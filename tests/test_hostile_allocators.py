"""A failure kvfuzz found is never lost, and a failure it reports is real: hostile allocators (wrong return types,
escaping BaseExceptions, hangs, segfaults, nondeterminism) and the user's Ctrl-C, through the runner and the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfuzz.allocator import paged_allocator
from kvfuzz.engine import Invariant, MachineConfig
from kvfuzz.program.execution import Target
from kvfuzz.program.failures import Broken, Crash, Hang
from kvfuzz.program.replay import replay
from kvfuzz.program.safeguards import HANG_FLOOR
from kvfuzz.registry import AllocatorTrust
from kvfuzz.runner import HangFound, RunSummary, run
from tests import hostile

ROOT = Path(__file__).resolve().parent.parent


def test_none_instead_of_a_refusal_is_a_contract_violation_not_a_refusal() -> None:
    summary = run(hostile.none_when_full, MachineConfig(num_blocks=4), examples=60, steps=30)
    assert summary.failed and summary.kind == Broken(Invariant.RESULTS), summary.explanation
    assert summary.violated is Invariant.RESULTS and summary.invariant == str(Invariant.RESULTS)
    assert "returned None (NoneType)" in (summary.explanation or "")
    assert "OutOfBlocks" in (summary.explanation or "")


def test_block_ids_of_the_wrong_type_get_a_contract_message() -> None:
    summary = run(hostile.returns_admit_result_of_strings, examples=10, steps=10)
    assert summary.failed and summary.violated is Invariant.RESULTS, summary.explanation
    assert "where an int belongs" in (summary.explanation or "") or "block ids as int" in (summary.explanation or "")


@pytest.mark.parametrize(
    ("factory", "escaped"),
    [
        (hostile.exits_on_fork, "SystemExit"),
        (hostile.skips_on_preempt, "Skipped"),
        (hostile.interrupts_on_rollback, "KeyboardInterrupt"),
        (hostile.generator_exit_on_fork, "GeneratorExit"),
    ],
)
def test_a_base_exception_from_the_allocator_is_its_crash(factory, escaped: str) -> None:
    summary = run(factory, examples=100, steps=30)
    assert summary.failed and not summary.interrupted
    assert summary.kind == Crash(escaped) and summary.invariant == f"crash ({escaped})", summary.invariant
    assert summary.violated is None and summary.to_json()["invariant"] == f"crash ({escaped})"
    assert summary.calls and summary.program_length <= 6
    assert summary.reproduced == summary.replays > 0


@pytest.mark.slow
def test_a_hang_is_reported_in_the_named_operation_shrunk_and_confirmed() -> None:
    started = time.perf_counter()
    # 2 s: well above any legitimate call on a loaded machine (a 0.5 s bound once caught a slow first admit).
    summary = run(hostile.hangs_on_rollback, examples=50, steps=30, call_timeout=2.0)
    # The search, the shrink (its 10 s, and 2 s for each of at most 10 replays that hang) and 2 confirming replays.
    assert time.perf_counter() - started < 90
    assert summary.failed and summary.invariant == "hang"
    assert "rollback" in (summary.explanation or "") and "2 s" in (summary.explanation or "")
    assert summary.calls[-1].rule == "rollback" and summary.shrunk and summary.program_length <= 4
    assert summary.reproduced == summary.replays == 2


@pytest.mark.slow
def test_a_hang_after_a_sequence_of_calls_shrinks_to_those_calls() -> None:
    """The allocator hangs freeing a parent it forked and then rolled back (preempt frees it too): a hang is shrunk
    like any failure, each replay bounded by the watchdog, a shorter program kept only if it hangs in the same
    operation; what is left is the calls the hang needs."""
    summary = run(hostile.hangs_freeing_a_forked_parent, examples=100, steps=30, call_timeout=1.0)
    assert summary.failed and summary.kind == Hang() and summary.shrunk, summary.explanation
    rules = [call.rule for call in summary.calls]
    assert rules[-1] in ("free", "preempt") and {"admit", "fork", "rollback"} <= set(rules), rules
    assert len(rules) <= 5, (summary.program, summary.shrink_note)  # found at 24 calls
    assert summary.reproduced == summary.replays == 2


@pytest.mark.slow
def test_a_hang_whose_interrupt_the_allocator_swallows_is_still_a_hang() -> None:
    """The allocator catches the watchdog's interrupt and goes on for 3 s: it is interrupted again, and a call that
    returns past its deadline is a hang all the same."""
    summary = run(hostile.swallows_interrupts, examples=50, steps=30, call_timeout=0.3)
    assert summary.failed and summary.invariant == "hang", summary.invariant
    assert summary.calls[-1].rule == "rollback"


@pytest.mark.slow
def test_a_hang_is_told_as_found_shrunk_under_a_limit_from_the_calls_times_and_confirmed_at_the_full_one() -> None:
    """Before: every shrinking candidate that kept the hang cost the full --call-timeout (60 s by default; the
    shrink's bound alone was 610 s), and nothing was told of the hang before the run's end. Now the caller is told at
    once (to save it), a candidate is taken to hang after 20 times the slowest call seen (at least 1 s), and the hang
    as found and the confirming replays run at the full limit, which the report names."""
    hostile.HUNG_FOR.clear()
    found: list[HangFound] = []
    summary = run(hostile.hangs_on_20th_change, examples=100, steps=50, call_timeout=6.0, on_hang=found.append)
    assert summary.failed and summary.kind == Hang() and summary.reproduced == summary.replays == 2
    assert "did not return within 6 s (--call-timeout)" in (summary.explanation or "")
    (as_found,) = found
    assert as_found.summary.kind == Hang() and not as_found.summary.shrunk and as_found.summary.calls
    limit = as_found.candidate_limit
    assert limit is not None and HANG_FLOOR <= limit < 6, limit  # the allocator's calls take milliseconds
    assert f"a candidate is taken to hang after {limit:.3g} s" in as_found.describe()
    searched, shrinking, confirming = hostile.HUNG_FOR[0], hostile.HUNG_FOR[1:-2], hostile.HUNG_FOR[-2:]
    assert searched >= 6 and all(seconds >= 6 for seconds in confirming), hostile.HUNG_FOR
    assert shrinking and all(seconds < limit + 1 for seconds in shrinking), (limit, hostile.HUNG_FOR)


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True], ids=["alone", "isolated"])
def test_a_hang_is_saved_as_soon_as_found_and_replays_after_the_run_is_killed_while_shrinking(
    tmp_path: Path, isolate: bool
) -> None:
    """Before: the trace appeared only at the run's end (15 minutes and more for a hang at the 40th call), so a CI
    job's time limit lost it. Now it is saved the moment the search meets the hang, and the line saying so tells how
    long shrinking may take; the run is killed (SIGKILL) while it shrinks, and the trace is there and replays."""
    command = [sys.executable, "-m", "kvfuzz.cli", "run", "--allocator", "tests.hostile:hangs_on_20th_change"]
    command += ["--corpus", str(tmp_path), "--call-timeout", "2", *(["--isolate"] if isolate else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = next((line for line in process.stderr if "hang found" in line), "")  # "": the run ended without one
        still_running = process.poll() is None
    finally:
        process.kill()
        process.wait(timeout=60)
    assert " saved to " in line and "shrinking it may take up to " in line, line
    assert still_running, "the hang was saved only when the run had ended"
    trace = Path(line.split(" saved to ", 1)[1].split("; ", 1)[0])
    assert trace.exists(), line
    if isolate:  # the orphaned child ends within its grace (kvfuzz.lifeline): wait for it, as the next run would
        deadline = time.monotonic() + 30
        while list(tmp_path.glob(".kvfuzz-journal-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
    replayed = _kvfuzz("replay", str(trace), "--trust-allocator", "--call-timeout", "2", cwd=ROOT, timeout=120)
    assert replayed.returncode == 1 and "REPRODUCED" in replayed.stdout, replayed.stdout + replayed.stderr


def test_a_nondeterministic_failure_is_confirmed_by_replays_and_reported_as_flaky() -> None:
    flaky_seen = False
    for seed in range(4):
        summary = run(hostile.sometimes_leaks, examples=60, steps=30, seed=seed, confirm_replays=8)
        assert summary.failed, "a leak half the time is found"
        assert summary.replays == 8 and summary.reproduced is not None
        assert summary.flaky == (summary.reproduced < 8)
        flaky_seen |= summary.flaky
    assert flaky_seen, "in four runs, some shrunk program did not reproduce on every replay"


def test_ctrl_c_during_the_search_of_a_correct_allocator_is_no_failure() -> None:
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        summary = run(paged_allocator, examples=100_000, steps=50)
    finally:
        timer.cancel()
    assert summary.interrupted and not summary.failed
    assert 0 < summary.examples < 100_000


def test_ctrl_c_while_shrinking_keeps_the_best_failure_found_so_far(monkeypatch) -> None:
    # Ctrl-C arrives as kvfuzz's own shrinking starts, after Hypothesis found and shrank a failure: a timer fired at
    # a fixed time landed in the search, or after the run had ended, whenever the machine was slower or faster.
    import kvfuzz.runner

    shrink = kvfuzz.runner.shrink_to_fixpoint

    def interrupted_shrink(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return shrink(*args, **kwargs)

    monkeypatch.setattr(kvfuzz.runner, "shrink_to_fixpoint", interrupted_shrink)
    summary = run(hostile.slow_free_leak, examples=200, steps=50, random_examples=0)
    assert summary.interrupted and summary.failed and summary.calls
    assert summary.invariant != "crash (FlakyFailure)" and "Flaky" not in (summary.invariant or "")
    assert summary.shrink_note is not None and "interrupted" in summary.shrink_note
    # The failure it keeps is real: its program fails the same way on replay.
    outcome = replay(Target(hostile.slow_free_leak), summary.calls)
    assert outcome.failure is not None and str(getattr(outcome.failure, "invariant", "")) == summary.invariant


def test_pools_are_released_between_examples() -> None:
    """Every example's pools are freed when it ends, not by a later garbage collection."""
    import gc

    gc.disable()
    try:
        executions = []
        target = Target(paged_allocator, MachineConfig(num_blocks=64))
        for _ in range(3):
            execution = target.start()
            execution.execute("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]})
            execution.teardown()
            executions.append(execution)
        assert all(execution.engine.pools.keys.numel() == 0 for execution in executions)
    finally:
        gc.enable()


def _kvfuzz(*args: str, cwd: Path, timeout: float = 300, env_slow: str = "0.002") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvfuzz.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVFUZZ_TEST_SLOW": env_slow},
    )


@pytest.mark.slow
def test_a_segfault_leaves_a_journal_that_becomes_a_replayable_trace(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    died = _kvfuzz("run", "--allocator", "tests.hostile:segfaults_on_rollback", "--corpus", str(corpus), cwd=ROOT)
    assert died.returncode in (-signal.SIGSEGV, 128 + signal.SIGSEGV), died.returncode
    assert "Segmentation fault" in died.stderr  # faulthandler's traceback
    journals = list(corpus.glob(".kvfuzz-journal-*.jsonl"))
    assert len(journals) == 1
    lines = [json.loads(line) for line in journals[0].read_text().splitlines()]
    assert lines[0]["format"] == "kvfuzz-journal/1" and lines[-1]["rule"] == "rollback"
    # The next run recovers it as a trace, before doing anything else.
    again = _kvfuzz("run", "--allocator", "tests.hostile:segfaults_on_rollback", "--corpus", str(corpus), cwd=ROOT)
    assert "recovered" in again.stdout + again.stderr
    traces = list(corpus.glob("*.json"))
    assert traces, "the recovered program is a trace"
    trace = json.loads(traces[0].read_text())
    assert trace["program"][-1]["rule"] == "rollback"
    assert trace["failure"]["title"].startswith("crash (the process died")
    # Replayed in a child process, the trace reproduces the death; the replay itself survives it.
    replayed = _kvfuzz("replay", str(traces[0]), "--trust-allocator", cwd=ROOT)
    assert replayed.returncode == 1 and "REPRODUCED" in replayed.stdout, replayed.stdout + replayed.stderr
    assert "signal 11" in replayed.stdout


_SHRINK_INTO_A_SMALL_POOL = """
import sys
from pathlib import Path

from kvfuzz.shrink.candidates import Pools
from kvfuzz.shrink.fixpoint import shrink
from kvfuzz.shrink.signature import signature_of
from kvfuzz.engine.config import MachineConfig, config_json
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.replay import replay
from kvfuzz.program.safeguards import Journal
from tests.hostile import leaks_and_segfaults_in_small_pools as factory

name = "tests.hostile:leaks_and_segfaults_in_small_pools"
config = MachineConfig(block_size=2, num_blocks=16, num_host_blocks=0)
admit = {"seq": "s0", "namespace": (), "system": (), "suffix": [1, 2, 3]}
calls = [Call("admit", admit), Call("step", {}), Call("free", {"seq": "s0"})]
outcome = replay(Target(factory, config), calls)
assert outcome.failure is not None, "the leak fails in the pool it was found in"
signature = signature_of(name, outcome.failure, calls, outcome.failed_at)
journal = Journal(Path(sys.argv[1]), {"allocator": name}, {"config": config_json(config, config.inflight_window)})
shrink(factory, config, calls, outcome.failure, signature, seconds=60, pools=Pools(), safeguards=Safeguards(journal))
print("the shrink never tried a pool of fewer than 4 blocks")
"""


@pytest.mark.slow
def test_a_death_while_shrinking_in_a_smaller_pool_is_recovered_with_that_pool(tmp_path: Path) -> None:
    """The shrinker replays candidates in smaller pools than the failure was found in; the allocator kills the process
    in one. The journal names the pool each program ran in, so the recovered trace is the program that died, in the
    pool it died in, and its replay dies the same way (with the first pool it would replay the leak instead)."""
    from kvfuzz.saved.journals import recover
    from kvfuzz.saved.trace import load

    died = subprocess.run(
        [sys.executable, "-c", _SHRINK_INTO_A_SMALL_POOL, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert died.returncode == -signal.SIGSEGV, died.stdout + died.stderr
    (recovered,) = recover(tmp_path)
    assert recovered.trace is not None, recovered.message
    trace = load(recovered.trace)
    assert trace.config.num_blocks < 4 and trace.program[-1].rule == "admit"
    replayed = _kvfuzz("replay", str(recovered.trace), "--trust-allocator", cwd=ROOT)
    assert replayed.returncode == 1 and "signal 11" in replayed.stdout, replayed.stdout + replayed.stderr


def _flaky_leak_run() -> RunSummary:
    """A run against a leak that happens half the time, reported flaky (8 confirming replays) yet reproduced."""
    for seed in range(8):
        summary = run(hostile.sometimes_leaks, examples=60, steps=30, seed=seed, confirm_replays=8)
        if summary.flaky and summary.reproduced:
            return summary
    pytest.fail("no run of a leak that happens half the time was reported flaky")


def test_a_flaky_failure_is_saved_flaky_and_replayed_and_exported_as_such(tmp_path: Path) -> None:
    from kvfuzz.saved.corpus import export_test, replay_trace, save_failure
    from kvfuzz.saved.trace import load

    summary = _flaky_leak_run()
    saved = save_failure(summary, "tests.hostile:sometimes_leaks", MachineConfig(), tmp_path)
    assert saved is not None and saved.error is None
    trace = load(saved.path)
    assert trace.flaky == (summary.reproduced, 8)
    assert json.loads(saved.path.read_text())["flaky"] == {"reproduced": summary.reproduced, "replays": 8}
    replayed = replay_trace(trace, trust=AllocatorTrust(("tests",)))
    assert replayed.tries == 8 and 0 < replayed.reproductions < 8 + 1
    assert "flaky: reproduced in" in replayed.describe_failure() or not replayed.failed
    exported = export_test(trace, str(saved.path))
    assert "for _ in range(8):" in exported and "Flaky:" in exported
    compile(exported, "exported", "exec")


def test_sys_exit_in_the_allocator_fails_the_run_and_saves_the_crash(tmp_path: Path) -> None:
    done = _kvfuzz("run", "--allocator", "tests.hostile:exits_on_fork", "--corpus", str(tmp_path), cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "crash (SystemExit)" in done.stdout and "FAILED" in done.stdout
    assert len(list(tmp_path.glob("*.json"))) == 1


@pytest.mark.slow
def test_a_hang_through_the_cli_is_saved_and_its_replay_reports_the_hang(tmp_path: Path) -> None:
    args = ("--allocator", "tests.hostile:hangs_on_rollback", "--corpus", str(tmp_path), "--call-timeout", "0.5")
    done = _kvfuzz("run", *args, cwd=ROOT, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "hang" in done.stdout and "did not return within 0.5 s" in done.stdout
    (trace,) = tmp_path.glob("*.json")
    replayed = _kvfuzz("replay", str(trace), "--trust-allocator", "--call-timeout", "0.5", cwd=ROOT, timeout=120)
    assert replayed.returncode == 1 and "REPRODUCED" in replayed.stdout, replayed.stdout + replayed.stderr


def _interrupt(args: list[str], tmp_path: Path, when: str, slow: str = "0.002") -> subprocess.CompletedProcess:
    """Start ``kvfuzz run ARGS``, send it SIGINT once its progress line on stderr shows ``when``, and wait."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvfuzz.cli", "run", "--corpus", str(tmp_path), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVFUZZ_TEST_SLOW": slow},
    )
    assert process.stderr is not None
    seen = []
    deadline = time.monotonic() + 120
    for line in process.stderr:
        seen.append(line)
        if when in line or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, "".join(seen) + stderr)


def test_ctrl_c_on_a_correct_allocator_exits_130_with_no_failure_and_no_trace(tmp_path: Path) -> None:
    done = _interrupt(["--examples", "100000"], tmp_path, when="random programs: example 2")
    assert done.returncode == 130, done.stdout + done.stderr
    assert "interrupted after" in done.stdout and "no failure found" in done.stdout
    assert "FAILED" not in done.stdout and "Traceback" not in done.stderr
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob(".kvfuzz-journal-*"))


@pytest.mark.slow
def test_ctrl_c_while_shrinking_prints_and_saves_the_best_failure_and_exits_130(tmp_path: Path) -> None:
    # Each admit takes 0.3 s and every failing program admits three times: shrinking takes many seconds, and
    # Ctrl-C arrives once the progress line says it is under way.
    allocator = "tests.hostile:slow_admit_free_leak"
    done = _interrupt(["--allocator", allocator, "--examples", "300"], tmp_path, when="shrinking:", slow="0.3")
    assert done.returncode == 130, done.stdout + done.stderr
    assert "shrunk only as far as it got" in done.stdout and "Traceback" not in done.stderr
    assert "Flaky" not in done.stdout
    (trace,) = tmp_path.glob("*.json")
    replayed = _kvfuzz("replay", str(trace), "--trust-allocator", cwd=ROOT, env_slow="0")
    assert replayed.returncode == 1 and "REPRODUCED" in replayed.stdout


def test_pytest_skip_in_the_allocator_fails_the_plugin_item_it_is_no_skip(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
         "--kvfuzz-allocator=tests.hostile:skips_on_preempt", f"--kvfuzz-corpus={tmp_path / 'corpus'}",
         "--kvfuzz-examples=60", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
    assert "crash (Skipped)" in done.stdout


def test_a_flaky_replay_that_takes_another_path_counts_as_not_reproduced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nondeterministic allocator may refuse in one try where the recording did not, so a later call of the trace
    cannot be made: that try does not reproduce, and the replay goes on (only a trace not marked flaky raises)."""
    import attrs

    from kvfuzz import corpus
    from kvfuzz.program.replay import NotApplicable
    from kvfuzz.saved.trace import load

    summary = _flaky_leak_run()
    saved = corpus.save_failure(summary, "tests.hostile:sometimes_leaks", MachineConfig(), tmp_path)
    assert saved is not None
    trace = load(saved.path)
    real_replay = corpus.replay
    tries: list[int] = []

    def diverging_every_other_try(*args, **kwargs):  # type: ignore[no-untyped-def]
        tries.append(1)
        if len(tries) % 2 == 0:
            raise NotApplicable("call 3 cannot be made in the state the calls before it left")
        return real_replay(*args, **kwargs)

    monkeypatch.setattr(corpus, "replay", diverging_every_other_try)
    replayed = corpus.replay_trace(trace, trust=AllocatorTrust(("tests",)))
    assert replayed.tries == 8 and len(tries) == 8 and replayed.reproductions <= 4
    tries.clear()
    tries.append(1)  # the next try diverges: a trace not marked flaky does not fit, and that is said
    with pytest.raises(NotApplicable):
        corpus.replay_trace(attrs.evolve(trace, flaky=None), trust=AllocatorTrust(("tests",)))
