"""Replaying a scheduler trace without Hypothesis: the recorded configuration rebuilt (the model runner protocol
selected as recorded), the client's operations performed in order, then the drain, every check on; the failure that
happens is compared with the recorded one."""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

from kvfuzz.program.safeguards import Watchdog
from kvfuzz.scheduler.engines import installed_version
from kvfuzz.scheduler.harness import raise_if_kvfuzz_s
from kvfuzz.scheduler.program import Operation
from kvfuzz.scheduler.replay_result import ReplayRefused, RunnerUnavailable, SchedulerReplay, replay_program
from kvfuzz.scheduler.session import Session, WorkerFactory
from kvfuzz.scheduler.snapshot import NO_OBSERVER, StepObserver
from kvfuzz.scheduler.trace import SGLANG, SchedulerTrace
from kvfuzz.scheduler.worker import Worker
from kvfuzz.scheduler.write_paths import WRITE_PATHS, prepare_write_path

RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
"""The environment variable vLLM 0.33.0 selects its model runner by (read each time its configuration is asked)."""


@contextlib.contextmanager
def model_runner(name: str) -> Iterator[None]:
    """vLLM's ``name`` model runner (``V1`` or ``V2``) selected while the block runs, the environment restored
    after."""
    before = os.environ.get(RUNNER_VARIABLE)
    os.environ[RUNNER_VARIABLE] = "1" if name == "V2" else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[RUNNER_VARIABLE]
        else:
            os.environ[RUNNER_VARIABLE] = before


def missing_vllm(trace: SchedulerTrace) -> str:
    """Why ``trace`` cannot be replayed where vLLM is not installed, and what to do about it."""
    return (
        f"a {trace.scheduler} trace needs vllm {trace.vllm_version}, which is not installed here; build its "
        "environment with scripts/third_party_env.sh vllm"
    )


def recorded_worker(trace: SchedulerTrace) -> WorkerFactory:
    """The worker the trace was recorded with: its write path and attention check. Raises :class:`ReplayRefused`
    when they cannot run here (Triton's interpreter must be chosen before vLLM is imported)."""
    try:
        prepare_write_path(trace.write_path)
        if trace.attention == "vllm-triton":
            from kvfuzz.kernels.vllm_triton import prepare
            from kvfuzz.scheduler.config import MODEL_SHAPE

            prepare(MODEL_SHAPE)
    except ValueError as error:
        raise ReplayRefused(
            f"the trace was recorded with write path {trace.write_path} and attention {trace.attention}, which "
            f"cannot run here: {' '.join(str(error).split())}"
        ) from None
    from kvfuzz.scheduler.attention import ATTENTIONS

    write_path, attention = WRITE_PATHS[trace.write_path], ATTENTIONS[trace.attention]
    return lambda setup: Worker(setup, write_path, attention(setup.block_size))


def replay(
    trace: SchedulerTrace,
    worker: Optional[WorkerFactory] = None,
    on_operation: Optional[Callable[[int, Operation], None]] = None,
    watchdog: Optional[Watchdog] = None,
    observer: StepObserver = NO_OBSERVER,
) -> SchedulerReplay:
    """Replay ``trace`` against the installed vLLM, with ``worker`` (by default the one the trace was recorded
    with: :func:`recorded_worker`), each step bounded by ``watchdog`` (entered by the caller) when one is given and
    told to ``observer`` as soon as it is scheduled.
    Raises :class:`ReplayRefused` when vLLM is not installed, its configuration refuses the trace's, the recorded
    model runner cannot be selected here, or the recorded worker cannot run."""
    if trace.scheduler == SGLANG:  # SGLang's scheduling pieces: no worker or model runner to choose
        from kvfuzz.scheduler.sglang.traces import replay_sglang

        return replay_sglang(trace, on_operation, watchdog, observer)
    from kvfuzz.scheduler.vllm_build import vllm_missing

    if vllm_missing():
        raise ReplayRefused(missing_vllm(trace))
    if worker is None:
        worker = recorded_worker(trace)
    with model_runner(trace.model_runner):
        try:
            session = Session(trace.setup, worker, watchdog)
        except ValueError as error:
            reason = " ".join(str(error).split())
            raise ReplayRefused(
                f"vLLM refuses the trace's configuration ({trace.setup.describe()}): {reason}"
            ) from None
        except Exception as error:  # noqa: BLE001 -- kvfuzz's own failure leaves as a harness error, vLLM's as itself
            raise_if_kvfuzz_s(error, lambda: f"vLLM {installed_version('vllm')}")
            raise
        here = "V2" if session.worker.runner_v2 else "V1"
        if here != trace.model_runner:
            refused = RunnerUnavailable if not session.worker.release.has_v1_runner else ReplayRefused
            raise refused(
                f"the trace was recorded with vLLM's {trace.model_runner} model runner, and this vLLM selects {here}"
            )
        session.observer = observer
        return replay_program(session, trace, on_operation)


def bounded_replay(trace: SchedulerTrace, call_timeout: Optional[float]) -> SchedulerReplay:
    """Replay ``trace`` against its engine (vLLM's or SGLang's), each step bounded by a watchdog of ``call_timeout``
    seconds (None: unbounded)."""
    if call_timeout is None:
        return replay(trace)
    with Watchdog(call_timeout) as watchdog:
        return replay(trace, watchdog=watchdog)
