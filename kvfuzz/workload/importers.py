"""Importers of public LLM serving traces into recorded workloads.

``azure-csv``: the Azure LLM inference trace (Azure Public Dataset, 2023 and 2024), a CSV file with the header
``TIMESTAMP,ContextTokens,GeneratedTokens``: one row per request, its arrival time (``2023-11-16 18:15:46.6805900``,
fractions of a second to any number of digits), its prompt length and its output length in tokens. A request's
arrival step is the seconds since the first request divided by ``step_seconds``, rounded down; its prompt is
``ContextTokens`` tokens derived from its row number (the trace records lengths, not text), so no two requests share
a prefix. The workload is labelled recorded, with the file and the format as its provenance.
"""

from __future__ import annotations

import csv
import datetime
from pathlib import Path
from typing import Optional

from kvfuzz.workload.format import (
    FORMAT,
    Workload,
    WorkloadError,
    check_file_size,
    check_request_count,
    parse_workload,
)

AZURE_FORMAT = "azure-llm-inference-csv"
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _timestamp(text: str, where: str) -> datetime.datetime:
    whole, _, fraction = text.strip().partition(".")
    try:
        moment = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise WorkloadError(f"{where}: TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'") from None
    if fraction and not fraction.isdigit():
        raise WorkloadError(f"{where}: TIMESTAMP {text!r} has a malformed fraction of a second")
    return moment + datetime.timedelta(microseconds=int((fraction + "000000")[:6]) if fraction else 0)


def _count(text: str, column: str, where: str, minimum: int) -> int:
    if not text.strip().isdigit() or int(text) < minimum:
        raise WorkloadError(f"{where}: {column} must be an integer >= {minimum}, found {text!r}")
    return int(text)


def import_azure_csv(path: Path, step_seconds: float, max_requests: Optional[int] = None) -> Workload:
    """The recorded workload of an Azure LLM inference trace file (its first ``max_requests`` rows when given);
    raises :class:`~kvfuzz.workload.format.WorkloadError` naming the row and column of a malformed entry."""
    if not step_seconds > 0:
        raise WorkloadError(f"the step length must be > 0 seconds, got {step_seconds}")
    check_file_size(path)
    try:
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError) as error:
        raise WorkloadError(f"{path}: {error}") from error
    if not rows or tuple(cell.strip() for cell in rows[0]) != AZURE_COLUMNS:
        found = ",".join(rows[0]) if rows else "an empty file"
        raise WorkloadError(
            f"{path}: not an Azure LLM inference trace: expected the header {','.join(AZURE_COLUMNS)}, found {found}"
        )
    rows = rows[1 : (max_requests + 1) if max_requests else None]
    check_request_count(len(rows), str(path))
    entries = []
    for number, row in enumerate(rows, start=2):
        where = f"{path} line {number}"
        if len(row) != len(AZURE_COLUMNS):
            raise WorkloadError(f"{where}: expected {len(AZURE_COLUMNS)} columns, found {len(row)}")
        entries.append(
            (
                _timestamp(row[0], where),
                _count(row[1], "ContextTokens", where, 1),
                _count(row[2], "GeneratedTokens", where, 1),
                number,
            )
        )
    if not entries:
        raise WorkloadError(f"{path}: the trace holds no requests")
    start = min(moment for moment, *_ in entries)
    requests = [
        {
            "id": f"line{number}",
            "arrival": int((moment - start).total_seconds() / step_seconds),
            "prompt_len": context,
            "output_len": generated,
        }
        for moment, context, generated, number in entries
    ]
    return parse_workload(
        {
            "format": FORMAT,
            "name": Path(path).stem,
            "origin": "recorded",
            "provenance": {"kind": "recorded", "source": str(path), "trace_format": AZURE_FORMAT},
            "description": f"{len(requests)} requests imported from {path} ({AZURE_FORMAT}), "
            f"one step = {step_seconds:g} s",
            "requests": requests,
        },
        str(path),
    )
