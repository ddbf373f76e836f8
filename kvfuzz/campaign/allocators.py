"""The allocator target of a campaign (:class:`~kvfuzz.campaign.protocol.CampaignTarget`): its workers search the
allocators under swarmed configurations (:mod:`kvfuzz.campaign.worker`); the corpus's allocator traces (and, with
Redis, the findings stored there under an earlier signature's key) are its known findings
(:mod:`kvfuzz.campaign.known`, whose source :class:`AllocatorTraces` is).

A trace is also replayed against the campaign's other allocators that run the same code: factories whose
allocators are instances of the same class as the trace's, configured differently (vLLM v0's block manager with and
without chunked-prefill preemption, vLLM v1's default and LoRA managers). Where the trace's program fails there with
the same failure, in the same operation and, for a crash, in the same frame as on the allocator it was recorded
against, it is the same bug met in another configuration: that allocator's signature is known too. A failure that
differs in any of those, or an allocator of another class (each zoo variant is one), stays new.

A trace recorded against an allocator that is neither one of the campaign's (the user named those) nor trusted by
:class:`~kvfuzz.registry.AllocatorTrust` is passed over unimported: a corpus directory may hold traces from
elsewhere, and a trace can name any importable callable."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import attrs

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.campaign.cluster import ClusterFindings, is_redis
from kvfuzz.campaign.known import (
    Judged,
    KnownFindings,
    KnownTrace,
    known_findings,
    stored_findings_known,
    where_of,
)
from kvfuzz.campaign.protocol import WorkerContext, worker_seed
from kvfuzz.campaign.rerun import Rerun
from kvfuzz.campaign.settings import Settings
from kvfuzz.campaign.swarm import Limits, recorded
from kvfuzz.campaign.worker import HYPOTHESIS_EVERY, WorkerPlan, _Worker
from kvfuzz.engine.config import MachineConfig
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, UntrustedAllocator, load_factory
from kvfuzz.saved.corpus import PROCESS_DIED, trace_signature
from kvfuzz.saved.trace import Trace, load
from kvfuzz.shrink.signature import Signature
from kvfuzz.swarm_table import Pins


@attrs.frozen
class CampaignOptions:
    """What one campaign runs: the allocators (each probed into :class:`Limits`), how many workers, when it ends,
    where it saves, and what it shares."""

    allocators: tuple[str, ...]  # specs
    limits: tuple[Limits, ...]  # one per allocator, in the same order
    workers: int
    corpus: Path  # where new traces are saved (and the workers' journals kept)
    duration: Optional[float] = None  # seconds; None: no limit
    max_examples: Optional[int] = None  # programs to start, all workers together; None: no limit
    stop_after: Optional[int] = None  # new distinct failures; None: no limit
    known: tuple[Path, ...] = ()  # corpus directories whose traces' signatures are known findings
    database: Optional[str] = None  # redis://host:port/N, or an example-database directory
    seed: int = 0  # the campaign's seed: each worker's stream derives from it
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT
    shrink_seconds: float = 30.0
    pins: Pins = ()  # swarm rows held at one value (--pin), checked against every allocator's table
    coverage: bool = False  # measure the allocators' code (--coverage, --coverage-html)
    guided: bool = False  # and use it: seeds, mutants, a bandit over configurations (--guided)
    base: MachineConfig = MachineConfig()  # model shape and kernel; the geometry is swarmed
    hypothesis_every: int = HYPOTHESIS_EVERY


@attrs.frozen
class AllocatorRerun:
    """An allocator campaign's own settings of its rerun (:class:`~kvfuzz.campaign.rerun.TargetRerun`)."""

    allocators: tuple[str, ...]  # every allocator, patterns expanded
    shrink_seconds: float  # --shrink-time

    def target(self) -> list[str]:
        return [arg for spec in self.allocators for arg in ("--allocator", spec)]

    def options(self) -> list[str]:
        return ["--shrink-time", repr(self.shrink_seconds)]

    def to_json(self) -> dict[str, Any]:
        return {"allocators": list(self.allocators), "shrink_seconds": self.shrink_seconds}


