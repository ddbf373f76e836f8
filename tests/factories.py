"""Factories for kvfuzz's correct allocator in the configurations the tests drive, and small variants of it.

Below them, the helpers of the allocator unit tests (test_paged_allocator.py, test_prefix_cache.py, ...): ``make``
builds the allocator itself, and the snapshot helpers take the observable state so that refusals can be shown
to change nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import attrs

from kvfuzz.allocator import BlockCopy, InvalidArgument, PagedAllocator, PoolSpec, UnknownSequence
from kvfuzz.scheduler import swarm
from kvfuzz.swarm_table import Dimension, fixed, weighted_choice
from kvfuzz.zoo.variants import NoCopyOnWrite


def make_allocator(window: int = 0, prefix_caching: bool = True, introspection: bool = True, reserved_blocks: int = 0):
    """A factory for kvfuzz's correct allocator with the given options."""

    def factory(spec: PoolSpec) -> PagedAllocator:
        allocator = PagedAllocator(
            spec.block_size,
            spec.num_blocks,
            spec.num_host_blocks,
            inflight_window=window,
            prefix_caching=prefix_caching,
            reserved_blocks=reserved_blocks,
        )
        if not introspection:
            allocator.capabilities = attrs.evolve(allocator.capabilities, introspection=False)
        return allocator

    factory.__name__ = f"paged_w{window}{'' if prefix_caching else '_nocache'}{'' if introspection else '_opaque'}"
    return factory


def declaring(cls: type, window: int = 0, **capabilities: object):
    """A factory for ``cls`` (kvfuzz's allocator or a variant of it) declaring ``capabilities`` on top of its own."""

    def factory(spec: PoolSpec) -> PagedAllocator:
        allocator = cls(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=window)
        allocator.capabilities = attrs.evolve(allocator.capabilities, **capabilities)
        return allocator

    factory.__name__ = f"{cls.__name__}_{'_'.join(f'{k}_{v}' for k, v in capabilities.items())}"
    return factory


def lookahead_with_drafts(spec: PoolSpec) -> PagedAllocator:
    """kvfuzz's allocator with one look-ahead block and W = 1, declaring that only the last two tokens of a grow are
    drafts a rollback may drop (``speculative_tokens``)."""
    allocator = PagedAllocator(
        spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=1, lookahead_blocks=1
    )
    allocator.capabilities = attrs.evolve(allocator.capabilities, speculative_tokens=2)
    return allocator


class CopyTailOnFork(PagedAllocator):
    """A correct allocator whose fork copies the parent's partial last block instead of sharing it."""

    def fork(self, parent, child):
        partial = len(self._running(parent, "fork").tokens) % self.block_size != 0
        if partial:
            self._check_room(1)
        super().fork(parent, child)
        if not partial:
            return None
        state = self._seqs[child]
        tail = state.table[-1]
        (fresh,) = self._pool.allocate(1)
        self._pool.release(tail)
        state.table[-1] = fresh
        return [BlockCopy(tail, fresh)]


class NoCopyOnWriteCopy(NoCopyOnWrite):
    """The zoo's NoCopyOnWrite slip in a class of its own: the same failures, from other code (for the campaign's
    known findings, which carry over only to allocators of the trace's class)."""


no_copy_on_write_deferred_free = declaring(NoCopyOnWrite, window=2)
"""The zoo's NoCopyOnWrite (its class, its slip) in another configuration: W = 2 where the zoo's builds W = 1."""

no_copy_on_write_copy = declaring(NoCopyOnWriteCopy, window=1)
"""The same slip as the zoo's NoCopyOnWrite and its configuration, in another class."""


def even_pools_only(spec: PoolSpec) -> PagedAllocator:
    """kvfuzz's correct allocator, for pools of an even number of blocks only (as HF transformers' allocator with
    sectors of two blocks): any other pool is refused when it is built."""
    if spec.num_blocks % 2:
        raise ValueError(f"{spec.num_blocks} blocks do not fill sectors of 2 blocks")
    return PagedAllocator(spec.block_size, spec.num_blocks, spec.num_host_blocks)


