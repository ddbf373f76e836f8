"""Priority scheduling in the scheduler target: under vLLM's priority policy every request is drawn with a priority,
so that vLLM's priority preemption runs (a running request that cannot get blocks preempts the running request of
the lowest priority, largest value then latest arrival, which may be one the same step has already scheduled).

Priorities come from a few values, so that ties (broken by arrival) and inversions are both common. Under FCFS no
priority is drawn: the machine, its examples and its shrunk programs stay as they were before the policy existed."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvfuzz.scheduler.config import SchedulerSetup

PRIORITIES = 4
"""Priorities are drawn from ``range(PRIORITIES)`` (0 runs first)."""


def priority_arguments(setup: SchedulerSetup) -> dict[str, Any]:
    """The ``add_request`` rule's extra arguments under ``setup``'s policy: a priority under ``priority``, none
    under ``fcfs`` (the rule then adds every request at the default priority 0)."""
    if setup.policy != "priority":
        return {}
    return {"priority": st.integers(0, PRIORITIES - 1)}
