"""Hostile allocators: kvfuzz's own allocator, each with one way a real allocator under development misbehaves
(a wrong return type, an escaping BaseException, a hang, a segfault, nondeterminism). The tests in
test_hostile_allocators.py check that kvfuzz reports each as a real, saved, replayable failure, and never loses it or
invents one. Each factory is importable as ``tests.hostile:NAME`` from the repository root."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import sys
import time
from os import _exit as exit_now  # taken at import, before any run: an interception set up later would miss it
from typing import Any

from kvfuzz.allocator import PagedAllocator
from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.types import AdmitResult, GrowResult, PoolSpec


def _build(cls: type[PagedAllocator], spec: PoolSpec) -> PagedAllocator:
    return cls(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=1)


class _NoneWhenFull(PagedAllocator):
    """vLLM's ``allocate_slots`` convention: None instead of raising OutOfBlocks."""

    def admit(self, seq: str, namespace: tuple[str, ...], tokens: tuple[int, ...]) -> Any:
        try:
            return super().admit(seq, namespace, tokens)
        except OutOfBlocks:
            return None


class _ExitsOnFork(PagedAllocator):
    def fork(self, parent: str, child: str) -> None:
        sys.exit(0)


class _SkipsOnPreempt(PagedAllocator):
    def preempt(self, seq: str) -> None:
        import pytest

        pytest.skip("the allocator called pytest.skip")


class _InterruptsOnRollback(PagedAllocator):
    def rollback(self, seq: str, num_tokens: int) -> None:
        raise KeyboardInterrupt  # not the user's: nobody pressed Ctrl-C


class _HangsOnRollback(PagedAllocator):
    def rollback(self, seq: str, num_tokens: int) -> None:
        while True:
            time.sleep(0.01)


class _HangsFreeingAForkedParent(PagedAllocator):
    """Hangs in ``free`` of a sequence that was forked and then rolled back (a wait on a child's release that never
    comes): only a program that admits, forks, rolls the parent back and frees it hangs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forked: set[str] = set()  # parents forked since their admission
        self._rolled_back: set[str] = set()  # forked parents rolled back since

    def fork(self, parent: str, child: str) -> None:
        super().fork(parent, child)
        self._forked.add(parent)

    def rollback(self, seq: str, num_tokens: int) -> None:
        super().rollback(seq, num_tokens)
        if seq in self._forked:
            self._rolled_back.add(seq)

    def free(self, seq: str) -> None:
        while seq in self._rolled_back:
            time.sleep(0.01)
        self._forked.discard(seq)
        super().free(seq)


def hangs_freeing_a_forked_parent(spec: PoolSpec) -> PagedAllocator:
    return _build(_HangsFreeingAForkedParent, spec)


class _SwallowsInterrupts(PagedAllocator):
    """Hangs in rollback and catches whatever interrupts it (a bare ``except:`` around a retry loop)."""

    def rollback(self, seq: str, num_tokens: int) -> None:
        started = time.monotonic()
        while time.monotonic() - started < 3:
            try:
                time.sleep(0.01)
            except BaseException:  # noqa: B036 -- the slip under test
                pass
        super().rollback(seq, num_tokens)


def swallows_interrupts(spec: PoolSpec) -> PagedAllocator:
    return _build(_SwallowsInterrupts, spec)


class _SegfaultsOnRollback(PagedAllocator):
    def rollback(self, seq: str, num_tokens: int) -> None:
        ctypes.string_at(0)  # reads address 0: SIGSEGV


class _ExitsCleanlyOnRollback(PagedAllocator):
    def rollback(self, seq: str, num_tokens: int) -> None:
        os._exit(0)  # ends the process at once, status 0: no exception, no atexit, no finally


class _ExitsThroughItsOwnReferenceOnRollback(PagedAllocator):
    def rollback(self, seq: str, num_tokens: int) -> None:
        exit_now(0)  # os._exit(0), through the reference this module took when it was imported


class _ExitsInCOnRollback(PagedAllocator):
    def rollback(self, seq: str, num_tokens: int) -> None:
        ctypes.CDLL(None).exit(0)  # the C library's exit(0): beyond Python's reach


class _IgnoresSignalsAndSleeps(PagedAllocator):
    """Ignores SIGTERM and SIGINT from its construction on, and sleeps in its third admit (a hang no stop reaches)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.admits = 0

    def admit(self, seq: str, namespace: tuple[str, ...], tokens: tuple[int, ...]) -> AdmitResult:
        self.admits += 1
        if self.admits == 3:
            while True:
                time.sleep(1)
        return super().admit(seq, namespace, tokens)


HUNG_FOR: list[float] = []
"""Seconds each hang of :func:`hangs_on_20th_change` lasted before kvfuzz stopped it, in order."""


class _HangsOnItsNthChange(PagedAllocator):
    """Never returns from its 20th state-changing call (admit, grow, fork, free, preempt, rollback), as an
    allocator whose queue fills after so many calls: the hang needs that many calls before it, so the programs
    shrinking keeps are long, and every candidate that keeps the hang costs the limit it is stopped at. Each hang's
    length goes to :data:`HUNG_FOR`."""

    hang_at = 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.changes = 0

    def _change(self) -> None:
        self.changes += 1
        if self.changes == self.hang_at:
            started = time.monotonic()
            try:
                while True:
                    time.sleep(0.01)
            finally:
                HUNG_FOR.append(time.monotonic() - started)

    def admit(self, seq: str, namespace: tuple[str, ...], tokens: tuple[int, ...]) -> AdmitResult:
        self._change()
        return super().admit(seq, namespace, tokens)

    def grow(self, seq: str, tokens: tuple[int, ...]) -> GrowResult:
        self._change()
        return super().grow(seq, tokens)

    def fork(self, parent: str, child: str) -> None:
        self._change()
        super().fork(parent, child)

    def free(self, seq: str) -> None:
        self._change()
        super().free(seq)

    def preempt(self, seq: str) -> None:
        self._change()
        super().preempt(seq)

    def rollback(self, seq: str, num_tokens: int) -> None:
        self._change()
        super().rollback(seq, num_tokens)


