"""Offline throughput on this machine's CPU: hitchllm vs Hugging Face generate on a small random
Llama (hidden 256, 4 layers, 8/4 heads; built here, offline), 32 prompts, the fastest of three
runs on each side (a small shared VM is noisy). hitchllm runs with the backend auto mode picks
(CPU_ATTN where hitchllm-attention-cpu is installed), then once more with the core's TORCH
backend so the kernel's share of the gain shows. Prints the tables and appends them to
benchmarks/RESULTS.md.

    python benchmarks/throughput_cpu.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hitchllm.entrypoints.cli import main as cli
from hitchllm.tiny_model import build_tiny_checkpoint

RESULTS = Path(__file__).with_name("RESULTS.md")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "llama-256x4", "LlamaForCausalLM",
                                      hidden_size=256, intermediate_size=768,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=2048)
        workload = ["bench", "throughput", "--model", str(model), "--device", "cpu",
                    "--num-prompts", "32", "--input-len", "64", "512", "--output-len", "64",
                    "256", "--repeat", "3", "--append-results", str(RESULTS),
                    "--label", "llama-256x4 (random weights, benchmarks/throughput_cpu.py)"]
        cli([*workload, "--compare-hf", "--hf-batch-size", "32"])
        cli([*workload, "--attention-backend", "TORCH"])


if __name__ == "__main__":
    main()
