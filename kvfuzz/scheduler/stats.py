"""vLLM's scheduler statistics (``SchedulerSetup.stats``: ``log_stats`` on), checked against what kvfuzz saw: what a
metrics dashboard, an autoscaler or a load balancer reads of an engine.

With ``log_stats`` the scheduler returns a ``SchedulerStats`` with the outputs of every ``update_from_output``.
kvfuzz reads it right there and holds it to:

* **returned**: every ``update_from_output`` returns one (vLLM returns it even with no request output);
* **usage**: ``kv_cache_usage`` is the share of the pool's usable blocks (all but the null block) some request
  holds, counted from the blocks' reference counts, not from the free queue ``get_usage`` reads;
* **requests**: running, waiting and skipped-waiting requests add up to the requests the client has not seen finish
  (added, not aborted, no finishing output yet) and its open streaming sessions (a paused one waits for its next
  input), and no more run than ``max_num_seqs``;
* **prefix-cache lookups** (without a KV connector): the prefix-cache stats since the last ones count each request
  admitted since (new, or back after a preemption, as the steps' outputs show it; a streaming session's next turn
  keeps its blocks and looks nothing up), the tokens it held when admitted (its prompt and outputs so far) as queries,
  and the tokens it found computed as hits; a request preempted before (named among a step's preempted requests, or
  running at a preempting prefix-cache reset) counts as preempted. A request that skips reading the prefix cache
  (:mod:`kvfuzz.scheduler.prefix_reads`) looks nothing up and is not counted, as vLLM counts it. With prefix caching
  off nothing is looked up, so nothing is counted. With a KV connector the hit kvfuzz sees includes the connector's
  tokens, and an asynchronous load is admitted without being scheduled, so the lookups are not checked there.

Each admission is counted when the step that admitted it is launched, and the tally is taken when the next stats
are (vLLM resets its own at each ``make_stats``), so two steps in flight (async scheduling) compare the same way."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import attrs

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.prefix_reads import skips_reads
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.define
class Lookups:
    """Prefix-cache lookups counted since the last stats: new requests' and preempted ones' (requests, queried
    tokens, hit tokens)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def add(self, tokens: int, hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += tokens
            self.preempted_hits += hits
        else:
            self.requests += 1
            self.queries += tokens
            self.hits += hits

    @classmethod
    def of(cls, stats: Any) -> Lookups:
        """vLLM's ``PrefixCacheStats`` as a tally."""
        names = [field.name for field in attrs.fields(cls)]
        return cls(*(int(getattr(stats, name)) for name in names))


class AdmissionTally:
    """The lookups kvfuzz expects: each admission a step's output shows (prefix caching on, no KV connector), counted
    among the preempted ones once the request was ever preempted (vLLM's ``num_preemptions`` never goes back to 0).
    Invariant: ``running`` holds the requests admitted and not preempted, finished or aborted since."""

    def __init__(self, skipping: Callable[[str], bool]) -> None:
        self.skipping = skipping  # whether a request skips reading the prefix cache (it looks nothing up)
        self.since = Lookups()  # admissions since the last stats were taken
        self.running: set[str] = set()  # admitted, and not preempted, finished or aborted since
        self.preempted: set[str] = set()  # requests preempted at least once (a step's output named them, or a reset)
        self.kept: set[str] = set()  # admitted, and not preempted since: their blocks are theirs (no new lookup)

    def admit(self, request: str, tokens: int, computed: int) -> None:
        self.running.add(request)
        if request in self.kept:
            return  # a session's next turn: it kept its blocks, and looks nothing up
        self.kept.add(request)
        if not self.skipping(request):
            self.since.add(tokens, computed, request in self.preempted)

    def preempt(self, requests: Iterable[str]) -> None:
        chosen = set(requests)
        self.preempted |= chosen
        self.running -= chosen
        self.kept -= chosen

    def preempt_running(self) -> None:
        self.preempt(set(self.running))

    def finish(self, request: str) -> None:
        self.running.discard(request)

    def take(self) -> Optional[Lookups]:
        taken, self.since = self.since, Lookups()
        return taken


class NoLookups:
    """Prefix caching off: nothing is looked up, so every lookup count stays 0."""

    def admit(self, request: str, tokens: int, computed: int) -> None:
        """Nothing looked up."""

    def preempt(self, requests: Iterable[str]) -> None:
        """Nothing looked up."""

    def preempt_running(self) -> None:
        """Nothing looked up."""

    def finish(self, request: str) -> None:
        """Nothing looked up."""

    def take(self) -> Optional[Lookups]:
        return Lookups()


class UncheckedLookups(NoLookups):
    """A KV connector: nothing counted, and the lookups are not checked (see the module)."""

    def take(self) -> Optional[Lookups]:
        return None


def _lookups(setup: SchedulerSetup) -> AdmissionTally | NoLookups:
    if setup.kv_connector != "none":
        return UncheckedLookups()
    return AdmissionTally(lambda request: skips_reads(setup, request)) if setup.prefix_caching else NoLookups()


class StatsLedger:
    """The checks of the module, on the stats of each ``update_from_output``."""

    def __init__(self, setup: SchedulerSetup) -> None:
        self.max_num_seqs = setup.max_num_seqs
        self.lookups = _lookups(setup)  # what the prefix-cache stats should count
        self.checked = 0  # stats checked so far

    def admitted(self, request: str, tokens: int, computed: int) -> None:
        """``request`` admitted by the step just scheduled, holding ``tokens`` tokens, ``computed`` of them found
        computed."""
        self.lookups.admit(request, tokens, computed)

    def preempted(self, requests: Iterable[str]) -> None:
        """``requests`` preempted (a step's output names them)."""
        self.lookups.preempt(requests)

    def reset_preempted(self) -> None:
        """A prefix-cache reset preempted every running request."""
        self.lookups.preempt_running()

    def finished(self, request: str) -> None:
        """``request`` finished (its last output came, or its client aborted it)."""
        self.lookups.finish(request)

    def check(self, scheduler: Any, outputs: dict[int, Any], unfinished: list[str], step: int) -> None:
        """The stats among ``outputs`` (what ``update_from_output`` returned at ``step``) against the pool and
        ``unfinished`` (the requests the client has not seen finish)."""
        found = [eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None]
        if len(found) != 1:
            raise SchedulerViolation(
                Check.STATS,
                step,
                None,
                f"update_from_output() returned {len(found)} SchedulerStats with log_stats on: one each time",
                "stats missing" if not found else "stats returned twice",
            )
        (stats,) = found
        self.checked += 1
        self._usage(scheduler.kv_cache_manager.block_pool, stats.kv_cache_usage, step)
        self._requests(stats, unfinished, step)
        expected = self.lookups.take()
        if expected is not None:
            self._lookups(Lookups.of(stats.prefix_cache_stats), expected, step)

    def _usage(self, pool: Any, usage: float, step: int) -> None:
        usable = pool.num_gpu_blocks - 1  # the null block is never handed out
        held = sorted(block.block_id for block in pool.blocks if block.ref_cnt > 0 and not block.is_null)
        expected = len(held) / usable if usable else 0.0
        if abs(usage - expected) > 1e-9:
            raise SchedulerViolation(
                Check.STATS,
                step,
                None,
                f"the stats report KV cache usage {usage:.4f}, but requests hold {len(held)} of the pool's {usable} "
                f"usable blocks ({expected:.4f}; held: {held})",
                "KV cache usage",
            )

    def _requests(self, stats: Any, unfinished: list[str], step: int) -> None:
        counted = stats.num_running_reqs + stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
        if counted != len(unfinished):
            raise SchedulerViolation(
                Check.STATS,
                step,
                None,
                f"the stats count {stats.num_running_reqs} running, {stats.num_waiting_reqs} waiting and "
                f"{stats.num_skipped_waiting_reqs} skipped request(s), {counted} in all, but {len(unfinished)} are "
                f"unfinished ({', '.join(unfinished) or 'none'})",
                "request counts",
            )
        if stats.num_running_reqs > self.max_num_seqs:
            raise SchedulerViolation(
                Check.STATS,
                step,
                None,
                f"the stats count {stats.num_running_reqs} running requests, over max_num_seqs {self.max_num_seqs}",
                "request counts",
            )

    def _lookups(self, found: Lookups, expected: Lookups, step: int) -> None:
        if found == expected:
            return
        differing = [
            f"{field.name} {getattr(found, field.name)} (expected {getattr(expected, field.name)})"
            for field in attrs.fields(Lookups)
            if getattr(found, field.name) != getattr(expected, field.name)
        ]
        raise SchedulerViolation(
            Check.STATS,
            step,
            None,
            "the prefix-cache stats since the last ones differ from the requests the steps admitted: "
            + ", ".join(differing),
            "prefix-cache lookups",
        )


class NoStats:
    """``log_stats`` off: no stats to check."""

    checked = 0

    def admitted(self, request: str, tokens: int, computed: int) -> None:
        """Nothing counted."""

    def preempted(self, requests: Iterable[str]) -> None:
        """Nothing counted."""

    def reset_preempted(self) -> None:
        """Nothing counted."""

    def finished(self, request: str) -> None:
        """Nothing counted."""

    def check(self, scheduler: Any, outputs: dict[int, Any], unfinished: list[str], step: int) -> None:
        """Nothing returned."""


def stats_checker(setup: SchedulerSetup) -> StatsLedger | NoStats:
    """The stats' checker of an example: a :class:`StatsLedger` when ``setup.stats``, else :class:`NoStats`."""
    return StatsLedger(setup) if setup.stats else NoStats()
