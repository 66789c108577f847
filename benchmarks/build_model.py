"""Build a random-weight checkpoint from a config.json (e.g. benchmarks/configs/qwen3-0.6b.json)
with Hugging Face transformers, plus hitchllm's small offline tokenizer, for benchmarks that
need a real model's shape but not its weights.

    python benchmarks/build_model.py benchmarks/configs/qwen3-0.6b.json /tmp/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hitchllm.tiny_model import build_tokenizer


def build(config_file: Path, out: Path, seed: int = 0) -> Path:
    """Write ``out`` (config, random bf16 safetensors, tokenizer) and return it."""
    raw = json.loads(config_file.read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.config, args.out, args.seed))


if __name__ == "__main__":
    main()
