"""A campaign's coverage of the code under test, gathered from its workers' :class:`~kvfuzz.campaign.messages.Covered`
messages: the union of what every worker reached, the files they imported, and the figures over time."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from kvfuzz.campaign.messages import Covered
from kvfuzz.coverage.measure import Reached
from kvfuzz.coverage.report import CoverageSummary, summarize


@attrs.frozen
class CampaignCoverage:
    """What a campaign reached. ``timeline`` holds one entry per batch that reached a point no earlier batch of the
    campaign had: seconds into the campaign, lines and branches reached so far, how many were new, and the new points
    of each file (by its path). Its JSON holds every point reached (``points``), so that another measurement of the
    same code compares with it (:mod:`kvfuzz.coverage.compare`)."""

    reached: Reached = attrs.field(repr=False)
    files: tuple[str, ...]
    timeline: tuple[dict[str, Any], ...]

    def summary(self) -> CoverageSummary:
        return summarize(self.reached, self.files)

    def describe(self) -> str:
        return f"coverage: {self.summary().describe()}"

    def to_json(self) -> dict[str, Any]:
        return {**self.summary().to_json(), "timeline": list(self.timeline), "points": self.reached.to_json()}


@attrs.define
class CoverageTally:
    """The running union (see :class:`CampaignCoverage`)."""

    reached: Reached = Reached()
    files: set[str] = attrs.Factory(set)
    timeline: list[dict[str, Any]] = attrs.Factory(list)

    def add(self, message: Covered, seconds: float) -> None:
        self.files |= set(message.files)
        new = Reached.from_json(message.points) - self.reached
        if not new:
            return
        self.reached = self.reached | new
        self.timeline.append(
            {
                "seconds": round(seconds, 2),
                "lines": len(self.reached.lines),
                "branches": len(self.reached.branches),
                "new_lines": len(new.lines),
                "new_branches": len(new.branches),
                "new_by_file": dict(sorted(Counter(point[0] for point in [*new.lines, *new.branches]).items())),
                "worker": message.worker,
            }
        )

    def progress(self) -> str:
        return f"reached {len(self.reached.lines)} lines + {len(self.reached.branches)} branches"

    def result(self) -> CampaignCoverage:
        return CampaignCoverage(self.reached, tuple(sorted(self.files)), tuple(self.timeline))
