"""Hypothesis settings profiles for kvfuzz machines.

Settings are explicit: a machine class that carries its own settings would bring back Hypothesis's default deadline
and health checks, which a slow allocator trips for reasons that are not bugs.

* ``ci``: bounded and derandomized: the same examples on every run, a few seconds per allocator.
* ``dev``: random, a little longer, for local runs while changing an allocator.
* ``nightly``: a long campaign.
"""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import ExampleDatabase

_COMMON: dict[str, Any] = dict(
    deadline=None, suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False
)

PROFILES: dict[str, settings] = {
    "ci": settings(max_examples=150, stateful_step_count=50, derandomize=True, database=None, **_COMMON),
    "dev": settings(max_examples=500, stateful_step_count=60, **_COMMON),
    "nightly": settings(max_examples=20_000, stateful_step_count=100, **_COMMON),
}


def run_settings(
    examples: int, steps: int, derandomize: bool = True, shrink: bool = True, database: Optional[ExampleDatabase] = None
) -> settings:
    """Explicit settings: no deadline and no health checks (an allocator may be slow), and the example database
    only when one is given."""
    phases = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if shrink else ())
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=database,
        print_blob=False,
        report_multiple_bugs=False,
        phases=phases,
        suppress_health_check=list(HealthCheck),
    )
