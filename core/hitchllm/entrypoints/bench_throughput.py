"""``hitchllm bench throughput``: offline generation throughput, optionally against Hugging Face
``generate`` on the same prompts in the same run.

The workload is nano-vllm's benchmark: random prompts of random token ids with lengths uniform
in ``--input-len``, output lengths uniform in ``--output-len``, ``ignore_eos`` so every request
produces exactly its output length (the default lengths, 100-1024 each, shrink to fit a model
whose ``max_model_len`` is shorter: at most half of it each). One warm-up call, then one timed
``generate``. Greedy decoding on both sides. Hugging Face runs batched (``--hf-batch-size``
prompts, left-padded, each batch generating its longest requested output); only the requested
tokens count as its useful output. With ``--repeat N`` each side runs N times and the fastest
run counts.
"""

from __future__ import annotations

import argparse
import gc
import random
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hitchllm.entrypoints.machine import describe_machine

if TYPE_CHECKING:
    from hitchllm.engine.llm_engine import EngineStats


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="prompt tokens (default: 100 1024, at most half of max_model_len)")
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="output tokens (default: 100 1024, at most what the prompt leaves)")
    # --seed (an engine flag) also seeds the workload.
    parser.add_argument("--dataset", choices=["random"], default="random")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also run Hugging Face generate on the same prompts")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-num-prompts", type=int,
                        help="compare on the first N prompts only (both sides)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time each side N times and keep the fastest (noisy machines)")
    parser.add_argument("--profile", type=Path, help="write a torch profiler trace here")
    parser.add_argument("--append-results", type=Path, help="append a row to this markdown file")
    parser.add_argument("--label", default="")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction,
                        help="progress bars on stderr (default: when stderr is a terminal)")


DEFAULT_LEN = (100, 1024)


