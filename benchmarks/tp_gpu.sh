#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine (issue 19, point 6): a Llama-3-8B-shaped model with
# random weights (benchmarks/configs/llama-8b.json, about 16 GB in bf16, built on the GPU into
# $MODEL, default /tmp/llama-8b), bf16, block size 16, seed 0.
#   1. the offline throughput workload (256 prompts of random token ids, input 100-1024,
#      output 100-1024) with TP=1, then TP=2: output tok/s of each; scaling efficiency =
#      (TP=2 tok/s) / (2 x TP=1 tok/s);
#   2. batch-1 decode latency: one request of 128 prompt tokens and 512 output tokens with
#      TP=1, then TP=2 (ms per output token = 1000 / output tok/s of that row).
# Every table is appended to $RESULTS (default benchmarks/RESULTS.md).
#   bash benchmarks/tp_gpu.sh          # after installing core + plugins; needs 2 GPUs
set -euo pipefail
results="${RESULTS:-benchmarks/RESULTS.md}"
model="${MODEL:-/tmp/llama-8b}"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
    echo "tp_gpu.sh needs 2 GPUs, $gpus visible" >&2
    exit 1
fi
[ -f "$model/config.json" ] || python3 benchmarks/build_model.py benchmarks/configs/llama-8b.json "$model"
bench() {
    python3 -m hitchllm.entrypoints.cli bench throughput --model "$model" --seed 0 \
        --block-size 16 --dtype bfloat16 --max-model-len 2048 --append-results "$results" \
        "$@" 2>&1 | grep -v INFO
}
for tp in 1 2; do
    bench -tp "$tp" --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
        --label "Llama-3-8B shape, throughput workload, TP=$tp"
done
for tp in 1 2; do
    bench -tp "$tp" --num-prompts 1 --input-len 128 128 --output-len 512 512 --repeat 3 \
        --label "Llama-3-8B shape, batch-1 decode (128 in, 512 out), TP=$tp"
done
