"""The Hypothesis state machine: small declarative rules that drive an allocator through the life of many requests.

Each rule draws its arguments, then hands them to the :class:`Harness`, which calls the allocator, plays the engine
and checks every invariant on what changed. Rules are enabled by preconditions on the harness's state and on the
capabilities the allocator declares, so a printed failing program is a plain list of calls a person can paste into
a test.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvfuzz.allocator.protocol import AllocatorProtocol
from kvfuzz.allocator.types import PoolSpec
from kvfuzz.statemachines import strategies
from kvfuzz.statemachines.config import MachineConfig
from kvfuzz.statemachines.harness import Harness
from kvfuzz.statemachines.misuse import misuse_calls
from kvfuzz.statemachines.model import Status
from kvfuzz.statemachines.program import Call
from kvfuzz.statemachines.stats import RunStats

AllocatorFactory = Callable[[PoolSpec], AllocatorProtocol]
F = TypeVar("F", bound=Callable[..., None])


def counted(function: F) -> F:
    """Record the call, count the step in the run's stats, and note a failure with its program."""

    @functools.wraps(function)
    def wrapper(self: "KVCacheMachine", **kwargs: object) -> None:
        self.calls.append(Call(function.__name__, kwargs))
        if self.stats is not None:
            self.stats.count_step()
        try:
            return function(self, **kwargs)
        except Exception:
            self.failed = True
            if self.stats is not None:
                self.stats.failed(self.calls)
            raise

    return wrapper  # type: ignore[return-value]


def _pick(ids: Callable[[Harness], list[str]]) -> st.SearchStrategy[str]:
    return st.runner().flatmap(lambda machine: st.sampled_from(ids(machine.harness)))


def _running(h: Harness) -> list[str]:
    return h.ids(Status.RUNNING)


def _computed(h: Harness) -> list[str]:
    return h.computed_ids()


def _preemptible(h: Harness) -> list[str]:
    return h.ids(Status.RUNNING) if h.caps.preempt_scheduled else h.computed_ids()


def _rollbackable(h: Harness) -> list[str]:
    return [seq for seq in h.ids(Status.RUNNING) if h.rollback_limit(seq) >= 1]


class KVCacheMachine(RuleBasedStateMachine):
    """Drives ``factory(config.pool_spec())`` through admit, grow, fork, free, preempt, swap, rollback and evict."""

    factory: AllocatorFactory
    config: MachineConfig = MachineConfig()
    stats: Optional[RunStats] = None

    def __init__(self) -> None:
        super().__init__()
        operations = self.stats.operations if self.stats is not None else None
        self.harness = Harness(
            self.factory(self.config.pool_spec()),
            self.config,
            operations,
            on_step=self.stats.occupancy.record if self.stats is not None else None,
        )
        self.caps = self.harness.caps
        self.failed = False
        self.calls: list[Call] = []
        if self.stats is not None:
            self.stats.examples += 1

    # -- requests ------------------------------------------------------------------------------------------------

    @rule(
        seq=st.runner().map(lambda machine: machine.harness.new_id()),
        namespace=st.deferred(
            lambda: st.runner().flatmap(lambda machine: strategies.namespaces(machine.caps.namespaces))
        ),
        system=st.deferred(lambda: st.runner().flatmap(lambda machine: strategies.systems(machine.config.block_size))),
        suffix=st.deferred(lambda: st.runner().flatmap(lambda machine: strategies.suffixes(machine.config.block_size))),
    )
    @counted
    def admit(self, seq: str, namespace: tuple, system: tuple, suffix: list) -> None:
        """A request whose prompt is a shared system prompt followed by its own suffix."""
        self.harness.admit(seq, namespace, system + tuple(suffix))

    @precondition(lambda self: self.harness.ids(Status.PREEMPTED))
    @rule(seq=_pick(lambda h: h.ids(Status.PREEMPTED)))
    @counted
    def readmit(self, seq: str) -> None:
        self.harness.readmit(seq)

    @precondition(lambda self: self.harness.ids(Status.RUNNING))
    @rule(
        seq=_pick(_running),
        tokens=st.deferred(
            lambda: st.runner().flatmap(lambda machine: strategies.appended_tokens(machine.config.block_size))
        ),
    )
    @counted
    def grow(self, seq: str, tokens: list) -> None:
        self.harness.grow(seq, tuple(tokens))

    @precondition(lambda self: self.caps.fork and self.harness.computed_ids())
    @rule(parent=_pick(_computed), child=st.runner().map(lambda machine: machine.harness.new_id()))
    @counted
    def fork(self, parent: str, child: str) -> None:
        self.harness.fork(parent, child)

    @precondition(lambda self: any(m.status is not Status.PREEMPTED for m in self.harness.seqs.values()))
    @rule(seq=_pick(lambda h: [s for s, m in h.seqs.items() if m.status is not Status.PREEMPTED]))
    @counted
    def free(self, seq: str) -> None:
        self.harness.free(seq)

    @precondition(lambda self: _preemptible(self.harness))
    @rule(seq=_pick(_preemptible))
    @counted
    def preempt(self, seq: str) -> None:
        self.harness.preempt(seq)

    @precondition(lambda self: self.caps.swap and self.harness.num_host_blocks and self.harness.computed_ids())
    @rule(seq=_pick(_computed))
    @counted
    def swap_out(self, seq: str) -> None:
        self.harness.swap_out(seq)

    @precondition(lambda self: self.harness.ids(Status.SWAPPED))
    @rule(seq=_pick(lambda h: h.ids(Status.SWAPPED)))
    @counted
    def swap_in(self, seq: str) -> None:
        self.harness.swap_in(seq)

    @precondition(lambda self: self.caps.rollback and _rollbackable(self.harness))
    @rule(seq=_pick(_rollbackable), num_tokens=st.integers(1, 6))
    @counted
    def rollback(self, seq: str, num_tokens: int) -> None:
        """Reject ``num_tokens`` drafts, or as many as leave one token (and, under a sliding window, no dropped
        block back in the window)."""
        self.harness.rollback(seq, min(num_tokens, self.harness.rollback_limit(seq)))

    # -- the cache and the engine --------------------------------------------------------------------------------

    @precondition(lambda self: self.caps.eviction and self.harness.finished)
    @rule(num_blocks=st.integers(1, 4))
    @counted
    def evict(self, num_blocks: int) -> None:
        self.harness.evict(num_blocks)

    @precondition(lambda self: self.caps.eviction and self.harness.finished)
    @rule()
    @counted
    def reset_cache(self) -> None:
        self.harness.reset_cache()

    @rule()
    @counted
    def step(self) -> None:
        self.harness.step()

    @precondition(lambda self: self.harness.computed_ids())
    @rule(token=st.integers(0, strategies.VOCABULARY - 1))
    @counted
    def decode(self, token: int) -> None:
        """One continuous-batching iteration: every computed sequence appends ``token``, then a step runs."""
        for seq in self.harness.computed_ids():
            self.harness.grow(seq, (token,))
        self.harness.step()

    @precondition(lambda self: self.harness.seqs or self.harness.finished)
    @rule(call=st.runner().flatmap(lambda machine: st.sampled_from(misuse_calls(machine.harness))))
    @counted
    def misuse(self, call) -> None:
        self.harness.misuse(call)

    def teardown(self) -> None:
        """Invariant 10 once every sequence is gone; skipped after a failure, whose state is already broken."""
        if self.failed:
            return
        try:
            self.harness.quiesce()
        except Exception:
            if self.stats is not None:
                self.stats.failed(self.calls)
            raise


