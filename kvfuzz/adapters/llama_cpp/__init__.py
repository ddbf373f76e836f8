"""llama.cpp's unified KV cache through llama-cpp-python, behind kvfuzz's contract.

Factories: ``kvfuzz.adapters.llama_cpp:unified_cache`` (block size 1: one cell per block; any number of blocks, the
rest of llama.cpp's 256-cell padding held by a ballast sequence) and ``unified_cache_micro_batches`` (the same, a
decode split into micro-batches of two tokens). llama-cpp-python is imported here, so the import
fails loudly without it; build an environment holding it with ``scripts/third_party_env.sh llama-cpp``. See
``adapter.py`` for the mapping and ``_library.py`` for what is read back.
"""

from kvfuzz.adapters.llama_cpp.adapter import LlamaCppKVCache, unified_cache, unified_cache_micro_batches

__all__ = ["LlamaCppKVCache", "unified_cache", "unified_cache_micro_batches"]
