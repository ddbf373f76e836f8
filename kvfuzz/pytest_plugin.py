"""kvfuzz's pytest plugin (entry point ``pytest11``).

* Trace files (``kvfuzz-trace/1`` JSON, e.g. under ``corpus/``) are collected as tests. Each replays its program,
  without Hypothesis, against its recorded allocator (or ``--kvfuzz-replay-allocator``): it fails while the recorded
  failure reproduces, and passes once the bug is fixed. A trace marked ``known_bug`` is the reverse: it passes
  while the bug still reproduces and fails once it stops, so the mark gets removed. A trace whose allocator is not
  installed here (or that ran on a CUDA device this machine lacks) is skipped, with the reason; one whose allocator
  raises or exits (``sys.exit``, ``pytest.skip``) while it is imported or built fails, in one line. A trace names
  code that its replay imports and calls: one naming a ``MODULE:FACTORY`` that is not registered, a ``zoo:`` name or
  kvfuzz's own fails with one line naming what it would import, unless its module is under a prefix the
  ``kvfuzz_trusted_allocators`` ini list names (a project's own allocators, for its own corpus) or the session
  passes ``--kvfuzz-trust-allocator`` (see :class:`kvfuzz.registry.AllocatorTrust`).

  Which files are collected: a ``.json`` file whose bytes hold ``kvfuzz-trace`` anywhere, in UTF-8, UTF-16 or
  UTF-32 (so formatting and key order never matter), and a ``.json`` file whose bytes are no text at all in a
  directory that holds a trace (a damaged trace). Each is one item: one that is not a valid trace fails with one
  line naming the file and the reason (see :func:`kvfuzz.saved.trace.load`), so a bad file never stops the session.
  Other JSON files (workloads, ``package.json``) are left alone.
* Scheduler traces (``kvfuzz-scheduler-trace/1``, a ``kvfuzz run --scheduler`` failure) are collected the same way
  and replayed against the installed vLLM with the same rules (``known_bug`` included); where vLLM is not installed
  they are skipped, with the reason, as a trace whose allocator is not installed is.
* ``pytest --kvfuzz-allocator=pkg.mod:factory`` adds one test per allocator that runs the machine against it under
  a settings profile (``--kvfuzz-profile ci|dev|nightly``; ``--kvfuzz-examples``, ``--kvfuzz-steps`` and
  ``--kvfuzz-seed`` override it; ``--kvfuzz-kernel`` picks invariant 2's attention kernel). A failure is saved as
  a trace in ``--kvfuzz-corpus`` (default ``corpus``) and, with ``--kvfuzz-database DIR``, in a Hypothesis example
  database that the next run tries first. ``--kvfuzz-isolate`` runs the allocator in a child process
  (:mod:`kvfuzz.isolated_run`): a segfault in it fails the item with its program and trace instead of ending pytest.
  A factory that raises or exits while it is loaded or built fails the
  item with one line naming the allocator and what it raised, before any run.
* ``pytest --kvfuzz-scheduler=vllm-v1`` (or ``sglang``) adds one test per scheduler target that runs
  ``kvfuzz run --scheduler NAME``'s search at its default configuration under the same profile and options (a
  failure fails the item with its program and explanation, its scheduler trace saved in ``--kvfuzz-corpus``); its
  engine must be installed (a session asking for it elsewhere is a usage error, one line).
* Under ``--kvfuzz-profile nightly`` the item runs a campaign instead (:mod:`kvfuzz.campaign`): swarmed
  configurations on ``--kvfuzz-workers`` processes (default: the cores) for ``--kvfuzz-duration`` seconds (default
  600), every distinct failure shrunk and saved; ``--kvfuzz-database`` may then be a ``redis://HOST:PORT/N`` shared
  by machines. The item fails with the table of new distinct failures; the corpus's known findings are counted,
  not reported.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Optional, Protocol

import pytest

from kvfuzz.option_defaults import CALL_TIMEOUT, CAMPAIGN_DURATION, KERNEL_NAMES, PROFILE_NAMES, SCHEDULER_NAMES
from kvfuzz.registry import (
    AllocatorNotFound,
    AllocatorTrust,
    AllocatorUnusable,
    UntrustedAllocator,
    load_factory,
    probe_allocator,
)
from kvfuzz.text import printable
from kvfuzz.torch_check import INSTALL_TORCH, torch_unavailable
from kvfuzz.trace_files import json_file_kind
from kvfuzz.trace_saving import replay_hint


class KvfuzzFailure(Exception):
    """A kvfuzz test failed; the message says why, for a person."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfuzz", "kvfuzz: fuzz a paged KV-cache allocator")
    group.addoption(
        "--kvfuzz-allocator",
        action="append",
        default=[],
        metavar="SPEC",
        help="run kvfuzz's machine against this allocator (MODULE:FACTORY, zoo:NAME, or a name "
        "registered under the kvfuzz.allocators entry points); repeatable",
    )
    group.addoption(
        "--kvfuzz-scheduler",
        action="append",
        default=[],
        choices=SCHEDULER_NAMES,
        help="search this scheduler target (vllm-v1, sglang: kvfuzz run --scheduler NAME) under the profile; "
        "repeatable",
    )
    group.addoption(
        "--kvfuzz-untested-engine",
        action="store_true",
        help="search a --kvfuzz-scheduler target whose engine version kvfuzz is not tested on (kvfuzz run "
        "--untested-engine)",
    )
    group.addoption(
        "--kvfuzz-profile",
        choices=sorted(PROFILE_NAMES),
        default="ci",
        help="settings profile: ci (bounded, derandomized; default), dev, nightly (long)",
    )
    group.addoption("--kvfuzz-examples", type=int, help="examples to run (overrides the profile)")
    group.addoption("--kvfuzz-steps", type=int, help="most steps per example (overrides the profile)")
    group.addoption("--kvfuzz-seed", type=int, help="random seed (overrides derandomization)")
    group.addoption("--kvfuzz-corpus", default="corpus", metavar="DIR", help="where failures are saved as traces")
    group.addoption(
        "--kvfuzz-call-timeout",
        type=float,
        default=CALL_TIMEOUT,
        metavar="SECONDS",
        help=f"an operation still running after this long is a hang (default {CALL_TIMEOUT:g}; 0: no watchdog)",
    )
    group.addoption(
        "--kvfuzz-database",
        metavar="DIR",
        help="Hypothesis example database for the machine's failures (share it between CI runs)",
    )
    group.addoption(
        "--kvfuzz-kernel",
        choices=KERNEL_NAMES,
        default="gather",
        help="attention kernel of invariant 2 for --kvfuzz-allocator runs: gather (default), flex, allocator, "
        "vllm-triton, sglang-triton; on CUDA flex-compiled, flashinfer, flashinfer-prefill",
    )
    group.addoption(
        "--kvfuzz-duration",
        type=float,
        default=CAMPAIGN_DURATION,
        metavar="SECONDS",
        help=f"how long the nightly profile's campaign runs (default {CAMPAIGN_DURATION:g})",
    )
    group.addoption(
        "--kvfuzz-workers", type=int, metavar="N", help="worker processes of the nightly campaign (default: the cores)"
    )
    group.addoption(
        "--kvfuzz-isolate",
        action="store_true",
        help="run --kvfuzz-allocator's allocator in a child process: a segfault or an abort in it fails the item "
        "with its program, saved as a trace, instead of killing pytest",
    )
    group.addoption(
        "--kvfuzz-replay-allocator",
        metavar="SPEC",
        help="replay collected traces against this allocator instead of the recorded ones",
    )
    group.addoption(
        "--kvfuzz-trust-allocator",
        action="store_true",
        help="import and call the allocator any collected trace names, even one not registered, not a zoo: name "
        "and not kvfuzz's own (only for traces from a source you trust: a trace can name any importable callable)",
    )
    parser.addini(
        "kvfuzz_trusted_allocators",
        type="linelist",
        default=[],
        help="module prefixes whose allocators collected traces may name (a project's own, e.g. mypackage)",
    )


