"""The constants of kvfuzz's vLLM v0 adapter (:mod:`kvfuzz.adapters.vllm_v0`) that its standalone reproducers
(:mod:`kvfuzz.reproducers.vllm_v0`) write out too: importable without vLLM, which the adapter is not."""

ENGINE_WATERMARK = 0.01
"""``SelfAttnBlockSpaceManager``'s default watermark, which the v0 scheduler leaves in place."""

PINNED_NONE_HASH = 0x6B76_6675_7A7A
"""The hash v0 gives "no previous block" in every process (vLLM takes ``hash('None')``, which differs per process)."""

NO_EXTRA_HASH = -0x6B76_6675_7A7A
"""The ``extra_hash`` of a block without a LoRA adapter in every process (vLLM hashes ``None``, whose hash in Python
3.11 is its address)."""
