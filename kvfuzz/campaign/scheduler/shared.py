"""A scheduler campaign's findings in the Redis campaigns share (``--database redis://HOST:PORT/N``), beside the
allocator campaigns' (:mod:`kvfuzz.campaign.cluster`): each new finding's trace, keyed by its signature, with its
machine, time and the campaign's seed, stored by the same atomic script, so a signature is stored once (a later
finding of it replaces the record only with a shorter program). ``kvfuzz findings --database`` lists them and
writes them as scheduler trace files that ``kvfuzz replay`` replays."""

from __future__ import annotations

from kvfuzz.campaign.cluster import ClusterFindings, finding_record
from kvfuzz.scheduler.trace import SchedulerTrace
from kvfuzz.shrink.signature import Signature


def share_finding(url: str, trace: SchedulerTrace, signature: Signature, seed: int, trace_file: str) -> str:
    """Store one finding's trace in the Redis ``url`` names; returns what became of it (``stored``, ``replaced``,
    ``kept``: one of that signature was there, with a program no longer) or, where Redis failed, why (one line: the
    campaign goes on, its trace is in its corpus)."""
    try:
        record = finding_record(trace, signature, seed, None, trace_file)
        return ClusterFindings(url).store(signature.key(), record)
    except Exception as error:  # noqa: BLE001 -- the server failing mid-campaign: said, not fatal
        return f"not stored ({' '.join(str(error).split())})"
