"""What the one supervisor needs of a campaign's options, whatever its target (:class:`Settings`); a campaign's
rerun record repeats them (:mod:`kvfuzz.campaign.rerun`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import attrs

from kvfuzz.swarm_table import Pins


@attrs.frozen
class Settings:
    """What the supervisor itself needs of a campaign's options, whatever its target."""

    workers: int
    corpus: Path  # where new traces are saved, the workers' journals kept, and the campaign's state
    duration: Optional[float] = None  # seconds; None: no limit
    max_examples: Optional[int] = None  # examples to start, all workers together; None: no limit
    stop_after: Optional[int] = None  # new distinct failures; None: no limit
    database: Optional[str] = None  # redis://host:port/N (claims and findings shared), or a directory
    seed: int = 0  # the campaign's seed: each worker's stream derives from it
    call_timeout: Optional[float] = None  # the watchdog's limit per operation (None: none); sets the patience
    pins: Pins = ()  # rows of the target's swarm table held at one value (--pin), checked against the table
    coverage: bool = False  # the code under test's coverage measured (--coverage; kvfuzz.campaign.feedback)
    guided: bool = False  # and used: seeds, mutants, a bandit over configurations (--guided; implies coverage)

    @classmethod
    def of(cls, options: Any) -> Settings:
        """The settings of a target's campaign options (any record with these fields, by these names)."""
        return cls(*(getattr(options, field.name) for field in attrs.fields(cls)))
