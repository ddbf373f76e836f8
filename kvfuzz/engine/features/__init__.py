"""The engine's features: the capability-specific parts of its lifecycle, one module per feature, each holding its
slice of the expected state, its handlers of the engine's events and the calls to the checks it needs. The engine
(:mod:`kvfuzz.engine.engine`) builds a feature and subscribes its handlers only when the allocator declares it. A
capability that brings an operation holds the operation too, as a function of the engine core, with its rows of the
operation table (``ROWS``, which :mod:`kvfuzz.program.operations` assembles; a row's ``needs`` is the declaration that
guards it) and the checks that operation alone triggers:

* :mod:`~kvfuzz.engine.features.forks`: fork;
* :mod:`~kvfuzz.engine.features.preemption`: preempt;
* :mod:`~kvfuzz.engine.features.swap`: swap_out and swap_in;
* :mod:`~kvfuzz.engine.features.rollback`: rollback;
* :mod:`~kvfuzz.engine.features.eviction`: evict, evict_blocks and reset_cache;

and the features that subscribe to events:

* :mod:`~kvfuzz.engine.features.scheduling`: a freed sequence's scheduled writes (and that policy's combinations);
* :mod:`~kvfuzz.engine.features.prefix_cache`: the complete-caching debt, and its checks of invariant 14;
* :mod:`~kvfuzz.engine.features.host_tier`: the host tier's transfers and asynchronous loads (and the rows of
  land_loads and resume, which call the engine's methods of those names);
* :mod:`~kvfuzz.engine.features.lookahead`: look-ahead blocks;
* :mod:`~kvfuzz.engine.features.copies`: deduplicated copy-on-write copies and remaps at step completion;
* :mod:`~kvfuzz.engine.features.groups`: KV-cache groups' tables (and the checks only they need) and the blocks a
  refused grow drops out of its window.
"""
