"""Campaigns: every distinct failure kvfuzz can reach in a time budget, on every core and across machines. What
makes two failures one finding and how one is shrunk live below, in :mod:`kvfuzz.shrink` (``kvfuzz run`` shrinks
with it too).

* :mod:`~kvfuzz.campaign.swarm`: each batch of programs draws its own pool geometry, program length and subset of
  the operation table, within what the allocator builds;
* :mod:`~kvfuzz.campaign.store`: the signature store and example database, local or in Redis;
* :mod:`~kvfuzz.campaign.cluster`: what campaigns on several machines keep in one Redis, the findings included;
* :mod:`~kvfuzz.campaign.known`: the findings the corpus already holds, for every target;
* :mod:`~kvfuzz.campaign.worker`: one worker process's search;
* :mod:`~kvfuzz.campaign.supervisor`: the workers, their failures merged, dead workers replaced, the end;
* :mod:`~kvfuzz.campaign.report`: the distinct-failure table.
"""
