"""Where pipeline-parallel steps spend their time: a short offline run at each pipeline size
(PP=1 and PP=2 by default) with the step timeline on (``hitchllm.timeline``), then a table:
output tok/s, micro-batch sizes, steps in flight, the driver's schedule / round-trip / output
times, and per stage its busy fraction, mean forward and wait per step, idle gaps, host launch
time and answer lag.

    python benchmarks/pp_timeline.py                                # CPU: gloo, a small model
    python benchmarks/pp_timeline.py --model /tmp/llama-8b --device cuda --dtype bfloat16

Without ``--model`` it builds a random Llama of hidden 512 x 8 layers in a temporary directory
(big enough on the CPU that the stages' compute shows). Prompts are random token ids from a
fixed seed; a short warm-up run per engine keeps start-up compiles out of the numbers. On CUDA
decode steps replay CUDA graphs at every pipeline size (a stage's graphs hold its layers, the
transfers run around them); ``--eager`` turns them off everywhere. Reading the table
(docs/distributed.md, "Where pipeline steps lose time"):

- ``busy``: the stage's device time between a step's first and last work, less its waits for
  its peers, over the run's wall time. With M stages overlapping it should approach 1 on every
  stage; one stage near 1 and the other low is an unbalanced split, both low is the driver or
  the hand-over.
- ``fwd ms`` / ``wait ms``: per step, the forward (less waits) and the time spent waiting for
  the previous stage's activations (recv) and for the next stage to take ours (send).
- ``idle ms``: device idle between one step's end and the next one's start (for a plan).
- ``launch ms``: host time to prepare and launch a step; eager CUDA steps whose ``launch ms``
  is close to ``fwd ms`` are host-bound (launches, not the GPU, set the pace).
- ``lag ms``: the step's last device work -> its answer sent to the driver.
- ``graph steps``: steps whose forward replayed a CUDA graph (decode steps on CUDA).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hitchllm import LLM, SamplingParams, timeline


def build_small_model(out: Path, hidden: int = 512, layers: int = 8) -> str:
    """A random Llama with ``layers`` decoder layers of width ``hidden`` (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hitchllm.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
             vocab: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    """Random prompts and output lengths (uniform in the ranges), the same for every run."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(num_prompts):
        n = rng.randint(*input_len)
        prompts.append({"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]})
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(*output_len),
                                     ignore_eos=True))
    return prompts, params


def run(args: argparse.Namespace, pp: int) -> dict:
    """One engine at ``pp`` stages: warm up, then the timed run's summaries."""
    engine_args = dict(pipeline_parallel_size=pp, device=args.device, dtype=args.dtype,
                       block_size=16, seed=args.seed, enforce_eager=args.eager)
    # Every prompt may run at once; no more decode graphs are captured than that takes.
    engine_args["max_num_seqs"] = args.max_num_seqs or args.num_prompts
    if args.max_model_len:
        engine_args["max_model_len"] = args.max_model_len
    with LLM(args.model, **engine_args) as llm:
        vocab = llm.engine.vocab_size
        warm_prompts, warm_params = workload(4, (16, 32), (4, 8), vocab, args.seed + 1)
        llm.generate(warm_prompts, warm_params, use_tqdm=False)
        prompts, params = workload(args.num_prompts, args.input_len, args.output_len, vocab,
                                   args.seed)
        executor = llm.engine.executor
        timeline.drain()
        worker_marks = getattr(executor, "timeline_marks", None)
        if worker_marks is not None:
            worker_marks()  # drop the warm-up's
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        driver = timeline.drain()
        stages = (list(zip(executor.stage_names, worker_marks(), strict=True))
                  if worker_marks is not None else [("in-process runner", driver)])
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(pp=pp, wall=wall, tok_s=tokens / wall, driver=timeline.summarize_driver(driver),
                stages=[timeline.summarize_stage(who, marks, wall) for who, marks in stages])


def print_table(results: list[dict]) -> None:
    print("\n| run | output tok/s | steps | reqs/step mean (min-max) | tokens/step mean | "
          "in flight mean/max | schedule ms | round trip ms | outputs ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        d = r["driver"]
        reqs = d.batch_requests or [0]
        print(f"| PP={r['pp']} | {r['tok_s']:.1f} | {d.steps} | {statistics.mean(reqs):.1f} "
              f"({min(reqs)}-{max(reqs)}) | {statistics.mean(d.batch_tokens or [0]):.1f} | "
              f"{d.mean_in_flight:.2f}/{d.max_in_flight} | {d.schedule_ms:.2f} | "
              f"{d.round_trip_ms:.2f} | {d.outputs_ms:.2f} |")
    print("\n| run | stage | steps | graph steps | busy | fwd ms | wait ms | idle ms | launch ms "
          "| lag ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for s in r["stages"]:
            print(f"| PP={r['pp']} | {s.who} | {s.steps} | {s.graph_steps} | "
                  f"{s.busy_fraction:.2f} | "
                  f"{s.forward_ms:.2f} | {s.wait_ms:.2f} | {s.idle_ms:.2f} | "
                  f"{s.launch_ms:.2f} | {s.answer_lag_ms:.2f} |")
    if len(results) > 1:
        base = results[0]["tok_s"]
        print("\n" + ", ".join(f"PP={r['pp']}: {r['tok_s'] / base:.2f}x of PP={results[0]['pp']}"
                               for r in results[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: build a small Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2],
                        help="pipeline sizes to run, in order (the first is the baseline)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--max-model-len", type=int, default=0, help="default: the model's")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="default: --num-prompts (all run at once)")
    parser.add_argument("--eager", action="store_true",
                        help="no decode CUDA graphs (at every pipeline size)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ[timeline.ENV_VAR] = "1"  # before the engines start: workers inherit it
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = build_small_model(Path(tmp) / "llama-512x8")
        results = []
        for pp in args.pp:
            results.append(run(args, pp))
            # A PP=1 engine ran in this process: hand its memory back before rank 0 of the
            # next engine starts on the same card.
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print_table(results)


if __name__ == "__main__":
    main()
