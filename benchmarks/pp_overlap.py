"""Check that pipeline stages overlap: a short run with ``pipeline_parallel_size`` stages (2 by
default) prints the engine's most steps in flight at once (the micro-batches; 1 would mean the
stages took turns) and the output tok/s.

    python benchmarks/pp_overlap.py MODEL [--pp 2] [--device cuda] [--max-model-len 2048]
"""

from __future__ import annotations

import argparse
import time

from hitchllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    prompts = [{"prompt_token_ids": list(range(100 + i, 228 + i))}
               for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    with LLM(args.model, pipeline_parallel_size=args.pp, device=args.device,
             dtype="bfloat16" if args.device == "cuda" else "float32", block_size=16,
             max_model_len=args.max_model_len, seed=0) as llm:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        stats = llm.engine.stats()
    print(f"PP={args.pp}: max_steps_in_flight={stats.max_steps_in_flight}, "
          f"{args.num_prompts * args.output_len / took:.1f} output tok/s")


if __name__ == "__main__":
    main()
