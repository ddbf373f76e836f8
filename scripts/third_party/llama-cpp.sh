# Recipe for scripts/third_party_env.sh: llama.cpp's unified KV cache through llama-cpp-python 0.3.36
# (kvfuzz.adapters.llama_cpp), CPU only.
#
# Sourced by third_party_env.sh, which defines pip_install (every install held at torch==2.13.0) before it calls
# install_engine VERSION.
# llama-cpp-python has no binary wheel on the package index: pip builds llama.cpp from the source distribution with
# scikit-build-core, CMake and the system's C++ compiler. The CMake options keep that build to the library alone (no
# tests, examples, server, tools, curl or OpenMP, and no multimodal library: LLAVA_BUILD=OFF leaves out mtmd, about a
# quarter of the build; portable code rather than this CPU's) and use every core; pip caches the wheel it built, so
# a second environment installs it at once (whatever CMAKE_ARGS say then: the cache is keyed by the download).
# llama-cpp-python goes in with --no-deps, its runtime needs named here, and gguf writes the tiny model the adapter
# loads (kvfuzz.adapters.llama_cpp.model).
VERSIONS=(0.3.36)

install_engine() {
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        pip_install --no-deps "llama-cpp-python==$1"
    pip_install numpy typing-extensions diskcache jinja2 gguf
}
