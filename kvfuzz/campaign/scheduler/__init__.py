"""Campaigns against a scheduler target (``kvfuzz campaign --scheduler``, docs/scheduler-campaigns.md): batches of
examples, each on a configuration drawn from :mod:`kvfuzz.scheduler.swarm`'s table, their failures told apart by
signature, each distinct one shrunk and saved as a scheduler trace, the known ones counted.

* :mod:`~kvfuzz.campaign.scheduler.target`: what a campaign asks of the target (validate, search, replay), and a
  failure's signature, and which known findings its corpus's traces hold (:mod:`kvfuzz.campaign.known`'s source);
* :mod:`~kvfuzz.campaign.scheduler.loop`: the batches, the findings, the end;
* :mod:`~kvfuzz.campaign.scheduler.isolated`: the same batches in a child process (``--isolate``).
"""