# -- the allocator unit tests: the allocator built directly, and tokens ------------------------------------------

B = 4  # block size of every allocator in the allocator unit tests unless a test says otherwise


def make(
    num_blocks: int = 8,
    *,
    window: int = 0,
    host: int = 0,
    block_size: int = B,
    prefix_caching: bool = True,
    reserved: int = 0,
) -> PagedAllocator:
    """kvfuzz's correct allocator itself (not a factory for it), with blocks of ``B`` tokens unless told otherwise."""
    return PagedAllocator(
        block_size, num_blocks, host, inflight_window=window, prefix_caching=prefix_caching, reserved_blocks=reserved
    )


def toks(start: int, count: int) -> tuple[int, ...]:
    """``count`` distinct tokens starting at ``start``."""
    return tuple(range(start, start + count))


# -- helpers: snapshots and the counts identity ------------------------------------------------------------------


def table_or_state(a: PagedAllocator, seq: str):
    try:
        return tuple(a.block_table(seq))
    except UnknownSequence:
        return "unknown"
    except InvalidArgument:
        return "swapped"


def snapshot(a: PagedAllocator, seqs=()) -> dict:
    """Everything observable about the device pool, and the tables (or state) of ``seqs``."""
    return {
        "free": sorted(a.free_blocks()),
        "cached": sorted(a.cached_blocks()),
        "pending": sorted(a.pending_blocks()),
        "refcounts": [a.refcount(b) for b in range(a.num_blocks)],
        "tables": {seq: table_or_state(a, seq) for seq in seqs},
    }


def cached_tokens(a: PagedAllocator, namespace, tokens) -> int:
    """How many leading tokens of ``tokens`` the prefix cache matches now (``a`` is untouched). Asked of the cache
    rather than through ``admit``, which never reports a whole prompt cached and may lack room to admit."""
    key = a._key_namespace(tuple(namespace))
    tokens = tuple(tokens)
    return len(a._match(key, tokens, a._full_block_hashes(key, tokens, []))) * a.block_size