_TRUST = pytest.StashKey[AllocatorTrust]()


def pytest_configure(config: pytest.Config) -> None:
    """kvfuzz's options checked before anything is collected: a bad one is a usage error, one line."""
    try:
        config.stash[_TRUST] = AllocatorTrust(
            tuple(config.getini("kvfuzz_trusted_allocators")), config.getoption("kvfuzz_trust_allocator")
        )
    except ValueError as error:
        raise pytest.UsageError(f"kvfuzz_trusted_allocators: {error}") from None
    for name in ("kvfuzz_examples", "kvfuzz_steps", "kvfuzz_workers"):
        value = config.getoption(name)
        if value is not None and value < 1:
            raise pytest.UsageError(f"--{name.replace('_', '-')}={value}: must be >= 1")
    duration = config.getoption("kvfuzz_duration")
    if not duration > 0:
        raise pytest.UsageError(f"--kvfuzz-duration={duration}: must be more than 0 seconds")
    if config.getoption("kvfuzz_allocator"):
        _require_torch("--kvfuzz-allocator", pytest.UsageError)
        from kvfuzz.engine.config import MachineConfig

        for spec in config.getoption("kvfuzz_allocator"):  # built once before any run, as kvfuzz run does
            try:
                probe_allocator(spec, load_factory(spec), MachineConfig().pool_spec())
            except (AllocatorNotFound, AllocatorUnusable) as error:
                raise pytest.UsageError(str(error)) from None
    for scheduler in config.getoption("kvfuzz_scheduler"):
        _require_torch("--kvfuzz-scheduler", pytest.UsageError)
        from kvfuzz.pytest_scheduler import engine_missing
        from kvfuzz.scheduler.engines import engine_problem

        untested = bool(config.getoption("kvfuzz_untested_engine"))
        missing = engine_missing(scheduler) or engine_problem(
            scheduler, untested, "--kvfuzz-scheduler", "--kvfuzz-untested-engine"
        )
        if missing is not None:
            raise pytest.UsageError(missing)
    database = config.getoption("kvfuzz_database")
    if database:
        _require_torch("--kvfuzz-database", pytest.UsageError)
        from kvfuzz.campaign.cluster import check_redis_url, is_redis

        if is_redis(database):
            if config.getoption("kvfuzz_profile") != "nightly":
                raise pytest.UsageError("--kvfuzz-database redis://... is for the nightly profile's campaign")
            try:
                check_redis_url(database)
            except ValueError as error:
                raise pytest.UsageError(str(error)) from None
    if config.getoption("kvfuzz_seed") is not None and config.getoption("kvfuzz_database"):
        raise pytest.UsageError(
            "--kvfuzz-seed and --kvfuzz-database cannot be combined (Hypothesis ignores the database under a seed)"
        )


