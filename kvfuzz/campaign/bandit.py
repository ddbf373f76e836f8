"""Which configuration a guided campaign's next batch runs: a bandit over the configurations that reached new
coverage, as HypoFuzz gives more time to the tests still finding coverage.

Each configuration that ran is an arm whose score is the new coverage of its recent batches per second of their time,
decayed by half each batch: scored per batch, a slow configuration (a batch of a pool of one-token blocks can take the
whole batch time) outscored quick ones that found more per second. A batch of a configuration that reaches nothing
new retires it (until a later batch of it finds something): decayed by half, an arm that had found 300 points in a
one-second batch kept a score above :data:`LEAST_SCORE` through eleven batches that found nothing, and was drawn for
most of them where a blind search draws a fresh configuration. Drawing a fresh
configuration from the swarm table is an arm too (:data:`FRESH`), scored by the batches that ran freshly drawn
configurations: early in a campaign most coverage comes from configurations not yet drawn, and the search keeps drawing
them while they pay; once they stop, the arms that still find get the batches. A batch draws a fresh configuration with
the fresh arm's share of the scores, at least :data:`EXPLORE` (and always while no other arm scores); otherwise it runs
an arm, drawn in proportion to its score.
"""

from __future__ import annotations

import random
from typing import Optional

EXPLORE = 0.3
"""The least share of batches that draw a fresh configuration, however well the other arms score."""
FRESH = ""
"""The arm of a fresh draw from the swarm table (no configuration's key is empty)."""
MUTANTS = "mutants"
"""The arm of the batches that mutate seeds, whatever their configuration (no configuration's key, a JSON object, is
this word): how large a share of the batches mutants get (:meth:`Bandit.share`)."""
DECAY = 0.5
"""An arm's score after a batch: DECAY * score + (1 - DECAY) * the batch's new points per second."""
LEAST_SECONDS = 1.0
"""A batch quicker than this counts as taking this long (a batch of a fraction of a second is no measure of speed)."""
LEAST_SCORE = 0.02
"""An arm scoring less (a new point every 50 seconds) is not drawn: it stopped finding."""


class Bandit:
    """The arms (configurations, by key) and their scores."""

    def __init__(self, explore: float = EXPLORE) -> None:
        self.explore = explore
        self.scores: dict[str, float] = {}

    def record(self, arm: str, gain: float, seconds: float) -> None:
        """A batch of ``arm`` reached ``gain`` points no earlier batch had, in ``seconds``: a configuration's batch
        that reached none retires it (the fresh and the mutants' arms decay instead)."""
        if gain == 0 and arm not in (FRESH, MUTANTS):
            self.scores.pop(arm, None)
            return
        rate = gain / max(seconds, LEAST_SECONDS)
        self.scores[arm] = DECAY * self.scores.get(arm, 0.0) + (1 - DECAY) * rate

    def choose(self, rng: random.Random) -> Optional[str]:
        """The arm the next batch runs, or None: draw a fresh configuration."""
        scoring = sorted(
            (arm, score) for arm, score in self.scores.items() if arm not in (FRESH, MUTANTS) and score >= LEAST_SCORE
        )
        if not scoring:
            return None
        fresh = self.scores.get(FRESH, 0.0)
        if rng.random() < max(self.explore, fresh / (fresh + sum(score for _, score in scoring))):
            return None
        return rng.choices([arm for arm, _ in scoring], weights=[score for _, score in scoring])[0]

    def share(self, arm: str, least: float, most: float) -> float:
        """The share of the batches ``arm`` earns: its score's share of every arm's, between ``least`` and ``most``;
        ``most`` while it has not run (its worth unknown), ``least`` once it scores less than :data:`LEAST_SCORE` (it
        stopped finding: the other batches are as good a use of the time)."""
        if arm not in self.scores:
            return most
        scoring = {name: score for name, score in self.scores.items() if score >= LEAST_SCORE}  # still finding
        if arm not in scoring:
            return least
        return min(most, max(least, scoring[arm] / sum(scoring.values())))
