# Recipe for scripts/third_party_env.sh: vLLM 0.10.2's v0 block manager (kvfuzz.adapters.vllm_v0), CPU only.
#
# Sourced by third_party_env.sh, which defines pip_install (every install held at torch==2.13.0) before it calls
# install_engine VERSION.
# vLLM pins a CUDA torch and many serving packages, so vLLM itself goes in with --no-deps and its real import-time
# needs are named here: the adapter imports vllm.core.block_manager (SelfAttnBlockSpaceManager and vllm/core/block/),
# vllm.sequence and vllm.sampling_params, which pull in vllm's config, logger, LoRA and multimodal modules.
VERSIONS=(0.10.2)

install_engine() {
    pip_install --no-deps "vllm==$1"
    pip_install cachetools cbor2 cloudpickle numpy psutil regex setproctitle pyyaml pyzmq packaging transformers \
        msgspec blake3 pillow pybase64
}
