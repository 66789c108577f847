#!/usr/bin/env bash
# Pipeline parallelism on a 2-GPU machine (issue 19, point 2): PP=2 against PP=1 on a
# Llama-3-8B-shaped model with random weights (benchmarks/configs/llama-8b.json, about 16 GB in
# bf16, built on the GPU into $MODEL, default /tmp/llama-8b), bf16, block size 16, seed 0.
# The offline throughput workload ($NUM_PROMPTS, default 256 prompts of random token ids, input 100-1024, output
# 100-1024), output tok/s of each row:
#   1. PP=1 (one GPU, decode CUDA graphs);
#   2. PP=1 --enforce-eager (one GPU, no graphs: how much of row 1 the graphs make);
#   3. PP=2 (two stages, 16 layers each, each replaying decode graphs of its layers; the engine
#      keeps 2 micro-batches in flight, so each stage computes one while the other stage
#      computes the other, docs/distributed.md).
# Scaling efficiency of PP=2 = (row 3 tok/s) / (2 x row 1 tok/s). The engine's counter
# max_steps_in_flight (2 with PP=2) is printed after the PP=2 row as a check that the stages
# overlapped. Every table is appended to $RESULTS (default benchmarks/RESULTS.md).
#   bash benchmarks/pp_gpu.sh          # after installing core + plugins; needs 2 GPUs
set -euo pipefail
results="${RESULTS:-benchmarks/RESULTS.md}"
model="${MODEL:-/tmp/llama-8b}"
num_prompts="${NUM_PROMPTS:-256}"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
    echo "pp_gpu.sh needs 2 GPUs, $gpus visible" >&2
    exit 1
fi
[ -f "$model/config.json" ] || python3 benchmarks/build_model.py benchmarks/configs/llama-8b.json "$model"
bench() {
    python3 -m hitchllm.entrypoints.cli bench throughput --model "$model" --seed 0 \
        --block-size 16 --dtype bfloat16 --max-model-len 2048 --append-results "$results" \
        --num-prompts "$num_prompts" --input-len 100 1024 --output-len 100 1024 \
        "$@" 2>&1 | grep -v INFO
}
bench -pp 1 --label "Llama-3-8B shape, throughput workload, PP=1"
bench -pp 1 --enforce-eager --label "Llama-3-8B shape, throughput workload, PP=1, eager"
bench -pp 2 --label "Llama-3-8B shape, throughput workload, PP=2 (2 micro-batches in flight)"
# The overlap check: a short PP=2 run that reports the engine's most steps in flight.
python3 benchmarks/pp_overlap.py "$model"
