"""A workload named on the command line: a kvfuzz-workload/1 file, ``constructed:NAME``, ``poisson:RATE[:SEED]``
(the seeded Poisson process), or ``azure-csv:PATH`` (an Azure LLM inference trace, imported as recorded)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from kvfuzz.workload.arrivals import ArrivalShape, poisson
from kvfuzz.workload.constructed import constructed
from kvfuzz.workload.format import Workload, WorkloadError, check_request_count, load_workload
from kvfuzz.workload.importers import import_azure_csv

SOURCES_HELP = "a kvfuzz-workload/1 JSON file, constructed:NAME, poisson:RATE[:SEED] or azure-csv:PATH"

LARGE_FILE_BYTES = 2**20
"""A workload file this large takes a noticeable time to read and check: a progress line says so first."""


def announce_large(path: Path, progress: Optional[Callable[[str], None]]) -> None:
    """One progress line before a file of :data:`LARGE_FILE_BYTES` or more is read."""
    size = path.stat().st_size if path.is_file() else 0
    if progress is not None and size >= LARGE_FILE_BYTES:
        progress(f"kvfuzz: reading the workload {path} ({size / 2**20:.1f} MiB)")


def workload_from(
    source: str,
    step_seconds: float = 0.05,
    requests: int = 60,
    progress: Optional[Callable[[str], None]] = None,
) -> Workload:
    """The workload ``source`` names (``step_seconds``: the step length an imported trace's times are divided by;
    ``requests``: how many the Poisson process makes; ``progress``: told before a large file is read); raises
    WorkloadError."""
    kind, _, rest = source.partition(":")
    if kind == "constructed":
        try:
            return constructed(rest)
        except KeyError as error:
            raise WorkloadError(str(error.args[0])) from error
    if kind == "poisson":
        check_request_count(requests, source)
        rate, _, seed = rest.partition(":")
        try:
            return poisson(float(rate), int(seed or 0), ArrivalShape(requests=requests))
        except ValueError as error:
            raise WorkloadError(f"{source}: expected poisson:RATE[:SEED] with a rate > 0 ({error})") from None
    if kind == "azure-csv":
        announce_large(Path(rest), progress)
        return import_azure_csv(Path(rest), step_seconds)
    announce_large(Path(source), progress)
    return load_workload(Path(source))
