# Recipe for scripts/third_party_env.sh: vLLM's v1 KV-cache manager (kvfuzz.adapters.vllm_v1) and scheduler
# (kvfuzz.scheduler), CPU only, for each version kvfuzz is tested on (docs/scheduler.md, "Versions").
#
# Sourced by third_party_env.sh, which defines pip_install (every install held at torch==2.13.0) before it calls
# install_engine VERSION.
VERSIONS=(0.33.0 0.34.0)
# vLLM pins a CUDA torch and many serving packages, so vLLM itself goes in with --no-deps and its real import-time
# needs are named here: the modules the adapter imports (vllm.v1.core.kv_cache_manager, block_pool, kv_cache_utils,
# vllm.v1.request) pull in vllm's config, sampling params, tokenizer and structured-output modules at import time.
install_engine() {
    local transformers_below
    case "$1" in
        0.33.0) transformers_below=5.21.0 ;;
        0.34.0) transformers_below=5.23.0 ;;
    esac
    pip_install --no-deps "vllm==$1"
    pip_install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11  # the versions vLLM 0.33.0 and 0.34.0 pin
    pip_install packaging psutil pyzmq urllib3 regex numpy msgspec pydantic cbor2 "transformers>=5.16.1,<$transformers_below" \
        aiohttp requests openai-harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo prometheus_client \
        'fastapi>=0.133.0,<0.137.0' partial_json_parser 'llguidance>=1.7.0,<1.8.0'
    # kvfuzz's vllm-triton kernel (kvfuzz.kernels.vllm_triton) runs vLLM's Triton unified attention: Triton (the
    # version of kvfuzz's triton extra), and einops, which vLLM's attention ops import. kvfuzz.scheduler (kvfuzz run
    # --scheduler vllm-v1) builds vLLM's Scheduler from a model config.json: vLLM inspects the architecture in a
    # subprocess that imports einops. With Triton installed vLLM picks its V2 model runner, whose protocol kvfuzz's
    # worker speaks by default (the V1 runner's is tested too, by VLLM_USE_V2_MODEL_RUNNER=0).
    pip_install triton==3.9.0 einops==0.8.2
}