def check_counts(a: PagedAllocator, running: dict[str, int] | None = None) -> None:
    """free + cached + pending + referenced == num_blocks, the sets disjoint and duplicate-free.

    ``running`` maps each running sequence to its token count; if given, refcounts must equal the number of
    block-table entries naming each block, and each table must hold ceil(n / block_size) blocks.
    """
    free, cached, pending = list(a.free_blocks()), list(a.cached_blocks()), list(a.pending_blocks())
    referenced = [b for b in range(a.num_blocks) if a.refcount(b) > 0]
    assert len(set(free)) == len(free) and len(set(cached)) == len(cached) and len(set(pending)) == len(pending)
    assert all(a.refcount(b) >= 0 for b in range(a.num_blocks))
    groups = [set(free), set(cached), set(pending), set(referenced)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not groups[i] & groups[j], f"block sets {i} and {j} overlap: {groups[i] & groups[j]}"
    assert len(free) + len(cached) + len(pending) + len(referenced) == a.num_blocks
    if running is not None:
        uses = [0] * a.num_blocks
        for seq, length in running.items():
            table = a.block_table(seq)
            assert len(table) == -(-length // a.block_size)
            for block in table:
                uses[block] += 1
        assert uses == [a.refcount(b) for b in range(a.num_blocks)]


def kvfuzz(*args: str, cwd: Path, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run the ``kvfuzz`` command line in a child process in ``cwd`` (where a failing run leaves its trace, in
    ``corpus/`` unless ``--corpus`` says otherwise); ``kwargs`` go to ``subprocess.run``.

    The child is forked from the session's warm parent (tests/cli_zygote.py, which has imported torch and kvfuzz once
    in the caller's environment) unless a keyword argument other than ``timeout`` asks for more than a captured run;
    then it is ``python -W ignore -m kvfuzz.cli ARGS``, started anew."""
    timeout = kwargs.pop("timeout", 300)
    if not kwargs:
        return _ZYGOTE.started_in(os.environ).run(list(args), cwd, timeout)
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        **kwargs,
    )


# Set by pytest for each test; a fresh child would see the running test's value, the zygote's child is given it.
_PER_TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


class _Zygote:
    """The session's warm parent for command-line children (tests/cli_zygote.py).

    Invariant: ``process``, once started, was started in ``environ`` (the caller's environment without
    ``_PER_TEST_VARIABLES``), so that what its children read at import is what a fresh interpreter would read."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.environ: dict[str, str] = {}

    def started_in(self, environ: Mapping[str, str]) -> _Zygote:
        """This parent, (re)started first if it is not running or was started in another environment."""
        wanted = _without_per_test(environ)
        if self.process is not None and (self.process.poll() is not None or wanted != self.environ):
            _stop(self.process)
            self.process = None
        if self.process is None:
            self.environ = wanted
            self.process = subprocess.Popen(
                [sys.executable, "-W", "ignore", str(Path(__file__).with_name("cli_zygote.py"))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,  # unbuffered: a line read leaves the next in the pipe, where select() sees it
                env=dict(environ),
            )
            atexit.register(_stop, self.process)
        return self

    def run(self, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        with tempfile.TemporaryDirectory() as scratch:
            stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {
                "args": args,
                "cwd": str(cwd),
                "environ": dict(os.environ),
                "stdout": str(stdout),
                "stderr": str(stderr),
            }
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            pid = int(self.process.stdout.readline())
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                os.kill(pid, signal.SIGKILL)
            status = int(self.process.stdout.readline())
            command = [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", *args]
            out, err = stdout.read_text(), stderr.read_text()
            if not ready:
                raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
            return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), out, err)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a warm parent and reap it (its children's CPU time then counts in the test session's)."""
    process.kill()
    process.wait()


def _without_per_test(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if name not in _PER_TEST_VARIABLES}


_ZYGOTE = _Zygote()


def async_worker(
    tables: dict[str, list[int]],
    computed: dict[str, int],
    live: tuple[str, ...],
    preempted: tuple[str, ...] = (),
    states: Optional[dict[str, int]] = None,
) -> Any:
    """A scheduler worker as far as the released-block check reads it: block size 4, one full-attention group, each
    request's table, its computed tokens, and the blocks the ``live`` requests hold. With ``states``, a Mamba group
    (``none`` mode) beside it, group 1: each request's state block."""
    from kvfuzz.scheduler.groups import GroupRule
    from kvfuzz.scheduler.mamba_states import mamba_states

    requests = {
        request: types.SimpleNamespace(
            tables=[table] + ([[states[request]]] if states else []),
            preempted=request in preempted,
            prompt_length=0,  # full attention reads every position whatever the prompt
        )
        for request, table in tables.items()
    }
    return types.SimpleNamespace(
        block_size=4,
        requests=requests,
        groups=(GroupRule(0, None),),
        mamba=mamba_states((1,) if states else (), "none", 4),
        computed=computed,
        holdings=lambda: (
            {request: tables[request] + ([states[request]] if states else []) for request in live},
            {},
        ),
    )


FIRST_MODEL_ROW = Dimension(
    "model", ("full", "sliding-window", "mamba-hybrid", "chunked-local"), weighted_choice((2, 1, 1, 1)), stratified=True
)
"""The scheduler swarm's model row before the sliding-window-groups model joined it."""


def swarm_as_seeded(later_rows: tuple[str, ...]) -> tuple[Dimension, ...]:
    """vLLM's swarm table as a test's seeds were chosen against it: each row of ``later_rows`` (added since) held at
    its first value without drawing, and the model row with the models it had then, so that a seed draws the
    configurations it drew then (a new row's draw, or a new value's, would move every later draw)."""
    return tuple(
        FIRST_MODEL_ROW
        if row.name == "model"
        else Dimension(row.name, row.domain, fixed)
        if row.name in later_rows
        else row
        for row in swarm.DIMENSIONS
    )
