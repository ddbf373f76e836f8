"""The SGLang scheduler target (``kvfuzz run --scheduler sglang``, docs/sglang.md): ``build`` (SGLang
imported lazily, the pools, radix cache and policy built on CPU), ``loop`` (kvfuzz's copy of the Scheduler's loop
around SGLang's SchedulePolicy, PrefillAdder and ScheduleBatch), ``session`` (kvfuzz as the model, every check),
``accounting`` (the token pool's pages), ``command`` (the CLI)."""
