"""Serving benchmark on this machine: start `hitchllm serve` on a small random Llama (hidden
256, 4 layers; built here, offline) and load it with `hitchllm bench serve`, once with all
requests at once under a concurrency cap and once at a fixed Poisson rate. Prints the tables
and appends them to benchmarks/RESULTS.md.

    python benchmarks/serve_cpu.py [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_process import running_server

from hitchllm.tiny_model import build_tiny_checkpoint

RESULTS = Path(__file__).with_name("RESULTS.md")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "llama-256x4", "LlamaForCausalLM",
                                      hidden_size=256, intermediate_size=768,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=1024)
        with running_server(["--model", str(model), "--served-model-name", "llama-256x4",
                             "--device", "cpu"]) as url:
            runs = [
                ("concurrency 16", ["--max-concurrency", "16"]),
                ("rate 8 req/s", ["--request-rate", "8"]),
            ]
            for label, extra in runs:
                print(f"== {label}")
                subprocess.run(
                    [sys.executable, "-m", "hitchllm.entrypoints.cli", "bench", "serve",
                     "--base-url", f"{url}/v1", "--model", "llama-256x4",
                     "--num-prompts", str(args.num_prompts), "--input-len", "32", "256",
                     "--output-len", "32", "128", "--vocab-size", "500",
                     "--append-results", str(RESULTS),
                     "--label", f"llama-256x4 on CPU, {label}", *extra],
                    check=True)


if __name__ == "__main__":
    main()