def _require_torch(what: str, error: type[Exception]) -> None:
    """Raise ``error``, one line saying what to install, where torch cannot be imported: the plugin imports it only
    for a kvfuzz option or trace that needs it, so an unrelated session never does."""
    problem = torch_unavailable()
    if problem is not None:
        raise error(
            f"kvfuzz: {what} needs torch, which cannot be imported here ({problem}); install it: {INSTALL_TORCH}"
        )


_TRACE_DIRECTORIES = pytest.StashKey[dict[Path, bool]]()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The warning of each ``--kvfuzz-scheduler`` target run on an engine version kvfuzz is not tested on
    (``--kvfuzz-untested-engine``), before any example."""
    if not config.getoption("kvfuzz_scheduler"):
        return []
    from kvfuzz.scheduler.engines import untested_warning

    warnings = (untested_warning(scheduler) for scheduler in dict.fromkeys(config.getoption("kvfuzz_scheduler")))
    return [warning for warning in warnings if warning is not None]


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Optional[pytest.Collector]:
    kind = json_file_kind(file_path)
    if kind == "scheduler-trace":
        return SchedulerTraceFile.from_parent(parent, path=file_path)
    if kind == "trace" or (kind == "undecodable" and _holds_traces(parent.config, file_path.parent)):
        return TraceFile.from_parent(parent, path=file_path)
    return None


def _holds_traces(config: pytest.Config, directory: Path) -> bool:
    """Whether ``directory`` holds a trace file (looked up once per directory and session)."""
    known = config.stash.setdefault(_TRACE_DIRECTORIES, {})
    if directory not in known:
        known[directory] = any(
            json_file_kind(path) in ("trace", "scheduler-trace") for path in directory.glob("*.json")
        )
    return known[directory]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    for spec in config.getoption("kvfuzz_allocator"):
        items.append(MachineItem.from_parent(session, name=f"kvfuzz[{spec}]", spec=spec))
    for scheduler in config.getoption("kvfuzz_scheduler"):
        items.append(SchedulerSearchItem.from_parent(session, name=f"kvfuzz[scheduler:{scheduler}]", spec=scheduler))


class _Replayed(Protocol):
    """What a replay of either kind of trace says to the regression rule."""

    @property
    def failed(self) -> bool: ...

    @property
    def reproduced(self) -> bool: ...

    def describe_failure(self) -> str: ...


def _judge(
    known_bug: Optional[str], replayed: _Replayed, target: str, where: str, path: Path, allocator: Optional[str]
) -> None:
    """A trace's regression rule, for allocator and scheduler traces alike: a trace fails while its recorded failure
    reproduces (or it fails differently: ``where`` it failed, against ``target``); a ``known_bug`` trace passes while
    it reproduces and fails once it stops."""
    if known_bug:
        if not replayed.reproduced:
            raise KvfuzzFailure(
                f"known bug ({printable(known_bug)}) no longer reproduces against {target}: "
                f"{replayed.describe_failure()}\n"
                "If it was fixed, clear known_bug in the trace."
            )
    elif replayed.failed:
        verdict = "still reproduces" if replayed.reproduced else "fails differently"
        raise KvfuzzFailure(
            f"the recorded failure {verdict} {where}:\n{replayed.describe_failure()}\n{replay_hint(path, allocator)}"
        )


class TraceFile(pytest.File):
    def collect(self):
        yield TraceItem.from_parent(self, name=self.path.stem)


class _KvfuzzItem(pytest.Item):
    """A kvfuzz test: its failures are reported as kvfuzz's explanation, without a Python traceback."""

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, KvfuzzFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)


