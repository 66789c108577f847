#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after the wheels were staged here with
#   python ../shared/gpu/stage_wheels.py base && python ../shared/gpu/stage_wheels.py flashinfer
#   python ../shared/gpu/stage_wheels.py extra typing-inspection==0.4.5
# and carried over (carry: [".gpu/base", ".gpu/extra", ".gpu/fi"]). One call: installs the core
# and plugins, runs every GPU test, then the attention benchmark; results go to $OUT when set.
# (The engine's throughput benchmark is benchmarks/throughput_gpu.sh, a call of its own.)
#   bash scripts/gpu_check.sh [--sweep]
set -uo pipefail
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
source .gpu/base/install.sh
# pydantic 2.14 (in base) needs typing-inspection >= 0.4.5 for list-typed config fields.
[ -f .gpu/extra/install.sh ] && source .gpu/extra/install.sh
[ -f .gpu/fi/install.sh ] && source .gpu/fi/install.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/attention_triton
export PYTHONPATH="$PWD/core:$PWD/plugins/attention_triton:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/card.txt"

# hypothesis and the server stack are not on the GPU machine: run the GPU-marked files only.
python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_gpu_engine.py tests/test_gpu_graphs.py tests/test_triton_attention.py \
    tests/test_sampler.py \
    2>&1 | tee "$out/gpu_tests.txt" | tail -5
python3 benchmarks/attention.py "$@" --results "$out/attention.md" 2>&1 | grep -v INFO \
    | tee "$out/attention.txt"
