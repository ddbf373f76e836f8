"""Coverage as a campaign's signal, written once for every target: what one worker's examples reach of the code under
test, taken per example, and with ``--guided`` what the search does with it.

* ``--coverage``: each example's new points are taken when the next begins (the example boundaries are the worker
  journal's: :class:`FeedbackJournal`), and each batch's sent to the campaign (:class:`~kvfuzz.campaign.messages.
  Covered`), which reports the union;
* ``--guided`` also keeps, in the target's seed pool (:mod:`kvfuzz.campaign.seeds`), each example whose program
  reached a point no earlier example of the worker had, with the batch's configuration (the target's swarm values,
  as JSON), for the target's mutator; and scores every configuration that ran by the new points per second of its
  batches (:mod:`kvfuzz.campaign.bandit`), so that :meth:`Feedback.arm` gives more batches to those still finding.

What a target keeps of its own: how a configuration is drawn and checked, what a mutant is and how it runs (the
allocator target: :mod:`kvfuzz.program.mutants`; a scheduler target: :mod:`kvfuzz.scheduler.mutate`). A program
run while a failure is shrunk reaches points that count for the batch, but is never kept as a seed
(:meth:`Feedback.unseeded`): it runs in the shrinker's configuration, not the batch's.

Invariant: a point counts for the batch whose example first reached it; :attr:`Feedback.batch` holds the points the
running batch reached first, :meth:`Feedback.end` hands them on and begins afresh.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

from kvfuzz.campaign.bandit import FRESH, MUTANTS, Bandit
from kvfuzz.campaign.messages import Covered
from kvfuzz.campaign.seeds import Seed, SeedPool
from kvfuzz.coverage.measure import Reached, measurer
from kvfuzz.coverage.scope import Scope
from kvfuzz.program.safeguards import Journal

MUTATE_SHARE = (0.1, 0.5)
"""The least and the most share of a guided worker's batches that mutate seeds, once there are seeds: the most until
mutants have run, then their score's share of every arm's (:meth:`~kvfuzz.campaign.bandit.Bandit.share`), so that
mutants get batches while they pay, and a search whose mutants stopped finding runs mostly as a blind one."""


FRESH_CREDIT = 0.25
"""The share of a freshly drawn batch's new points its configuration's arm is credited with (the fresh arm gets them
all): early in a campaign any configuration finds new points, so a configuration's first batch is weak evidence for
running it again; a re-run or a mutant batch credits its configuration in full."""


SEED_TRIES = 4
"""Seeds drawn for a mutant batch before giving up on the pool for that batch (those the target cannot run are
dropped as they are met)."""

Config = TypeVar("Config")
"""A target's configuration of a batch (its swarm table's draw)."""
Read = TypeVar("Read")


def config_key(config: dict[str, Any]) -> str:
    """A configuration's identity: the bandit's arm, the seed pool's key."""
    return json.dumps(config, sort_keys=True)