def _fresh(h: Harness, seq: str) -> bool:
    return seq not in h.seqs and seq not in h.finished


_ARGUMENTS_VALID: dict[str, Callable[[Harness, dict], bool]] = {
    "admit": lambda h, a: _fresh(h, a["seq"]),
    "readmit": lambda h, a: a["seq"] in h.ids(Status.PREEMPTED),
    "grow": lambda h, a: a["seq"] in _running(h),
    "fork": lambda h, a: a["parent"] in _computed(h) and _fresh(h, a["child"]) and a["parent"] != a["child"],
    "free": lambda h, a: a["seq"] in h.seqs and h.seqs[a["seq"]].status is not Status.PREEMPTED,
    "preempt": lambda h, a: a["seq"] in _preemptible(h),
    "swap_out": lambda h, a: a["seq"] in _computed(h),
    "swap_in": lambda h, a: a["seq"] in h.ids(Status.SWAPPED),
    "rollback": lambda h, a: a["seq"] in _rollbackable(h),
    "decode": lambda h, a: bool(h.computed_ids()),
    "misuse": lambda h, a: a["call"] in misuse_calls(h),
}


def is_valid(machine: KVCacheMachine, call: Call) -> bool:
    """Whether ``call`` could have been drawn in the machine's current state: its rule enabled by the declared
    capabilities, and every sequence it names in the state its rule draws from. Used to replay programs."""
    needs = {
        "fork": "fork",
        "swap_out": "swap",
        "swap_in": "swap",
        "rollback": "rollback",
        "evict": "eviction",
        "reset_cache": "eviction",
    }.get(call.rule)
    if needs is not None and not getattr(machine.caps, needs):
        return False
    check = _ARGUMENTS_VALID.get(call.rule)
    return check is None or check(machine.harness, call.kwargs())


def machine_for(
    factory: AllocatorFactory, config: MachineConfig = MachineConfig(), stats: Optional[RunStats] = None
) -> type[KVCacheMachine]:
    """A machine class bound to one allocator factory and configuration (and, optionally, a stats counter)."""
    name = getattr(factory, "__name__", "Allocator")
    return type(
        f"KVCacheMachine_{name}",
        (KVCacheMachine,),
        {"factory": staticmethod(factory), "config": config, "stats": stats},
    )