class _LeaksAndSegfaultsInSmallPools(PagedAllocator):
    """Leaks a freed sequence's blocks (an invariant, in any pool) and kills the process admitting into a pool of
    fewer than 4 blocks: a shrinker trying a smaller pool dies there."""

    def admit(self, seq: str, namespace: tuple[str, ...], tokens: tuple[int, ...]) -> AdmitResult:
        if self.num_blocks < 4:
            ctypes.string_at(0)
        return super().admit(seq, namespace, tokens)

    def free(self, seq: str) -> None:
        self._seqs.pop(seq)  # its blocks stay referenced


class _SometimesLeaks(PagedAllocator):
    """Leaks a preempted sequence's table entry half the time (a race, as far as kvfuzz can tell)."""

    def preempt(self, seq: str) -> None:
        if random.random() < 0.5:
            state = self._seqs.pop(seq)
            del state  # its blocks stay referenced: invariant 3/4 or 10
            return
        super().preempt(seq)


class _SlowFreeLeak(PagedAllocator):
    """Leaks on free (found at once) and is slow, so shrinking it takes long enough to be interrupted."""

    def free(self, seq: str) -> None:
        time.sleep(float(os.environ.get("KVFUZZ_TEST_SLOW", "0.002")))
        self._seqs.pop(seq)


class _SlowAdmitFreeLeak(PagedAllocator):
    """Slow to admit, and leaks on free only while three sequences are live: every program that fails admits at
    least three times, so each replay while shrinking costs seconds."""

    def admit(self, seq: str, namespace: tuple[str, ...], tokens: tuple[int, ...]) -> AdmitResult:
        time.sleep(float(os.environ.get("KVFUZZ_TEST_SLOW", "0.002")))
        return super().admit(seq, namespace, tokens)

    def free(self, seq: str) -> None:
        if len(self._seqs) >= 3:
            self._seqs.pop(seq)
        else:
            super().free(seq)


def slow_admit_free_leak(spec: PoolSpec) -> PagedAllocator:
    return _build(_SlowAdmitFreeLeak, spec)


def none_when_full(spec: PoolSpec) -> PagedAllocator:
    return _build(_NoneWhenFull, spec)


def exits_on_fork(spec: PoolSpec) -> PagedAllocator:
    return _build(_ExitsOnFork, spec)


def skips_on_preempt(spec: PoolSpec) -> PagedAllocator:
    return _build(_SkipsOnPreempt, spec)


def interrupts_on_rollback(spec: PoolSpec) -> PagedAllocator:
    return _build(_InterruptsOnRollback, spec)


def hangs_on_rollback(spec: PoolSpec) -> PagedAllocator:
    return _build(_HangsOnRollback, spec)


def segfaults_on_rollback(spec: PoolSpec) -> PagedAllocator:
    return _build(_SegfaultsOnRollback, spec)


def exits_cleanly_on_rollback(spec: PoolSpec) -> PagedAllocator:
    return _build(_ExitsCleanlyOnRollback, spec)


def exits_through_its_own_reference_on_rollback(spec: PoolSpec) -> PagedAllocator:
    return _build(_ExitsThroughItsOwnReferenceOnRollback, spec)


def exits_in_c_on_rollback(spec: PoolSpec) -> PagedAllocator:
    return _build(_ExitsInCOnRollback, spec)


def ignores_signals_and_sleeps(spec: PoolSpec) -> PagedAllocator:
    return _build(_IgnoresSignalsAndSleeps, spec)


def hangs_on_20th_change(spec: PoolSpec) -> PagedAllocator:
    return _build(_HangsOnItsNthChange, spec)


def leaks_and_segfaults_in_small_pools(spec: PoolSpec) -> PagedAllocator:
    return _build(_LeaksAndSegfaultsInSmallPools, spec)


def sometimes_leaks(spec: PoolSpec) -> PagedAllocator:
    return _build(_SometimesLeaks, spec)


def slow_free_leak(spec: PoolSpec) -> PagedAllocator:
    return _build(_SlowFreeLeak, spec)


def returns_admit_result_of_strings(spec: PoolSpec) -> PagedAllocator:
    class _Strings(PagedAllocator):
        def admit(self, seq: str, namespace: tuple[str, ...], tokens: tuple[int, ...]) -> AdmitResult:
            result = super().admit(seq, namespace, tokens)
            return AdmitResult([str(block) for block in result.block_table], result.num_cached_tokens)  # type: ignore[misc]

    return _build(_Strings, spec)


class _GeneratorExitOnFork(PagedAllocator):
    def fork(self, parent: str, child: str) -> None:
        raise GeneratorExit  # no generator is being closed: the allocator's own BaseException


def generator_exit_on_fork(spec: PoolSpec) -> PagedAllocator:
    return _build(_GeneratorExitOnFork, spec)