class TraceItem(_KvfuzzItem):
    """One trace, replayed as a regression test."""

    def runtest(self) -> None:
        _require_torch("replaying a trace", KvfuzzFailure)
        from kvfuzz.program.replay import NotApplicable
        from kvfuzz.saved.corpus import allocator_missing, replay_trace
        from kvfuzz.saved.trace import TraceError, TraceUnavailable, load

        try:
            trace = load(self.path)
        except TraceUnavailable as error:
            pytest.skip(str(error))
        except TraceError as error:
            raise KvfuzzFailure(str(error)) from error
        try:
            replayed = replay_trace(
                trace,
                self.config.getoption("kvfuzz_replay_allocator"),
                call_timeout=self.config.getoption("kvfuzz_call_timeout") or None,
                trust=self.config.stash[_TRUST],
            )
        except UntrustedAllocator as error:
            raise KvfuzzFailure(
                f"{error}: list its module in the kvfuzz_trusted_allocators ini setting if it is your project's, "
                "pass --kvfuzz-trust-allocator if you trust where the trace came from, or replay against an "
                "allocator you name (--kvfuzz-replay-allocator SPEC)"
            ) from error
        except AllocatorNotFound as error:
            if not allocator_missing(error):  # it is here, and its import raised or exited
                raise KvfuzzFailure(str(error)) from error
            pytest.skip(f"cannot load the trace's allocator: {error}")
        except NotApplicable as error:
            raise KvfuzzFailure(f"the trace's program does not fit this allocator: {error}") from error
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # building the allocator failed or exited (a pytest.skip is no skip here)
            raised = " ".join(f"{type(error).__name__}: {error}".split())
            raise KvfuzzFailure(f"replay could not start: {raised}") from error
        _judge(
            trace.known_bug, replayed, replayed.allocator, f"against {replayed.allocator}", self.path, trace.allocator
        )

    def reportinfo(self):
        return self.path, None, f"kvfuzz trace {self.name}"


class SchedulerTraceFile(pytest.File):
    def collect(self):
        yield SchedulerTraceItem.from_parent(self, name=self.path.stem)


