"""vLLM's prefix-cache retention of sliding-window and Mamba blocks (``SchedulerSetup.retention``: vLLM's
``prefix_cache_retention_interval``, docs/scheduler-features.md): the unmodified scheduler passes under each
retention on the models it applies to, the setting reaches vLLM's coordinator and changes what the cache keeps, and
a seeded sliding-window bug in what retention keeps and the lookup accepts (one contiguous block fewer than the
window needs for a hit) is caught by the content check.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import attrs
import pytest
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check

WINDOW = SchedulerSetup(num_blocks=12, model="sliding-window")
MAMBA = SchedulerSetup(num_blocks=12, model="mamba-hybrid")


@pytest.mark.parametrize(
    "setup",
    [
        attrs.evolve(WINDOW, retention="dense"),
        attrs.evolve(WINDOW, retention="periodic"),
        attrs.evolve(MAMBA, retention="dense"),
    ],
    ids=["window-dense", "window-periodic", "mamba-dense"],
)
def test_the_unmodified_scheduler_passes_under_each_retention(setup: SchedulerSetup) -> None:
    outcome = search(setup, examples=20, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.hit_tokens > 0, outcome.describe()


@pytest.mark.parametrize(("retention", "interval"), [("semantic", 0), ("dense", None), ("periodic", 4 * 4)])
def test_the_retention_reaches_vllm_s_coordinator(retention: str, interval: object) -> None:
    session = Session(attrs.evolve(WINDOW, retention=retention))
    assert session.scheduler.kv_cache_manager.coordinator.retention_interval == interval


def test_sparser_retention_keeps_fewer_hits_on_the_same_programs() -> None:
    """The same examples (a derandomized search) hit the prefix cache most with every block kept, least with the
    resume checkpoints alone."""
    hits = {
        retention: search(attrs.evolve(WINDOW, retention=retention), examples=20, steps=30).hit_tokens
        for retention in ("dense", "periodic", "semantic")
    }
    assert hits["dense"] > hits["periodic"] > 0 and hits["dense"] > hits["semantic"] > 0, hits


def test_a_window_hit_one_block_short_is_caught_under_periodic_retention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the sliding-window lookup (and the retention mask) take one contiguous block fewer than the window
    needs, so a hit's window reaches into blocks the request does not hold."""
    needed = SlidingWindowManager._contiguous_blocks_for_hit.__func__  # type: ignore[attr-defined]

    def one_short(cls: type, window_size: int, block_size: int, use_eagle: bool) -> int:
        return max(needed(cls, window_size, block_size, use_eagle) - 1, 1)

    monkeypatch.setattr(SlidingWindowManager, "_contiguous_blocks_for_hit", classmethod(one_short))
    outcome = search(attrs.evolve(WINDOW, retention="periodic"), examples=40, steps=30)
    assert outcome.failure is not None and getattr(outcome.failure, "check", None) == Check.CONTENT, outcome.failure
