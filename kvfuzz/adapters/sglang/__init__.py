"""SGLang's RadixCache over PagedTokenToKVPoolAllocator and ReqToTokenPool, behind kvfuzz's contract.

Factories: ``kvfuzz.adapters.sglang:radix_cache`` (namespaces as extra_key and cache_salt) and
``radix_cache_one_namespace`` (every request in the empty namespace). SGLang is imported at the first allocator built,
not here; build an environment holding it with ``scripts/third_party_env.sh sglang``. See ``adapter.py`` for the
mapping.
"""

from kvfuzz.adapters.sglang.adapter import (
    SGLangRadixAllocator,
    radix_cache,
    radix_cache_lora,
    radix_cache_one_namespace,
)

__all__ = ["SGLangRadixAllocator", "radix_cache", "radix_cache_lora", "radix_cache_one_namespace"]
