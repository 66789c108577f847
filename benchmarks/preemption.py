"""Preemption under a KV cache that overflows: recompute vs swap to host memory (vs auto).

One workload per mode, each in a fresh engine (after an untimed warm-up run):
``--num-prompts`` random prompts of ``--prompt-len`` tokens, all submitted at once, each
generating ``--output-len`` tokens (EOS ignored, greedy), with the KV cache limited to
``--kv-fraction`` of what every request at full length needs (or exactly ``--num-kv-blocks``),
so requests are preempted again and again. Each mode reports output throughput, the
inter-token latency (the gaps between a request's successive tokens as ``LLMEngine.step``
hands them out; p50 and p99 over every gap of every request), the tokens the engine computed
in all (recompute computes preempted tokens again), preemptions and swaps, the blocks copied
to and from host memory, and how many requests got the first mode's tokens.

    python benchmarks/preemption.py [--model DIR] [--device cuda] [--results benchmarks/RESULTS.md]

Without ``--model`` a tiny random Llama is built in a temporary directory (a quick smoke run on
the CPU: ``--num-prompts 8 --prompt-len 32 --output-len 64``).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results_md import append_results, entry_heading

from hitchllm import LLM, SamplingParams
from hitchllm.config import ModelConfig

SECTION = "## Preemption: recompute vs swap to host memory (issue 20)"
ABOUT = ("Reproduce: `python benchmarks/preemption.py --model DIR --device cuda --results "
         "benchmarks/RESULTS.md`. A workload whose KV demand overflows the cache: every "
         "request submitted at once, greedy, EOS ignored. ITL = gaps between a request's "
         "successive tokens as the engine hands them out. Computed tokens: all tokens the "
         "engine scheduled (recompute computes preempted tokens again). In bf16 a mode that "
         "forms other batches (swap resumes requests where recompute refills them) may flip "
         "greedy near-ties, so fewer than all requests may match; the float32 tests "
         "(tests/test_swap_*.py, tests/test_swap_gpu.py) check that the tokens are equal.")


@dataclass
class ModeRun:
    mode: str
    seconds: float
    output_tokens: int
    gaps: list[float]
    computed_tokens: int
    blocks_copied: int
    preemptions: int
    swap_outs: int
    swap_ins: int
    fallbacks: int
    outputs: list[list[int]]

    def percentile(self, q: float) -> float:
        if not self.gaps:
            return 0.0
        ordered = sorted(self.gaps)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(model: str, mode: str, prompts: list[list[int]], args: argparse.Namespace,
             num_kv_blocks: int) -> ModeRun:
    llm = LLM(model, device=args.device, dtype=args.dtype, block_size=args.block_size,
              num_kv_blocks=num_kv_blocks, max_model_len=args.prompt_len + args.output_len,
              max_num_seqs=args.max_num_seqs, preemption_mode=mode,
              swap_space=args.swap_space, enforce_eager=args.enforce_eager)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up (kernels, CUDA graphs' first replays) outside the timing.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    base = engine.stats()
    computed = copied = 0
    schedule = engine.scheduler.schedule

    def counting():
        nonlocal computed, copied
        plan = schedule()
        computed += plan.total_num_scheduled_tokens
        copied += len(plan.swap_out) + len(plan.swap_in)
        return plan

    engine.scheduler.schedule = counting
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    seen = dict.fromkeys(ids, 0)
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    gaps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            new = n - seen[out.request_id]
            if new <= 0:
                continue
            if out.request_id in last:  # the first token's wait is TTFT, not a gap
                gaps += [(now - last[out.request_id]) / new] * new
            else:
                gaps += [0.0] * (new - 1)
            last[out.request_id] = now
            seen[out.request_id] = n
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    engine.scheduler.schedule = schedule
    stats = engine.stats()
    run = ModeRun(mode, seconds, sum(seen.values()), gaps, computed, copied,
                  stats.num_preemptions - base.num_preemptions,
                  stats.num_swap_outs - base.num_swap_outs, stats.num_swap_ins - base.num_swap_ins,
                  stats.num_swap_fallbacks - base.num_swap_fallbacks,
                  [tokens[i] for i in ids])
    llm.engine.close()
    del llm, engine
    gc.collect()
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return run


def main(argv: list[str] | None = None) -> list[ModeRun]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--modes", nargs="+", default=["recompute", "swap", "auto"],
                        choices=["recompute", "swap", "auto"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-fraction", type=float, default=0.25,
                        help="KV cache size as a fraction of all requests' full-length need")
    parser.add_argument("--num-kv-blocks", type=int,
                        help="exact KV blocks (overrides the fraction)")
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args(argv)

    blocks_per_request = -(-(args.prompt_len + args.output_len) // args.block_size)
    num_kv_blocks = args.num_kv_blocks or max(
        blocks_per_request, int(args.kv_fraction * args.num_prompts * blocks_per_request))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from hitchllm.tiny_model import build_tiny_checkpoint

            model = str(build_tiny_checkpoint(
                Path(tmp) / "llama", "LlamaForCausalLM",
                max_position_embeddings=max(1024, args.prompt_len + args.output_len)))
        rng = random.Random(0)
        vocab = ModelConfig.from_pretrained(model).vocab_size
        prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.num_prompts)]
        # Untimed: kernels compile on first use, and the first timed mode would pay for it.
        run_mode(model, args.modes[0], prompts[: max(1, len(prompts) // 8)], args,
                 num_kv_blocks)
        runs = [run_mode(model, mode, prompts, args, num_kv_blocks) for mode in args.modes]

    header = ("| mode | output tok/s | ITL p50 ms | ITL p99 ms | seconds | computed tokens | "
              "preemptions | swap outs / ins | blocks copied | fell back to recompute | "
              "requests with the first mode's tokens |")
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        same = sum(a == b for a, b in zip(run.outputs, runs[0].outputs, strict=True))
        rows.append(
            f"| {run.mode} | {run.output_tokens / run.seconds:.1f} | "
            f"{1e3 * run.percentile(0.5):.1f} | {1e3 * run.percentile(0.99):.1f} | "
            f"{run.seconds:.2f} | {run.computed_tokens} | {run.preemptions} | "
            f"{run.swap_outs} / {run.swap_ins} | {run.blocks_copied} | {run.fallbacks} | "
            f"{same}/{len(run.outputs)} |")
    print("\n".join(rows))

    if args.results:
        argv = sys.argv[1:] if argv is None else argv
        kept = [a for i, a in enumerate(argv) if a != "--results"
                and (i == 0 or argv[i - 1] != "--results")]
        command = " ".join(["python benchmarks/preemption.py", *kept])
        lines = entry_heading(
            f"preemption, {args.num_prompts} prompts of {args.prompt_len} tokens, "
            f"{args.output_len} new, {num_kv_blocks} KV blocks of {args.block_size} "
            f"({num_kv_blocks / (args.num_prompts * blocks_per_request):.0%} of the demand), "
            f"swap space {args.swap_space} GiB", command)
        append_results(args.results, lines + rows, SECTION, ABOUT)
    return runs


if __name__ == "__main__":
    main()
