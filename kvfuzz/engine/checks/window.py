"""Invariant 6, the non-reuse window: no block is handed out for writing while in-flight work may still land on it."""

from __future__ import annotations

from typing import Iterable

from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.pools import UNTIL_LOADS_LAND
from kvfuzz.engine.violations import Cause, Invariant


class InflightWindow(Checker):
    """Invariant 6 over the pools' late work: a block released within the in-flight window waits for it to close."""

    def outside(self, blocks: Iterable[int], seq: str) -> None:
        """Invariant 6: no block handed to ``seq`` for writing still has in-flight work that may land on it."""
        pools = self.pools
        for block in blocks:
            work = pools.late_work_by_block.get(block)
            if work is not None and work.lands_at == UNTIL_LOADS_LAND:
                self.fail(
                    Invariant.NON_REUSE_WINDOW,
                    f"block {block} handed to {seq} for writing while an asynchronous load still fills it",
                    [
                        f"block {block} was released by {work.released_by} while step {work.released_at} was being "
                        "scheduled, with a host-tier load into it under way; the worker writes it until the load is "
                        "reported landed (loads_landed), which it has not been",
                        *pools.block_story(block),
                    ],
                    Cause("a block handed out for writing while an asynchronous load still fills it"),
                )
            if work is not None:
                completed = work.lands_at - pools.inflight_window
                self.fail(
                    Invariant.NON_REUSE_WINDOW,
                    f"block {block} handed to {seq} for writing before its in-flight window closed",
                    [
                        f"block {block} was released by {work.released_by} while step {work.released_at} was "
                        f"being scheduled ({f'step {completed}' if completed >= 0 else 'no step'} completed "
                        f"yet); with W = {pools.inflight_window}, work issued before then may touch it until step "
                        f"{work.lands_at} completes",
                        f"found:    handed out while step {pools.next_step} is being scheduled, and step "
                        f"{work.lands_at} has not completed",
                        *pools.block_story(block),
                    ],
                    Cause("a block handed out for writing before its in-flight window closed"),
                )
