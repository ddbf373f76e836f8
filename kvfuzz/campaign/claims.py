"""A worker's side of a campaign's findings, every target's: what becomes of a failure's signature when a worker meets
it, and where a finding it saved is shared.

A signature a worker meets is one of three things, decided here and nowhere else:

* **known**: a trace of the campaign's known corpora reproduces it (:mod:`kvfuzz.campaign.known`): counted, and
  credited to the trace recorded closest to where it was met;
* **met before**: another worker (of this campaign, or of any campaign sharing its Redis ``--database``) claimed it
  first: counted, naming who found it;
* **new**: this worker's claim is the first (a regression, a fixed bug's signature reproduced, has a claim of its
  own): it shrinks and saves the finding.

Every meeting that is not known is counted in the signature store too (with Redis: ``kvfuzz:seen``, across
campaigns). The campaign hears of each meeting at once (:class:`~kvfuzz.campaign.messages.Seen`,
:class:`~kvfuzz.campaign.messages.Claimed`), whatever the target: a worker that dies while shrinking has already
said what it claimed.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

from kvfuzz.campaign.cluster import ClusterFindings, Shared, is_redis
from kvfuzz.campaign.known import KnownFindings, Recorded
from kvfuzz.campaign.messages import Claimed, Seen
from kvfuzz.campaign.protocol import WorkerContext
from kvfuzz.campaign.store import SignatureStore, open_store
from kvfuzz.saved.trace import Trace
from kvfuzz.scheduler.trace import SchedulerTrace
from kvfuzz.shrink.signature import Signature


def judge(
    store: SignatureStore,
    known: KnownFindings,
    signature: Signature,
    met: Optional[Recorded],
    record: dict[str, Any],
) -> Optional[str]:
    """What ``signature``, met in the configuration ``met`` (None: not known), is: None when it is new, claimed now
    under ``record``; else where it is known from (the known trace credited, or who claimed it first). Every meeting
    that is not known is counted in ``store``."""
    key = signature.key()
    if key in known:
        return known.credit(key, met)
    store.seen(signature)
    prior = store.claim(known.claimed_as(signature), record)  # a regression: a claim of its own
    if prior is None:
        return None
    return f"found earlier by {prior.get('found_by', 'another worker')}"


class WorkerClaims:
    """One worker's claims in its campaign's signature store (the worker's claims directory, or the Redis
    ``database``), against the known findings its campaign judged before the workers started, and the Redis it shares
    saved findings in."""

    def __init__(self, worker: WorkerContext, database: Optional[str], campaign_seed: Optional[int]) -> None:
        self.worker = worker
        self.known: KnownFindings = worker.known
        self.store: SignatureStore = open_store(database, worker.claims)  # files on this machine, or Redis
        # with Redis: where each saved finding's trace is stored for every machine (kvfuzz findings)
        self.cluster = ClusterFindings(database) if is_redis(database) else None
        self.campaign_seed = campaign_seed  # recorded with each finding stored in Redis

    def claim(self, signature: Signature, met: Optional[Recorded], length: int, trace: Optional[str] = None) -> bool:
        """Whether ``signature``, met in the configuration ``met`` by a program of ``length`` operations (saved as
        found at ``trace``, where it is), is this worker's to shrink and save (:func:`judge`): True after claiming it
        (the campaign told, the reporter shrinking); False for a known finding or one met before (the campaign told
        where it is known from)."""
        reporter, slot, key = self.worker.reporter, self.worker.slot, signature.key()
        record = {
            "signature": signature.to_json(),
            "found_by": f"{socket.gethostname()} pid {os.getpid()}",
            "trace": trace,
        }
        where = judge(self.store, self.known, signature, met, record)
        if where is not None:
            reporter.send(Seen(slot, signature.to_json(), key, where))
            return False
        reporter.send(Claimed(slot, signature.to_json(), key, length, trace))
        reporter.phase = "shrinking"
        return True

    def noted(self, signature: Signature, met: Optional[Recorded], note: Optional[str]) -> Optional[str]:
        """The note a saved finding of ``signature`` met in ``met`` is reported with (a regression's leads it:
        :meth:`~kvfuzz.campaign.known.KnownFindings.noted`)."""
        return self.known.noted(signature.key(), met, note)

    def share(self, trace: Trace | SchedulerTrace, signature: Signature, saved: Optional[str]) -> Optional[Shared]:
        """Store a saved finding's trace in Redis for every machine, with the campaign's seed and this worker's own
        (its local file ``saved``, None where it could not be written); None without Redis."""
        if self.cluster is None:
            return None
        return self.cluster.share(trace, signature, self.campaign_seed, self.worker.seed, saved)
