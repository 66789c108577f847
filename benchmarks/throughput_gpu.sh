#!/usr/bin/env bash
# Offline throughput on the GPU machine (issue #5's workload): a Qwen3-0.6B-shaped model with
# random weights (benchmarks/configs/qwen3-0.6b.json), 256 prompts of random token ids,
# input 100-1024, output 100-1024, seed 0, block size 16, bf16. One run per engine variant, so
# the gain of each piece shows, then the first 128 prompts against Hugging Face generate.
# Every table is appended to $RESULTS (default benchmarks/RESULTS.md).
# With the argument "backends": the auto choice, then every GPU backend forced (fastest of two
# runs each), so the selector's choice can be checked against the fastest. With "fp8":
# TRITON_ATTN with a bf16 KV cache, then with an fp8 (e4m3) one (fastest of two runs each).
# With "deepseek" (issue 18): a DeepSeek-V2-Lite-shaped model with random weights
# (benchmarks/configs/deepseek-v2-lite.json, MLA + MoE, about 31 GB in bf16, built on the GPU
# into $DS_MODEL, default /tmp/deepseek-v2-lite; needs the attention_mla plugin): the same
# workload, then its first 64 prompts against Hugging Face generate in the same run. With
# "deepseek-backends": that model with the auto choice, then each accelerated MLA backend
# forced (fastest of two runs each): the measurement that sets auto mode's MLA order
# (plugins/attention_mla/hitchllm_attention_mla/ranking.py; FLASHINFER_MLA needs the plugin's
# flashinfer extra).
#   bash benchmarks/throughput_gpu.sh [backends|fp8|deepseek|deepseek-backends]
set -euo pipefail
results="${RESULTS:-benchmarks/RESULTS.md}"
if [ "${1:-}" = deepseek ] || [ "${1:-}" = deepseek-backends ]; then
    model="${DS_MODEL:-/tmp/deepseek-v2-lite}"
    config=benchmarks/configs/deepseek-v2-lite.json
else
    model="${MODEL:-/tmp/qwen3-0.6b}"
    config=benchmarks/configs/qwen3-0.6b.json
fi
[ -f "$model/config.json" ] || python3 benchmarks/build_model.py "$config" "$model"
bench() {
    python3 -m hitchllm.entrypoints.cli bench throughput --model "$model" --num-prompts 256 \
        --input-len 100 1024 --output-len 100 1024 --seed 0 --block-size 16 --dtype bfloat16 \
        --append-results "$results" "$@" 2>&1 | grep -v INFO
}
if [ "${1:-}" = fp8 ]; then  # issue 15: fp8 KV cache against bf16 KV, same run, best of two
    for kv in auto fp8; do
        bench --repeat 2 --attention-backend TRITON_ATTN --kv-cache-dtype "$kv" \
            --label "Qwen3-0.6B shape, TRITON_ATTN, kv_cache_dtype=$kv"
    done
    exit 0
fi
if [ "${1:-}" = deepseek ]; then  # issue 18, point 4: MLA (auto: TRITON_MLA) + MoE end to end
    bench --label "DeepSeek-V2-Lite shape, auto backend choice (TRITON_MLA)"
    bench --hf-num-prompts 64 --compare-hf --hf-batch-size 64 \
        --label "DeepSeek-V2-Lite shape, first 64 prompts, vs Hugging Face generate"
    exit 0
fi
if [ "${1:-}" = deepseek-backends ]; then  # issue 18, point 2: rank the MLA backends
    bench --repeat 2 --label "DeepSeek-V2-Lite shape, auto backend choice"
    for name in TRITON_MLA FLASHINFER_MLA; do
        bench --repeat 2 --attention-backend "$name" --label "DeepSeek-V2-Lite shape, $name forced"
    done
    exit 0
fi
if [ "${1:-}" = backends ]; then
    bench --repeat 2 --label "Qwen3-0.6B shape, auto backend choice"
    for name in TRITON_ATTN FLASHINFER FLASH_ATTN; do
        bench --repeat 2 --attention-backend "$name" --label "Qwen3-0.6B shape, $name forced"
    done
    exit 0
fi
bench --label "Qwen3-0.6B shape, all on (TRITON_ATTN, CUDA graphs, fusion, async scheduling)"
bench --no-async-scheduling --label "Qwen3-0.6B shape, without async scheduling"
bench --no-enable-fusion --label "Qwen3-0.6B shape, without fused elementwise ops"
bench --enforce-eager --label "Qwen3-0.6B shape, without CUDA graphs (enforce_eager)"
bench --hf-num-prompts 128 --compare-hf --hf-batch-size 128 \
    --label "Qwen3-0.6B shape, first 128 prompts, vs Hugging Face generate"
