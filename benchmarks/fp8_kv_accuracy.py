"""fp8 KV-cache accuracy: loss on held-out text and greedy-token agreement, against the cache
in the model's dtype, for fp8_e4m3 and fp8_e5m2 with and without calculated scales.

Loss is ``hitchllm bench perplexity``'s (windows of ``--max-len`` tokens scored through the
engine's prompt logprobs); agreement counts each of 8 code prompts' 16 greedy tokens up to the
first divergence from the reference cache's tokens. Prints one markdown table; the issue's bar
is a loss within 1% of the reference.

    python benchmarks/fp8_kv_accuracy.py [--model PATH] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from hitchllm import LLM, SamplingParams, default_model_path
from hitchllm.entrypoints.bench_perplexity import measure
from hitchllm.entrypoints.machine import describe_machine

HELD_OUT = sorted((Path(__file__).parent.parent / "tests/data/heldout_stdlib").glob("*.py"))
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\ndef main(",
           "class Stack:\n    def __init__(self):\n", "for i in range(10):\n",
           "def read_file(path):\n    with open(path) as f:\n",
           "# Sort a list of numbers\ndef sort(", "if __name__ == '__main__':\n",
           "def add(a, b):\n    return"]
CONFIGS = [("auto", False), ("fp8", False), ("fp8", True), ("fp8_e5m2", False),
           ("fp8_e5m2", True)]


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    same = sum(next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r))
               for r, t in zip(reference, tokens))
    return same / sum(len(r) for r in reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-len", type=int, default=512)
    args = parser.parse_args()
    texts = [p.read_text() for p in HELD_OUT]
    print(f"{describe_machine()}; model {args.model}; held-out {len(texts)} files")
    print("| KV cache | scales | backend | loss (nats/token) | vs auto | bits/byte | greedy "
          "agreement |\n|---|---|---|---|---|---|---|")
    base_loss, base_tokens = None, None
    for kv, calculate in CONFIGS:
        extra = {"calculate_kv_scales": True} if calculate else {}
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=kv, **extra)
        # Scales are calculated from the first step served: the perplexity windows come first.
        result = measure(llm, texts, args.max_len)
        tokens = greedy_tokens(llm)
        if base_loss is None:
            base_loss, base_tokens = result.loss, tokens
        scales = "calculated" if calculate else "checkpoint or 1.0" if kv != "auto" else "-"
        print(f"| {kv} | {scales} | "
              f"{llm.engine.attention_backend.name} | {result.loss:.4f} | "
              f"{(result.loss / base_loss - 1) * 100:+.2f}% | {result.bits_per_byte:.4f} | "
              f"{agreement(base_tokens, tokens):.1%} |")
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