class SchedulerTraceItem(_KvfuzzItem):
    """One scheduler trace (:mod:`kvfuzz.scheduler.trace`), replayed as a regression test with the allocator
    traces' rules: it fails while the recorded failure reproduces (passes while a ``known_bug`` one does), and is
    skipped, with the reason, where its engine (vLLM, or SGLang for an ``sglang`` trace) is not installed."""

    def runtest(self) -> None:
        _require_torch("replaying a scheduler trace", KvfuzzFailure)
        from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT, Watchdog
        from kvfuzz.scheduler.harness import HarnessError
        from kvfuzz.scheduler.replay import ReplayRefused, replay
        from kvfuzz.scheduler.replay_result import RunnerUnavailable
        from kvfuzz.scheduler.trace import SGLANG, SchedulerTraceError, load
        from kvfuzz.scheduler.vllm_build import vllm_missing

        try:
            trace = load(self.path)
        except SchedulerTraceError as error:
            raise KvfuzzFailure(str(error)) from error
        if trace.scheduler == SGLANG:
            from kvfuzz.scheduler.sglang.build import sglang_missing

            if sglang_missing():
                pytest.skip(f"a {trace.scheduler} trace needs sglang {trace.vllm_version}, which is not installed here")
        elif vllm_missing():
            pytest.skip(f"a {trace.scheduler} trace needs vllm {trace.vllm_version}, which is not installed here")
        try:
            with Watchdog(DEFAULT_CALL_TIMEOUT) as watchdog:  # a trace of a hang fails its hang check, never hangs
                replayed = replay(trace, watchdog=watchdog)
        except RunnerUnavailable as error:  # as a trace whose engine is not installed: not replayable here
            pytest.skip(str(error))
        except ReplayRefused as error:
            raise KvfuzzFailure(f"the trace cannot be replayed here: {error}") from error
        except HarnessError as error:  # kvfuzz's own code failed: said as such, never as the trace's failure
            raise KvfuzzFailure(error.describe()) from None
        _judge(
            trace.known_bug, replayed, trace.scheduler, f"at {replayed.where()} of {trace.scheduler}", self.path, None
        )

    def reportinfo(self):
        return self.path, None, f"kvfuzz scheduler trace {self.name}"


