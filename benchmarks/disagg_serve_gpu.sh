#!/usr/bin/env bash
# Disaggregated prefill/decode vs data parallelism on a machine with 2 GPUs (issue 20,
# point 4): the same `hitchllm bench serve` load, Poisson arrivals at $RATE req/s (default 2),
# $NUM_PROMPTS (default 200) streaming requests of random token ids with 2k-8k prompt tokens
# and 256 output tokens (ignore_eos), seed 0, against
#   1. `hitchllm serve -dp 2`: two ordinary engines, one GPU each, behind the balancer;
#   2. `hitchllm serve-disagg` in front of a prefill instance (--kv-role producer, GPU 0) and
#      a decode instance (--kv-role consumer, GPU 1), KV moved by $CONNECTOR (default
#      torch_distributed: NCCL send/recv GPU to GPU; shared_memory goes through /dev/shm).
# Each run's table (TTFT and ITL p50/p90/p99, throughput) is appended to $RESULTS (default
# benchmarks/RESULTS.md), then, for the disaggregated run, the KV-transfer line read from the
# instances' /metrics (benchmarks/kv_transfer_report.py: transfer time and bytes per request,
# failed loads and fallbacks, prompt tokens computed on the decode instance). Model: a
# Qwen3-0.6B-shaped random model (benchmarks/configs/qwen3-0.6b.json, built into $MODEL,
# default /tmp/qwen3-0.6b; CONFIG picks another shape). Logs: /tmp/disagg_*.log. The GPU test
# of the connector (tests/test_kvx_gpu.py) runs first. FIRST_GPU (default 0) shifts the two
# GPUs used.
#   bash benchmarks/disagg_serve_gpu.sh      # after installing core + plugins, on 2 GPUs
set -euo pipefail
results="${RESULTS:-benchmarks/RESULTS.md}"
config="${CONFIG:-benchmarks/configs/qwen3-0.6b.json}"
model="${MODEL:-/tmp/$(basename "$config" .json)}"
rate="${RATE:-2}"
num_prompts="${NUM_PROMPTS:-200}"
connector="${CONNECTOR:-torch_distributed}"
first="${FIRST_GPU:-0}"; second=$((first + 1))
port=8021; prefill_port=8022; decode_port=8023
engine=(--dtype bfloat16 --block-size 16 --max-model-len 8704)
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge $((second + 1)) ] \
    || { echo "needs 2 GPUs" >&2; exit 1; }
CUDA_VISIBLE_DEVICES=$first,$second python3 -m pytest -q tests/test_kvx_gpu.py
[ -f "$model/config.json" ] || python3 benchmarks/build_model.py "$config" "$model"

pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
}
trap stop_all EXIT

# start NAME PORT COMMAND...: run COMMAND in the background, wait until PORT is healthy.
start() {
    local name=$1 p=$2; shift 2
    "$@" > "/tmp/disagg_$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 900); do
        curl -sf "http://127.0.0.1:$p/health" > /dev/null && return
        kill -0 "${pids[-1]}" 2>/dev/null || { cat "/tmp/disagg_$name.log" >&2; exit 1; }
        sleep 1
    done
    echo "$name did not come up" >&2; exit 1
}

bench() {
    python3 -m hitchllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port/v1" \
        --model bench --num-prompts "$num_prompts" --request-rate "$rate" \
        --input-len 2048 8192 --output-len 256 256 --vocab-size "${VOCAB:-32000}" --seed 0 \
        --append-results "$results" --label "$(basename "$model") $1, bf16"
}

serve=(python3 -m hitchllm.entrypoints.cli serve "$model" --served-model-name bench "${engine[@]}")
start dp2 "$port" env CUDA_VISIBLE_DEVICES=$first,$second "${serve[@]}" --port "$port" \
    --data-parallel-size 2
bench "2 ordinary instances (serve -dp 2), request rate $rate"
stop_all

# 2k-8k prompts of this model stage 0.2-0.6 GiB of KV each on the producer until the consumer
# pulls them: allow 8 GiB (the default 2 GiB holds only the first few while the first transfer
# opens its NCCL communicator).
kv=(--kv-connector "$connector" --kv-connector-extra-config '{"port": 14579, "max_staged_gib": 8}')
[ "$connector" = shared_memory ] && kv=(--kv-connector shared_memory)
start prefill "$prefill_port" env CUDA_VISIBLE_DEVICES=$first "${serve[@]}" --port "$prefill_port" \
    --kv-role producer "${kv[@]}"
start decode "$decode_port" env CUDA_VISIBLE_DEVICES=$second "${serve[@]}" --port "$decode_port" \
    --kv-role consumer "${kv[@]}"
start router "$port" python3 -m hitchllm.entrypoints.cli serve-disagg --port "$port" \
    --prefill "http://127.0.0.1:$prefill_port" --decode "http://127.0.0.1:$decode_port"
bench "1 prefill + 1 decode instance ($connector), request rate $rate"
python3 benchmarks/kv_transfer_report.py --producer "http://127.0.0.1:$prefill_port" \
    --consumer "http://127.0.0.1:$decode_port" --results "$results"