def fit_lengths(
    input_len: list[int] | None, output_len: list[int] | None, max_model_len: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (min, max) prompt and output lengths: the given ones, checked to fit
    ``max_model_len`` together, and the defaults where none were given, shrunk to fit."""
    def default(limit: int) -> tuple[int, int]:
        high = min(DEFAULT_LEN[1], limit)
        return min(DEFAULT_LEN[0], high), high

    inputs = tuple(input_len) if input_len else default(max_model_len // 2)
    outputs = tuple(output_len) if output_len else default(max_model_len - inputs[1])
    for flag, (low, high) in (("--input-len", inputs), ("--output-len", outputs)):
        if not 1 <= low <= high:
            raise ValueError(f"{flag} {low} {high}: need 1 <= MIN <= MAX")
    if inputs[1] + outputs[1] > max_model_len:
        raise ValueError(
            f"--input-len MAX {inputs[1]} plus --output-len MAX {outputs[1]} exceeds "
            f"max_model_len={max_model_len}; lower them"
        )
    return (inputs[0], inputs[1]), (outputs[0], outputs[1])


def make_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> Workload:
    input_len, output_len = fit_lengths(args.input_len, args.output_len, max_model_len)
    rng = random.Random(args.seed)
    prompts, outs = [], []
    for _ in range(args.num_prompts):
        n_in = rng.randint(*input_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(n_in)])
        outs.append(rng.randint(*output_len))
    if args.hf_num_prompts:
        prompts, outs = prompts[: args.hf_num_prompts], outs[: args.hf_num_prompts]
    return Workload(prompts, outs)


def run_hitchllm(llm, work: Workload, profile: Path | None, repeat: int = 1,
                 progress: bool = False) -> tuple[float, str | None]:
    """Seconds of the fastest of ``repeat`` timed runs (the prefix cache is emptied before
    each, so no run reuses another's prompts), and with speculative decoding a summary of
    the timed runs' drafts (``spec_decode_summary``)."""
    from hitchllm.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    before = llm.engine.stats()
    times = []
    for _ in range(repeat):
        llm.engine.kv_cache.reset_prefix_cache()
        _sync(llm.engine.device)
        start = time.perf_counter()
        if profile is None:
            outs = llm.generate(prompts, params, use_tqdm=progress)
        else:
            with torch.profiler.profile(record_shapes=True) as prof:
                outs = llm.generate(prompts, params, use_tqdm=progress)
            prof.export_chrome_trace(str(profile))
        _end_run(times, start, llm.engine.device, repeat)
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != work.output_tokens:
            raise RuntimeError(f"expected {work.output_tokens} output tokens, got {produced}")
    return min(times), spec_decode_summary(before, llm.engine.stats())


def spec_decode_summary(before: EngineStats, after: EngineStats) -> str | None:
    """One line on the drafts verified between two snapshots (None when there were none):
    acceptance rate, mean accepted length per step (accepted drafts plus the token every
    step samples) and draft tokens per step, a step meaning one request's verification."""
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    if not drafts:
        return None
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return (f"spec_decode: acceptance_rate={accepted / proposed:.3f} "
            f"mean_accepted_length={1 + accepted / drafts:.2f} "
            f"draft_tokens_per_step={proposed / drafts:.2f} (drafts={drafts} "
            f"draft_tokens={proposed} accepted_tokens={accepted})")


def run_hf(model_path: str, work: Workload, dtype: torch.dtype, device: torch.device,
           batch_size: int, repeat: int = 1, progress: bool = False) -> float:
    """Seconds of the fastest of ``repeat`` timed runs of batched ``generate``."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id
    pad = 0 if pad is None else pad

    def batch_inputs(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids.to(device), mask.to(device)

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        ids, mask = batch_inputs(prompts)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=pad)

    generate(work.prompts[:1], 4)  # warm-up
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        for i in tqdm(range(0, len(work.prompts), batch_size), desc="HF generate",
                      unit="batch", disable=not progress):
            chunk = slice(i, i + batch_size)
            generate(work.prompts[chunk], max(work.output_lens[chunk]))
        _end_run(times, start, device, repeat)
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _end_run(times: list[float], start: float, device: torch.device, repeat: int) -> None:
    """Record a timed run that began at ``start`` once ``device`` is done; with several,
    print each, so a first run slowed by one-time work shows."""
    _sync(device)
    times.append(time.perf_counter() - start)
    if repeat > 1:
        print(f"timed run {len(times)} of {repeat}: {times[-1]:.2f} s", file=sys.stderr)


def _row(name: str, work: Workload, seconds: float) -> str:
    return (f"| {name:<10} | {len(work.prompts):>8} | {work.prompt_tokens:>13} | "
            f"{work.output_tokens:>13} | {seconds:>9.2f} | {work.output_tokens / seconds:>12.1f} | "
            f"{(work.prompt_tokens + work.output_tokens) / seconds:>11.1f} |")


HEADER = ("| engine     | requests | prompt tokens | output tokens |   seconds | output tok/s |"
          "  total tok/s |\n|---|---|---|---|---|---|---|")


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from hitchllm.entrypoints.llm import LLM

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    llm = LLM(args.model, **engine_kwargs)
    engine = llm.engine
    work = make_workload(args, engine.model_config.vocab_size, engine.max_model_len)
    ours, spec_summary = run_hitchllm(llm, work, args.profile, args.repeat, progress)
    dtype, device = engine.dtype, engine.device
    described = (f"{str(dtype).removeprefix('torch.')}, backend {engine.attention_backend.name}"
                 + (", enforce_eager" if engine.config.enforce_eager else ""))
    lines = [HEADER, _row("hitchllm", work, ours)]
    ratio = None
    if args.compare_hf:
        # Hugging Face gets the card to itself: the engine's KV cache and graphs go first.
        del llm, engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = run_hf(args.model, work, dtype, device, args.hf_batch_size, args.repeat, progress)
        lines.append(_row("HF generate", work, hf))
        ratio = hf / ours
    if spec_summary is not None:
        lines += ["", spec_summary]
    print("\n".join(lines))
    if ratio is not None:
        print(f"ratio_vs_hf={ratio:.2f}")
    if args.append_results:
        _append(args, lines, ratio, described)
    return 0


def command_line(args: argparse.Namespace) -> str:
    """This run's command, the model path written as MODEL and the bookkeeping flags left out."""
    argv = args.argv
    words, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word in ("--append-results", "--label", "--profile"):
            skip = True
            continue
        if i > 0 and argv[i - 1] == "--model":
            word = "MODEL"
        words.append(shlex.quote(word))
    return "hitchllm " + " ".join(words)


def _append(args: argparse.Namespace, lines: list[str], ratio: float | None,
            described: str) -> None:
    cmd = command_line(args)
    with args.append_results.open("a") as f:
        f.write(f"\n### bench throughput {args.label} ({date.today()}, {describe_machine()}, "
                f"{described})\n\n`{cmd}`\n\n" + "\n".join(lines) + "\n")
        if ratio is not None:
            f.write(f"\nratio_vs_hf={ratio:.2f}\n")
