#!/usr/bin/env bash
# Data-parallel serving throughput on a machine with 2 GPUs (issue 19, point 6): the same
# `hitchllm bench serve` load against `hitchllm serve` with one engine (DP=1, GPU 0) and with
# two replicas (DP=2, one GPU each), then the DP=2 / DP=1 output throughput. Model: a
# Qwen3-0.6B-shaped random model (benchmarks/configs/qwen3-0.6b.json, built into $MODEL,
# default /tmp/qwen3-0.6b; CONFIG picks another shape). Load: $NUM_PROMPTS (default 1024)
# streaming requests of random token ids, input 100-1024, output 100-1024 tokens (ignore_eos),
# all sent at once under a cap of $CONCURRENCY (default 512) in flight, seed 0. Each run's
# table and the scaling line are appended to $RESULTS (default benchmarks/RESULTS.md); the
# servers' logs go to /tmp/dp_serve_{1,2}.log. The first GPU test of data parallelism
# (tests/test_dp_engine.py, marked gpu) runs first: it checks that each replica has its own
# GPU and answers like one engine. FIRST_GPU (default 0) shifts the GPUs used (e.g. 2 on a
# 4-GPU machine that runs another benchmark on GPUs 0 and 1).
#   bash benchmarks/dp_serve_gpu.sh      # after installing core + plugins, on 2 GPUs
set -euo pipefail
results="${RESULTS:-benchmarks/RESULTS.md}"
config="${CONFIG:-benchmarks/configs/qwen3-0.6b.json}"
model="${MODEL:-/tmp/$(basename "$config" .json)}"
port="${PORT:-8011}"
num_prompts="${NUM_PROMPTS:-1024}"
concurrency="${CONCURRENCY:-512}"
first="${FIRST_GPU:-0}"
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge $((first + 2)) ] \
    || { echo "needs 2 GPUs" >&2; exit 1; }
CUDA_VISIBLE_DEVICES=$first,$((first + 1)) python3 -m pytest -q tests/test_dp_engine.py -k two_gpus
[ -f "$model/config.json" ] || python3 benchmarks/build_model.py "$config" "$model"

server=""
stop_server() {
    if [ -n "$server" ]; then kill -TERM "$server" 2>/dev/null || true; wait "$server" || true; fi
    server=""
}
trap stop_server EXIT

# bench DP: serve with DP replicas (GPUs FIRST_GPU..FIRST_GPU+DP-1), load it; its output in /tmp/dp_bench_DP.txt.
bench() {
    local dp=$1
    CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + dp - 1))) python3 -m hitchllm.entrypoints.cli serve \
        "$model" --served-model-name bench --port "$port" --dtype bfloat16 --block-size 16 \
        --data-parallel-size "$dp" > "/tmp/dp_serve_$dp.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        kill -0 "$server" 2>/dev/null || { cat "/tmp/dp_serve_$dp.log" >&2; exit 1; }
        sleep 1
    done
    python3 -m hitchllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port/v1" \
        --model bench --num-prompts "$num_prompts" --max-concurrency "$concurrency" \
        --input-len 100 1024 --output-len 100 1024 --vocab-size "${VOCAB:-32000}" --seed 0 \
        --append-results "$results" \
        --label "$(basename "$model") data-parallel-size $dp, bf16" | tee "/tmp/dp_bench_$dp.txt"
    curl -s "http://127.0.0.1:$port/metrics" | grep '^hitchllm:data_parallel_requests_routed' || true
    stop_server
}
tok_per_s() { sed -n 's/.*output \([0-9.]*\) tok\/s.*/\1/p' "/tmp/dp_bench_$1.txt"; }

bench 1
bench 2
one=$(tok_per_s 1)
two=$(tok_per_s 2)
line=$(python3 -c "print(f'DP=2 / DP=1 output throughput: {$two} / {$one} tok/s = {$two / $one:.2f}x (scaling efficiency {$two / $one / 2:.0%})')")
echo "$line"
printf '\n%s (%s, %s, %d prompts, concurrency %d)\n' "$line" "$(basename "$model")" \
    "$(python3 -c 'from hitchllm.entrypoints.machine import describe_machine; print(describe_machine())')" \
    "$num_prompts" "$concurrency" >> "$results"
