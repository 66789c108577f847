#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after the wheels were staged here with
#   python ../shared/gpu/stage_wheels.py base && python ../shared/gpu/stage_wheels.py flashinfer
#   python ../shared/gpu/stage_wheels.py extra typing-inspection==0.4.5
# and carried over (carry: [".gpu/base", ".gpu/extra", ".gpu/fi"]). Installs the core and
# plugins, runs the GPU tests, then the attention benchmark (split over calls, see below);
# results go to $OUT when set.
# FlashAttention-4 is too large to travel with FlashInfer: install it first on the same warm
# machine (call 1 carries .gpu/fa4a: `bash .gpu/fa4a/stash.sh`; call 2 carries .gpu/fa4b:
# `source .gpu/fa4b/install.sh`), then this script finds it under /tmp/gpu-fa4.
# (The engine's throughput benchmark is benchmarks/throughput_gpu.sh, a call of its own.)
#   [GPU_TEST_FILES="tests/..."] [SKIP_TESTS=1] [SKIP_BENCH=1] bash scripts/gpu_check.sh [--sweep]
set -uo pipefail
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
source .gpu/base/install.sh
# pydantic 2.14 (in base) needs typing-inspection >= 0.4.5 for list-typed config fields.
[ -f .gpu/extra/install.sh ] && source .gpu/extra/install.sh
[ -f .gpu/fi/install.sh ] && source .gpu/fi/install.sh
[ -d /tmp/gpu-fa4 ] && export PYTHONPATH="/tmp/gpu-fa4:/tmp/gpu-fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
plugins="plugins/attention_triton plugins/attention_flashinfer plugins/attention_flash"
python3 -m pip install -q --no-deps --no-build-isolation -e . $(printf -- "-e %s " $plugins)
export PYTHONPATH="$PWD/core:$(printf "$PWD/%s:" $plugins)${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/card.txt"
python3 -m hitchllm.entrypoints.cli backends --dtype bfloat16 2>&1 | tee "$out/backends.txt"
# hypothesis and the server stack are not on the GPU machine: run the GPU-marked files only.
# All of them took more than one 600 s call on a fresh H100 (test_vendor_attention.py alone
# over 300 s, compiling FlashInfer's kernels): GPU_TEST_FILES="..." runs a part per call.
files="${GPU_TEST_FILES:-tests/test_gpu_engine.py tests/test_gpu_graphs.py
    tests/test_triton_attention.py tests/test_vendor_attention.py tests/test_sampler.py
    tests/test_rotary_kernel.py tests/test_split_k.py}"
# shellcheck disable=SC2086  # a list of paths
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -q -m gpu -p no:cacheprovider $files \
    2>&1 | tee "$out/gpu_tests.txt" | tail -5
[ "${SKIP_BENCH:-0}" = 1 ] || python3 benchmarks/attention.py "$@" --results "$out/attention.md" \
    2>&1 | grep -v INFO | tee "$out/attention.txt"
