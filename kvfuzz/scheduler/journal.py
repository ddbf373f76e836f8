"""The program an example is running, kept on disk operation by operation, so that when the process running it
dies or hangs past any interrupt (an isolated batch of a scheduler campaign), its parent still has the program that
got it there, as a scheduler trace.

The file holds JSON lines: a header when an example starts (its configuration and model runner, and the file is
truncated), then one line per operation *before* it runs. Each line is one ``write`` of an unbuffered file, so a
process killed at any point leaves whole lines behind (the kernel keeps what was written); a torn last line is
dropped on reading."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import attrs

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, ResetPrefixCache, Step


@attrs.frozen
class JournaledExample:
    """What a journal held: the example's configuration, model runner and operations so far."""

    setup: SchedulerSetup
    model_runner: str
    program: tuple[Operation, ...]


class ProgramJournal:
    """Keeps the running example's program in ``path`` (see the module)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._descriptor: Optional[int] = None

    def start(self, setup: SchedulerSetup, model_runner: str) -> None:
        """A new example starts: the file holds its header alone."""
        self.close()
        self._descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._line({"setup": attrs.asdict(setup), "model_runner": model_runner})

    def record(self, operation: Operation) -> None:
        """``operation`` is about to run."""
        self._line(operation.to_json())

    def _line(self, value: object) -> None:
        if self._descriptor is not None:
            os.write(self._descriptor, (json.dumps(value) + "\n").encode())

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None


def read_journal(path: Path) -> Optional[JournaledExample]:
    """The example ``path`` holds, or None when it holds no whole header (nothing had started)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError:
        return None
    whole = lines[:-1]  # the part after the last newline is torn, or empty
    if not whole:
        return None
    try:
        header = json.loads(whole[0])
        setup = SchedulerSetup(**header["setup"])
        program: list[Operation] = []
        for line in whole[1:]:
            item = json.loads(line)
            if item["op"] == "add":
                program.append(
                    AddRequest(
                        item["prompt"],
                        item["max_tokens"],
                        item.get("priority", 0),
                        item.get("cache_salt"),
                        item.get("stop_token_ids", ()),
                        item.get("eos", False),
                        item.get("min_tokens", 0),
                        item.get("lora", 0),
                    )
                )
            elif item["op"] == "abort":
                program.append(Abort(item["request"]))
            elif item["op"] == "reset_prefix_cache":
                program.append(ResetPrefixCache(item.get("preempt", False)))
            else:
                program.append(Step())
    except (ValueError, KeyError, TypeError):
        return None
    return JournaledExample(setup, str(header["model_runner"]), tuple(program))
