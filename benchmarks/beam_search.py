"""Beam search: KV blocks with copy-on-write forks vs a full copy per fork, and (on CUDA)
throughput against Hugging Face transformers' beam search on the same prompts.

Memory (any device; exact block counts): each width runs twice on the same random prompts
(``--prompt-len`` tokens, ``--max-tokens`` new tokens, EOS ignored so every beam runs to the
end). ``cow`` is hitchllm's beam search: a fork shares all of its parent's blocks and copies
only the partial block it writes into. ``full copy`` patches the KV cache manager so that a
fork copies every block of its parent (on the device too), as a cache without reference
counts must. The peak is the most blocks in use after any step's allocation; the beams must
come out the same.

Throughput (``--hf``, meant for CUDA): hitchllm's beam search against ``generate(num_beams=
width, do_sample=False)`` on the same prompts (all in one batch), each timed after a warm-up;
output tok/s counts ``prompts x max_tokens``.

    python benchmarks/beam_search.py [--model DIR] [--hf] [--results benchmarks/RESULTS.md]

Without ``--model`` a tiny random Llama (hidden 64, 2 layers, max 1024 positions) is built
in a temporary directory.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results_md import append_results, entry_heading

from hitchllm import LLM, BeamSearchParams
from hitchllm.kv_cache import KVCacheManager
from hitchllm.request import Request

SECTION = "## Beam search: copy-on-write KV blocks (issue 23)"
ABOUT = ("Reproduce: `python benchmarks/beam_search.py --results benchmarks/RESULTS.md` "
         "(memory; add `--model DIR --hf` on a GPU for throughput against transformers). "
         "Peak KV blocks in use during the search of all prompts, EOS ignored.")


@dataclass
class MemoryRun:
    peak_blocks: int
    blocks_copied: int
    outputs: list


def full_copy_fork(self: KVCacheManager, parent: Request, child: Request) -> None:
    """``KVCacheManager.fork`` as a cache without reference counts must do it: the child gets
    a fresh copy of every block of its parent (copied on the device by the runner)."""
    pid, cid = parent.request_id, child.request_id
    src = self._blocks.get(pid, [])
    fresh = self.block_pool.get_new_blocks(len(src))
    self._block_copies += [(s.block_id, d.block_id) for s, d in zip(src, fresh)]
    self._blocks[cid] = fresh
    self._block_ids[cid] = [b.block_id for b in fresh]


def measure(llm: LLM, prompts: list[dict], params: BeamSearchParams) -> MemoryRun:
    """Run the search, recording the peak of blocks in use and the blocks copied."""
    scheduler, kv = llm.engine.scheduler, llm.engine.kv_cache
    schedule = scheduler.schedule
    peak, copied = 0, 0

    def recording():
        nonlocal peak, copied
        plan = schedule()
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        copied += len(plan.block_copies)
        return plan

    scheduler.schedule = recording
    try:
        outputs = llm.beam_search(prompts, params)
    finally:
        scheduler.schedule = schedule
    return MemoryRun(peak, copied, outputs)


def memory_rows(llm: LLM, prompts: list[dict], widths: list[int], max_tokens: int) -> list[str]:
    rows = []
    for width in widths:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        cow = measure(llm, prompts, params)
        original = KVCacheManager.fork
        KVCacheManager.fork = full_copy_fork
        try:
            full = measure(llm, prompts, params)
        finally:
            KVCacheManager.fork = original
        same = all([s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
                   for a, b in zip(cow.outputs, full.outputs))
        rows.append(f"| {width} | {cow.peak_blocks} | {full.peak_blocks} | "
                    f"{full.peak_blocks / cow.peak_blocks:.2f}x | {cow.blocks_copied} | "
                    f"{full.blocks_copied} | {'yes' if same else 'NO'} |")
        print(rows[-1], flush=True)
    return rows


def throughput_rows(llm: LLM, model_dir: str, prompts: list[list[int]], widths: list[int],
                    max_tokens: int) -> list[str]:
    import torch
    import transformers

    device = llm.engine.device
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=llm.engine.dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    rows = []
    for width in widths:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        # EOS ignored as hitchllm's ignore_eos does (generate() would fall back to the
        # checkpoint's EOS for an unset one).
        hf.generation_config.eos_token_id = None
        cfg = transformers.GenerationConfig(
            num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)

        def run_hf(cfg=cfg):
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids),
                                   generation_config=cfg)

        def run_ours(params=params):
            return llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)

        timings = {}
        for name, fn in (("hitchllm", run_ours), ("hf", run_hf)):
            fn()  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - start, result)
        ours_s, ours = timings["hitchllm"]
        hf_s, hf_out = timings["hf"]
        best = hf_out[::width, len(prompts[0]):].tolist()
        same = sum(o.sequences[0].output_token_ids == b for o, b in zip(ours, best))
        tokens = len(prompts) * max_tokens
        rows.append(f"| {width} | {len(prompts)} | {tokens / ours_s:.1f} | {tokens / hf_s:.1f} | "
                    f"{hf_s / ours_s:.2f}x | {same}/{len(prompts)} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf", action="store_true",
                        help="also time transformers' beam search (meant for CUDA)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--results", type=Path, help="append the tables to this Markdown file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from hitchllm.tiny_model import build_tiny_checkpoint

            model = str(build_tiny_checkpoint(Path(tmp) / "llama", "LlamaForCausalLM",
                                              max_position_embeddings=1024))
        max_model_len = args.prompt_len + args.max_tokens
        max_num_seqs = max(args.widths) * args.num_prompts
        # Room for the full-copy baseline: parents and their copies at once, every beam at
        # full length.
        num_kv_blocks = 2 * max_num_seqs * -(-max_model_len // args.block_size)
        llm = LLM(model, block_size=args.block_size, dtype=args.dtype,
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  num_kv_blocks=num_kv_blocks)
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.num_prompts)]
        print("| width | peak blocks, CoW | peak blocks, full copy | saving | "
              "blocks copied, CoW | blocks copied, full copy | same beams |")
        mem = memory_rows(llm, [{"prompt_token_ids": p} for p in prompts], args.widths,
                          args.max_tokens)
        thr = throughput_rows(llm, model, prompts, args.widths, args.max_tokens) \
            if args.hf else []

    if args.results:
        command = "python benchmarks/beam_search.py " + " ".join(
            a for a in __import__("sys").argv[1:] if not a.startswith("--results")
            and a != str(args.results))
        lines = entry_heading(
            f"beam search KV blocks, {args.num_prompts} prompts of {args.prompt_len} tokens, "
            f"{args.max_tokens} new, block size {args.block_size}", command.strip())
        lines += ["| beam width | peak blocks, CoW | peak blocks, full copy per fork | "
                  "full copy / CoW | blocks copied, CoW | blocks copied, full copy | "
                  "same beams |", "|---|---|---|---|---|---|---|", *mem]
        if thr:
            lines += ["", "| beam width | prompts | hitchllm output tok/s | HF output tok/s | "
                      "speed-up | same best beam |", "|---|---|---|---|---|---|", *thr]
        append_results(args.results, lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
