"""A second kind of target beside the allocator contract: vLLM's own v1 ``Scheduler``, with its real
``KVCacheManager``, deciding for itself what runs, while kvfuzz plays the model runner (docs/scheduler.md).

Modules: ``config`` (a target's configuration), ``vllm_build`` (vLLM imported lazily, the scheduler built offline),
``fake_model`` (the tokens the fake model samples), ``worker`` (worker-side block tables, K/V writes, the content
check), ``accounting``, ``outputs`` and ``batch`` (the other checks), ``violations``, ``crash`` (how an engine's
own exception is told), ``priority`` (requests' priorities under the priority policy), ``session`` (one example's
steps and the drain), ``machine`` (the Hypothesis state machine), ``command`` (``kvfuzz run --scheduler``). vLLM is
imported only inside this package, and only when a scheduler is built."""
