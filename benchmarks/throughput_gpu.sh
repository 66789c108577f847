#!/usr/bin/env bash
# Offline throughput on the GPU machine (issue #5's workload): a Qwen3-0.6B-shaped model with
# random weights (benchmarks/configs/qwen3-0.6b.json), 256 prompts of random token ids,
# input 100-1024, output 100-1024, seed 0, block size 16, bf16. One run per engine variant, so
# the gain of each piece shows, then the first 128 prompts against Hugging Face generate.
# Every table is appended to $RESULTS (default benchmarks/RESULTS.md).
#   bash benchmarks/throughput_gpu.sh            # after installing the core and plugins
set -euo pipefail
model="${MODEL:-/tmp/qwen3-0.6b}"
results="${RESULTS:-benchmarks/RESULTS.md}"
[ -f "$model/config.json" ] || python3 benchmarks/build_model.py benchmarks/configs/qwen3-0.6b.json "$model"
bench() {
    python3 -m hitchllm.entrypoints.cli bench throughput --model "$model" --num-prompts 256 \
        --input-len 100 1024 --output-len 100 1024 --seed 0 --block-size 16 --dtype bfloat16 \
        --append-results "$results" "$@" 2>&1 | grep -v INFO
}
bench --label "Qwen3-0.6B shape, all on (TRITON_ATTN, CUDA graphs, fusion, async scheduling)"
bench --no-async-scheduling --label "Qwen3-0.6B shape, without async scheduling"
bench --no-enable-fusion --label "Qwen3-0.6B shape, without fused elementwise ops"
bench --enforce-eager --label "Qwen3-0.6B shape, without CUDA graphs (enforce_eager)"
bench --hf-num-prompts 128 --compare-hf --hf-batch-size 128 \
    --label "Qwen3-0.6B shape, first 128 prompts, vs Hugging Face generate"
