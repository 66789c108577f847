"""Build a random-weight checkpoint from a config.json (e.g. benchmarks/configs/qwen3-0.6b.json)
with Hugging Face transformers, plus a word-level tokenizer over the whole vocabulary (token
``i`` is the word ``w<i>``), for benchmarks that need a real model's shape but not its weights.
Random weights sample ids from the whole vocabulary, so every token must decode to text: a
served benchmark streams one text delta per token, as it does with a real model and tokenizer
(``--tokenizer bpe`` gives hitchllm's 512-token offline tokenizer instead, under which most
sampled ids decode to nothing).

    python benchmarks/build_model.py benchmarks/configs/qwen3-0.6b.json /tmp/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from hitchllm.tiny_model import CHAT_TEMPLATE, build_tokenizer


def build_word_tokenizer(vocab_size: int, eos_token_id: int | None) -> PreTrainedTokenizerFast:
    """Token ``i`` is the word ``w<i>`` (decoded texts are the words joined by spaces);
    anything else encodes as the EOS word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    eos = f"w{eos_token_id or 0}"
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(config_file: Path, out: Path, seed: int = 0, tokenizer: str = "word") -> Path:
    """Write ``out`` (config, random bf16 safetensors, tokenizer) and return it."""
    raw = json.loads(config_file.read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    words = build_word_tokenizer(config.vocab_size, eos) if tokenizer == "word" else None
    (words or build_tokenizer()).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", choices=["word", "bpe"], default="word")
    args = parser.parse_args()
    print(build(args.config, args.out, args.seed, args.tokenizer))


if __name__ == "__main__":
    main()
