"""A second kind of target beside the allocator contract: an engine's own scheduler deciding for itself what runs,
while kvfuzz plays the model runner (docs/scheduler.md). First vLLM's v1 ``Scheduler`` with its real
``KVCacheManager``; then SGLang's scheduling pieces (``sglang``).

Modules: ``config`` (a target's configuration), ``vllm_build`` (vLLM imported lazily, the scheduler built offline),
``fake_model`` (the tokens the fake model samples), ``kv_slots`` (the engine-neutral K/V pool, with the content and
exclusive-write checks), ``worker`` (vLLM's worker-side block tables and K/V writes), ``accounting``, ``outputs``
and ``batch`` (the other checks), ``violations``, ``crash`` (how an engine's own exception is told), ``priority``
(requests' priorities under the priority policy), ``session`` (one example's steps and the drain), ``machine`` (the
Hypothesis state machine), ``command`` (``kvfuzz run --scheduler``), ``sglang`` (the SGLang target). vLLM and SGLang
are imported only inside this package, and only when a scheduler is built."""
