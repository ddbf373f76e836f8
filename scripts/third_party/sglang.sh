# Recipe for scripts/third_party_env.sh: SGLang 0.5.23's RadixCache over PagedTokenToKVPoolAllocator and
# ReqToTokenPool (kvfuzz.adapters.sglang), CPU only. About 2.4 GB.
#
# Sourced by third_party_env.sh, which defines pip_install (every install held at torch==2.13.0).
# SGLang pins a CUDA torch and a full serving stack, so SGLang itself goes in with --no-deps, and the packages are
# named here that the modules the adapter drives import at module level: sglang.srt.mem_cache.{allocator,
# memory_pool, radix_cache, common, allocation}, sglang.srt.managers.schedule_batch (Req), sglang.srt.server_args
# and runtime_context; for the host tier (kvfuzz.adapters.sglang.hicache) sglang.srt.mem_cache.unified_radix_cache,
# pool_host and hybrid_cache, which need nothing more. torchvision is not installed: its wheel does not load beside the CPU torch, and the adapter
# stands in for the two constants SGLang's multimodal configs import from it (kvfuzz/adapters/sglang/_engine.py).
pip_install --no-deps sglang==0.5.23
# Versions as SGLang 0.5.23 pins them, where it pins them (python-dateutil below 3: kvfuzz's plot extra would take a
# newer one); triton as kvfuzz's triton extra pins it (the
# sglang-triton kernel runs SGLang's Triton attention, in Triton's interpreter on CPU).
pip_install numpy orjson psutil pybase64 requests packaging pillow triton==3.9.0 starlette msgspec pydantic pyzmq tqdm \
    IPython aiohttp transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11 dill sentencepiece==0.2.1 \
    compressed-tensors==0.18.0 gguf openai==2.8.0 partial_json_parser 'python-dateutil<3'