class Feedback(Generic[Config]):
    """One worker's coverage of its target's code under test and, with a seed pool (``--guided``), its seeds and its
    bandit over the target's configurations (see the module)."""

    def __init__(self, scope: Scope, slot: int, pool: Optional[SeedPool] = None) -> None:
        self.scope = scope  # the code under test
        self.files = scope.files()  # its files, measured
        self.measurer = measurer(self.files)
        self.slot = slot  # the worker's, for its Covered messages
        self.pool = pool  # the target's seeds (None: the search is blind)
        self.bandit = Bandit()  # configurations (by config_key) scored by the new points per second of their batches
        self.arms: dict[str, Config] = {}  # guided: the configurations the bandit scores, by the config_key of its JSON
        self.config: Optional[dict[str, Any]] = None  # the running batch's configuration
        self.key = ""  # its config_key
        self.program: list[dict[str, Any]] = []  # the running example's calls, as its journal lists them
        self.batch = Reached()  # the points the running batch reached first
        self.began = 0.0  # time.monotonic() when the running batch began
        self.mutated: Optional[str] = None  # the running batch's seed (its digest), when it mutates one
        self.drawn_fresh = False  # whether the running batch's configuration was drawn fresh from the swarm table
        self.seeding = True  # whether an example that reaches new points is kept (not while a failure is shrunk)

    @property
    def guided(self) -> bool:
        return self.pool is not None

    # -- what the next batch runs --------------------------------------------------------------------------------

    def arm(self, rng: random.Random) -> Optional[Config]:
        """The configuration the bandit gives the next batch, or None: draw one fresh (always, unguided)."""
        key = self.bandit.choose(rng) if self.guided else None
        return self.arms[key] if key is not None else None

    def mutating(self, rng: random.Random) -> bool:
        """Whether the next batch mutates seeds: guided, with seeds (those other workers kept read first), for the
        share of the batches mutants earn (:data:`MUTATE_SHARE`)."""
        if self.pool is None:
            return False
        self.pool.refresh()
        return bool(self.pool.seeds) and rng.random() < self.bandit.share(MUTANTS, *MUTATE_SHARE)

    def seed_to_mutate(
        self, rng: random.Random, read: Callable[[Seed], Read]
    ) -> Optional[tuple[Seed, Read, Optional[Seed]]]:
        """A seed the target can run (``read`` of it: ``TypeError``, ``ValueError`` or ``KeyError`` when it cannot, and
        the seed is dropped: another engine version's, another campaign's allocator or pins), what ``read`` made of
        it, and another seed of its configuration (what a splice takes from); None when none is found in
        :data:`SEED_TRIES` draws."""
        pool = self.pool
        assert pool is not None
        for _ in range(SEED_TRIES):
            seed = pool.choose(rng)
            if seed is None:
                return None
            try:
                made = read(seed)
            except (TypeError, ValueError, KeyError):
                pool.drop(seed)
                continue
            return seed, made, pool.choose(rng, seed.config_key)
        return None

    # -- batches and their examples ------------------------------------------------------------------------------

    def begin(
        self, config: Config, values: dict[str, Any], mutated: Optional[str] = None, drawn_fresh: bool = False
    ) -> None:
        """A batch begins under ``config`` (``values``: its JSON, what a seed keeps): a mutant batch of seed
        ``mutated``, or one drawn fresh or by the bandit."""
        self.key = config_key(values)
        if self.guided:
            self.arms[self.key] = config
        self.config, self.mutated, self.drawn_fresh = values, mutated, drawn_fresh
        self.program = []
        self.batch = Reached()
        self.began = time.monotonic()
        self.measurer.start()

    def example_begins(self) -> None:
        """The worker's journal begins an example: the one before it ended."""
        self.example_ended()

    def called(self, record: dict[str, Any]) -> None:
        """The worker's journal lists a call of the running example."""
        self.program.append(record)

    def example_ended(self) -> None:
        """The running example ended: what it reached first is taken, and its program kept as a seed when it reached
        any."""
        new = self.measurer.take()
        program, self.program = self.program, []
        if not new:
            return
        self.batch = self.batch | new
        if self.pool is not None and self.config is not None and program and self.seeding:
            self.pool.add(Seed.of(self.pool.target, self.config, program, len(new)))

    @contextlib.contextmanager
    def unseeded(self) -> Iterator[None]:
        """Programs run inside (a failing program's replays, a shrinker's candidates) count for the batch's coverage
        but are not kept; nor is the running example, whose failure they handle (its mutants would meet that
        failure again)."""
        self.seeding = False
        self.example_ended()
        try:
            yield
        finally:
            self.example_ended()
            self.seeding = True

    def end(self) -> Covered:
        """The batch ended: its last example's coverage taken, the bandit told (guided; a configuration it no longer
        scores is forgotten); what it reached first, for the campaign."""
        self.example_ended()
        if self.guided and self.config is not None:
            seconds = time.monotonic() - self.began
            found = len(self.batch)
            self.bandit.record(self.key, found * FRESH_CREDIT if self.drawn_fresh else found, seconds)
            if self.drawn_fresh:
                self.bandit.record(FRESH, found, seconds)
            if self.mutated is not None:
                self.bandit.record(MUTANTS, found, seconds)
            if self.key not in self.bandit.scores:
                del self.arms[self.key]
        return Covered(self.slot, self.batch.to_json(), self.scope.imported(self.files))

    def entry(self) -> dict[str, Any]:
        """The batch log's coverage fields for the batch that ended."""
        fields: dict[str, Any] = {"new_lines": len(self.batch.lines), "new_branches": len(self.batch.branches)}
        if self.pool is not None:
            fields["mutated_seed"] = self.mutated
            fields["seeds"] = len(self.pool)
        return fields

    def stop(self) -> None:
        self.measurer.stop()


class FeedbackJournal(Journal):
    """A worker's journal: each example's program on disk, each call a sign of life (``beat``), and each example's
    start and calls told to the worker's ``feedback`` (its example boundaries are the journal's)."""

    def __init__(
        self,
        corpus: Path,
        header: dict[str, Any],
        configuration: dict[str, Any],
        feedback: Optional[Feedback] = None,
        beat: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(corpus, header, configuration)
        self.feedback = feedback  # the worker's coverage (None: the campaign measures none)
        self.beat = beat

    def begin_example(self, configuration: Optional[dict[str, Any]] = None) -> None:
        if self.feedback is not None:
            self.feedback.example_begins()
        super().begin_example(configuration)
        self.beat()

    def call(self, record: dict[str, Any]) -> None:
        if self.feedback is not None:
            self.feedback.called(record)
        super().call(record)
        self.beat()