class MachineItem(_KvfuzzItem):
    """kvfuzz's machine run against one allocator."""

    def __init__(self, *, spec: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec

    def runtest(self) -> None:
        from hypothesis.database import DirectoryBasedExampleDatabase

        from kvfuzz.engine.config import MachineConfig
        from kvfuzz.isolated_run import Died, RunRequest, Stopped, run_isolated
        from kvfuzz.kernels import KernelUnavailable, make_kernel, prepare_kernel
        from kvfuzz.profiles import PROFILES
        from kvfuzz.runner import run
        from kvfuzz.saved.corpus import save_trace, trace_of
        from kvfuzz.statemachines.machine import machine_for

        option = self.config.getoption
        if option("kvfuzz_profile") == "nightly":
            self._campaign()
            return
        config = MachineConfig(kernel=option("kvfuzz_kernel"))
        try:
            prepare_kernel(config.kernel, config.shape)  # before the allocator's package, and so its engine, loads
            factory = load_factory(self.spec)
            probe = probe_allocator(self.spec, factory, config.pool_spec())  # never driven: checked before work
            make_kernel(config.kernel, probe, config.shape)
        except (AllocatorNotFound, AllocatorUnusable, KernelUnavailable) as error:
            raise KvfuzzFailure(str(error)) from error
        profile = PROFILES[option("kvfuzz_profile")]
        corpus = Path(option("kvfuzz_corpus"))
        recovered = _recover(corpus)
        examples = option("kvfuzz_examples") or profile.max_examples
        steps = option("kvfuzz_steps") or profile.stateful_step_count
        journal_dir = corpus if recovered is not None else None
        if option("kvfuzz_isolate"):
            outcome = run_isolated(
                RunRequest(
                    self.spec,
                    config,
                    examples,
                    steps,
                    seed=option("kvfuzz_seed"),
                    derandomize=profile.derandomize,
                    database=option("kvfuzz_database"),
                    call_timeout=option("kvfuzz_call_timeout") or None,
                    journal_dir=journal_dir,
                )
            )
            if isinstance(outcome, Stopped):
                raise KeyboardInterrupt  # the user's Ctrl-C before the child had a result: pytest stops the session
            if isinstance(outcome, Died):
                machine = machine_for(factory, outcome.trace.config).__name__ if outcome.trace is not None else ""
                raise KvfuzzFailure(outcome.describe(machine))
            summary, failed = outcome.summary, outcome.trace
        else:
            database = DirectoryBasedExampleDatabase(option("kvfuzz_database")) if option("kvfuzz_database") else None
            summary = run(
                factory,
                config,
                examples=examples,
                steps=steps,
                seed=option("kvfuzz_seed"),
                derandomize=profile.derandomize,
                allocator_name=self.spec,
                database=database,
                call_timeout=option("kvfuzz_call_timeout") or None,
                journal_dir=journal_dir,
            )
            failed = trace_of(summary, self.spec, config)
        if not summary.failed:
            if summary.interrupted:
                raise KeyboardInterrupt  # the user's Ctrl-C, and no failure to report: pytest stops the session
            if recovered:
                raise KvfuzzFailure("\n".join(recovered))  # a run that died left a failure behind: now a trace
            return
        saved = save_trace(failed, corpus) if failed is not None else None
        if saved is None:
            trace = ""
        elif saved.error is None:
            trace = f"\ntrace: {saved.path} ({replay_hint(saved.path, self.spec)})"
        else:
            trace = f"\n\n{saved.report()}"  # the corpus could not be written: the whole trace, so it is not lost
        notes = [note for note in (summary.shrink_note,) if note]
        if summary.flaky:
            notes.append(f"FLAKY: reproduced in {summary.reproduced} of {summary.replays} replays")
        if summary.interrupted:
            notes.append("interrupted by the user: the failure found so far")
            self.session.shouldstop = "kvfuzz: interrupted by the user"
        notes += recovered or []
        raise KvfuzzFailure(
            f"{summary.invariant}\n\nshrunk program ({summary.program_length} operations):\n"
            f"{summary.program}\n\n{summary.explanation}{trace}" + "".join(f"\n({note})" for note in notes)
        )

    def _campaign(self) -> None:
        """The nightly profile: a campaign; fails with the table of new distinct failures."""
        from kvfuzz.campaign.lock import CorpusInUse
        from kvfuzz.campaign.report import table
        from kvfuzz.campaign.supervisor import CampaignOptions, run_campaign
        from kvfuzz.campaign.swarm import probe_limits
        from kvfuzz.engine.config import MachineConfig

        option = self.config.getoption
        base = MachineConfig(kernel=option("kvfuzz_kernel"))
        try:
            limits = probe_limits(self.spec, load_factory(self.spec), base)
        except (AllocatorNotFound, AllocatorUnusable) as error:
            raise KvfuzzFailure(str(error)) from error
        corpus = Path(option("kvfuzz_corpus"))
        try:
            result = run_campaign(
                CampaignOptions(
                    (self.spec,),
                    (limits,),
                    option("kvfuzz_workers") or os.cpu_count() or 1,
                    corpus,
                    duration=option("kvfuzz_duration"),
                    known=(corpus,),
                    database=option("kvfuzz_database"),
                    seed=option("kvfuzz_seed") if option("kvfuzz_seed") is not None else random.randrange(2**32),
                    call_timeout=option("kvfuzz_call_timeout") or None,
                    base=base,
                )
            )
        except CorpusInUse as error:  # another campaign holds the corpus: one line, nothing run
            raise KvfuzzFailure(str(error)) from None
        if result.ended_by == "interrupted":
            self.session.shouldstop = "kvfuzz: interrupted by the user"
        if result.new or result.errors:
            raise KvfuzzFailure("\n".join(table(result)))

    def reportinfo(self):
        return self.path, None, self.name


class SchedulerSearchItem(_KvfuzzItem):
    """kvfuzz's search of one scheduler target (:mod:`kvfuzz.pytest_scheduler`)."""

    def __init__(self, *, spec: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec  # the scheduler target's name

    def runtest(self) -> None:
        from kvfuzz.profiles import PROFILES
        from kvfuzz.pytest_scheduler import SchedulerSearch, campaign_scheduler, search_scheduler

        option = self.config.getoption
        corpus = Path(option("kvfuzz_corpus"))
        if option("kvfuzz_profile") == "nightly":
            failure = campaign_scheduler(
                self.spec, corpus, option("kvfuzz_duration"), option("kvfuzz_seed"), option("kvfuzz_database")
            )
        else:
            profile = PROFILES[option("kvfuzz_profile")]
            seed = option("kvfuzz_seed")
            if seed is None and not profile.derandomize:
                seed = random.randrange(2**32)
            search = SchedulerSearch(
                self.spec,
                option("kvfuzz_examples") or profile.max_examples,
                option("kvfuzz_steps") or profile.stateful_step_count,
                seed,
                corpus,
                option("kvfuzz_call_timeout") or None,
            )
            failure = search_scheduler(search)
        if failure is not None:
            raise KvfuzzFailure(failure)

    def reportinfo(self):
        return self.path, None, self.name


def _recover(corpus: Path) -> Optional[list[str]]:
    """Turn the journals of runs that died into traces; the messages, or None if the corpus cannot hold a
    journal (the run then keeps none)."""
    from kvfuzz.saved import journals

    try:
        corpus.mkdir(parents=True, exist_ok=True)
        return [recovered.message for recovered in journals.recover(corpus)]
    except OSError:
        return None
