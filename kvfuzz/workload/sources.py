"""A workload named on the command line: a kvfuzz-workload/1 file, ``constructed:NAME``, ``poisson:RATE[:SEED]``
(the seeded Poisson process), or ``azure-csv:PATH`` (an Azure LLM inference trace, imported as recorded)."""

from __future__ import annotations

from pathlib import Path

from kvfuzz.workload.arrivals import ArrivalShape, poisson
from kvfuzz.workload.constructed import constructed
from kvfuzz.workload.format import Workload, WorkloadError, check_request_count, load_workload
from kvfuzz.workload.importers import import_azure_csv

SOURCES_HELP = "a kvfuzz-workload/1 JSON file, constructed:NAME, poisson:RATE[:SEED] or azure-csv:PATH"


def workload_from(source: str, step_seconds: float = 0.05, requests: int = 60) -> Workload:
    """The workload ``source`` names (``step_seconds``: the step length an imported trace's times are divided by;
    ``requests``: how many the Poisson process makes); raises WorkloadError."""
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
        return import_azure_csv(Path(rest), step_seconds)
    return load_workload(Path(source))
