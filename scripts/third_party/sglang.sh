# Recipe for scripts/third_party_env.sh: SGLang's RadixCache over PagedTokenToKVPoolAllocator and ReqToTokenPool
# (kvfuzz.adapters.sglang) and its scheduling pieces (kvfuzz.scheduler.sglang), CPU only, for each version kvfuzz is
# tested on (docs/scheduler.md, "Versions"). About 2.4 GB.
#
# Sourced by third_party_env.sh, which defines pip_install (every install held at torch==2.13.0) before it calls
# install_engine VERSION.
# SGLang pins a CUDA torch and a full serving stack, so SGLang itself goes in with --no-deps, and the packages are
# named here that the modules the adapter drives import at module level: sglang.srt.mem_cache.{allocator,
# memory_pool, radix_cache, common, allocation}, sglang.srt.managers.schedule_batch (Req), sglang.srt.server_args
# and runtime_context; for the host tier (kvfuzz.adapters.sglang.hicache) sglang.srt.mem_cache.unified_radix_cache,
# pool_host and hybrid_cache, which need nothing more. torchvision is not installed: its wheel does not load beside the CPU torch, and the adapter
# stands in for the two constants SGLang's multimodal configs import from it (kvfuzz/adapters/sglang/_engine.py).
VERSIONS=(0.5.23 0.5.22)

install_engine() {
    local openai
    case "$1" in
        0.5.23) openai=2.8.0 ;;
        0.5.22) openai=2.6.1 ;;
    esac
    pip_install --no-deps "sglang==$1"
    # Versions as the SGLang release pins them, where it pins them (python-dateutil below 3: kvfuzz's plot extra would take a
    # newer one); triton as kvfuzz's triton extra pins it (the
    # sglang-triton kernel runs SGLang's Triton attention, in Triton's interpreter on CPU).
    pip_install numpy orjson psutil pybase64 requests packaging pillow triton==3.9.0 starlette msgspec pydantic pyzmq tqdm \
        IPython aiohttp transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11 dill sentencepiece==0.2.1 \
        compressed-tensors==0.18.0 gguf "openai==$openai" partial_json_parser 'python-dateutil<3'
}