class AllocatorCampaign:
    """The allocator target (see the module)."""

    def __init__(self, options: CampaignOptions) -> None:
        self.options = options
        self.settings = Settings.of(options)

    def prepare(self, event: Callable[[str], None]) -> KnownFindings:
        options = self.options
        source = AllocatorTraces(options.allocators, options.call_timeout or 60.0)
        known = known_findings([*options.known, options.corpus], source)
        if is_redis(options.database):  # findings stored under an earlier signature's key: known under today's
            assert options.database is not None
            known = known.then(stored_findings_known(ClusterFindings(options.database), source))
        return known

    def seed_of(self, slot: int, incarnation: int) -> int:
        return worker_seed(self.options.seed, slot, incarnation)

    def search(self, worker: WorkerContext) -> None:
        options = self.options
        plan = WorkerPlan(
            worker.slot,
            worker.seed,
            options.allocators,
            options.limits,
            options.base,
            options.corpus,
            options.database,
            worker.state,
            options.call_timeout,
            options.shrink_seconds,
            options.hypothesis_every,
            options.seed,
            options.pins,
            options.coverage,
            options.guided,
        )
        _Worker(plan, worker).search()

    def text(self, signature: dict[str, Optional[str]]) -> str:
        text = str(Signature(**signature))  # type: ignore[arg-type]  # Signature.to_json()'s fields
        return f"{text} [{signature['allocator']}]" if len(self.options.allocators) > 1 else text

    def rerun(self) -> Rerun:
        """The settings of a campaign run with these options in this directory, by this kvfuzz."""
        options = self.options
        own = AllocatorRerun(options.allocators, options.shrink_seconds)
        return Rerun.of(own, self.settings, tuple(map(str, options.known)))

    def result_fields(self) -> dict[str, Any]:
        return {"allocators": self.options.allocators}


class AllocatorTraces:
    """The known findings' source (:class:`~kvfuzz.campaign.known.KnownSource`) of an allocator campaign over
    ``allocators``: the traces recorded against one of them, or against an allocator of the same class as one of
    them (see the module), each replayed in this process under the watchdog of ``call_timeout``."""

    kind = "trace"

    def __init__(self, allocators: Iterable[str], call_timeout: float) -> None:
        self.allocators = tuple(dict.fromkeys(allocators))
        self.call_timeout = call_timeout
        self.classes: dict[tuple[str, PoolSpec], Optional[type]] = {}  # (spec, pool) -> the class it builds

    def load(self, path: Path) -> Trace:
        return load(path)

    def judge(self, where: str, trace: Any) -> Iterable[Judged]:
        if not isinstance(trace, Trace):
            return
        if trace.allocator not in self.allocators:
            try:
                AllocatorTrust().check(trace.allocator)
            except UntrustedAllocator:
                return
        pool = trace.config.pool_spec()
        recorded_class = self.class_of(trace.allocator, pool)
        died = str(trace.failure.get("title")).startswith(PROCESS_DIED)
        siblings = [
            spec
            for spec in self.allocators
            if spec != trace.allocator and not died and recorded_class is not None
            if self.class_of(spec, pool) is recorded_class
        ]
        if trace.allocator not in self.allocators and not siblings:
            return
        signature = trace_signature(trace, self.call_timeout)
        if signature is None:
            return
        where = where_of(where, trace.known_bug, trace.fixed)
        regression = bool(trace.fixed)
        if trace.allocator in self.allocators:
            yield Judged(signature.key(), KnownTrace(where, recorded(trace.allocator, trace.config)), regression)
        for spec in siblings:
            found = trace_signature(attrs.evolve(trace, allocator=spec), self.call_timeout)
            if found is not None and attrs.evolve(found, allocator=trace.allocator) == signature:
                same = f"{where}, recorded against {trace.allocator}, same failure here"
                yield Judged(found.key(), KnownTrace(same, recorded(spec, trace.config)), regression)

    def class_of(self, spec: str, pool: PoolSpec) -> Optional[type]:
        """The class of the allocator ``spec``'s factory builds for ``pool``, built once per (spec, pool); None where
        the factory cannot be loaded or refuses the pool."""
        if (spec, pool) not in self.classes:
            self.classes[spec, pool] = _built_class(spec, pool)
        return self.classes[spec, pool]


def _built_class(spec: str, pool: PoolSpec) -> Optional[type]:
    try:
        factory = load_factory(spec)
    except AllocatorNotFound:
        return None
    try:
        return type(factory(pool))
    except Exception:  # noqa: BLE001 -- a factory that refuses this pool shares no trace recorded on it
        return None
