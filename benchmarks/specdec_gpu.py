"""Speculative decoding with ``draft_model``: per-output-token latency against no speculation,
in the same run, over a sweep of batch sizes (to find where speculation stops paying).

Target: the bundled model (``--model`` for another), or with ``--target-layers N`` that model
deepened to N decoder layers by ``write_deepened_checkpoint`` (the added layers compute but add
nothing: the same function at a higher cost per step, standing in for a larger model of the
family, which does not exist offline). Drafts (``--drafts``, comma-separated): ``self`` (the
target drafting for itself), ``base`` (``--model`` itself: with ``--target-layers``, a draft
that agrees with the target and costs less per step, the pair speculation is for),
``layersN`` (``--model``'s first N decoder layers, written by ``write_truncated_checkpoint``:
a draft of another size that shares the vocabulary and often agrees), or a checkpoint path.
Prompts are code-completion windows of the held-out stdlib text (tests/data/heldout_stdlib),
greedy (``--temperature`` for sampling), ``--max-tokens`` new tokens each, EOS ignored.

Per batch size B, B prompts run together through ``LLMEngine.step``; a request's time per
output token (TPOT) is (finish time - first token time) / (tokens - 1), averaged over the
requests, best of ``--repeat`` runs; ``speedup`` is the no-speculation TPOT / the speculative
TPOT (above 1: speculation pays). ``tok/step`` is output tokens per request per decode step
(1 without speculation), ``accept`` the share of verified drafts the target accepted. Every
engine is warmed up with one batch first.

    python benchmarks/specdec_gpu.py [--results benchmarks/RESULTS.md]
    python benchmarks/specdec_gpu.py --device cpu --batch-sizes 1,2 --max-tokens 24  # smoke
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hitchllm_specdec.draft_checkpoint import (
    write_deepened_checkpoint,
    write_truncated_checkpoint,
)
from results_md import append_results, entry_heading

from hitchllm import LLM, SamplingParams
from hitchllm.bundled_model import default_model_path

HELD_OUT = sorted((Path(__file__).parent.parent / "tests/data/heldout_stdlib").glob("*.py"))
SECTION = "## Speculative decoding: draft_model vs no speculation (issue 16)"
ABOUT = ("Per-output-token latency (TPOT) of the same prompts with and without a draft model, "
         "by batch size; benchmarks/specdec_gpu.py.")
HEADER = ("| draft | K | batch | TPOT no spec ms | TPOT spec ms | speedup | tok/step | accept |\n"
          "|---|---|---|---|---|---|---|---|")


@dataclass
class Timing:
    tpot_ms: float
    tokens_per_step: float


def code_prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the held-out stdlib files."""
    rng = random.Random(seed)
    ids = [tokenizer(p.read_text(), verbose=False).input_ids for p in HELD_OUT]
    ids = [t for t in ids if len(t) > length + 1]
    prompts = []
    for _ in range(count):
        text = rng.choice(ids)
        start = rng.randrange(len(text) - length)
        prompts.append(text[start : start + length])
    return prompts


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, repeat: int) -> Timing:
    """The best of ``repeat`` runs (by TPOT) of ``prompts`` together."""
    return min((run_once(llm, prompts, params) for _ in range(repeat)), key=lambda t: t.tpot_ms)


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Timing:
    """TPOT of ``prompts`` run together, and output tokens per request per decode step."""
    engine = llm.engine
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    decode_steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        decode_steps += bool(first)
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = (now, len(o.outputs[0].token_ids))
    tpots = [(end - first[rid]) / (n - 1) for rid, (end, n) in done.items() if n > 1]
    tokens = sum(n - 1 for _, n in done.values())
    return Timing(1000 * sum(tpots) / len(tpots), tokens / len(prompts) / max(decode_steps, 1))


def pays_until(name: str, k: int, speedups: dict[int, float]) -> str:
    """Where speculation stops paying: the largest batch size before the first one at which
    it is slower than no speculation."""
    losing = [b for b, s in sorted(speedups.items()) if s < 1.0]
    if not losing:
        return f"- {name}, K={k}: faster at every batch size measured"
    paying = [b for b in speedups if b < losing[0]]
    if not paying:
        return f"- {name}, K={k}: slower from batch {losing[0]} on"
    return f"- {name}, K={k}: faster up to batch {max(paying)}, slower from batch {losing[0]}"


def draft_path(name: str, model: str, target: str, workdir: Path) -> str:
    if name == "self":
        return target
    if name == "base":
        return model
    if name.startswith("layers"):
        return str(write_truncated_checkpoint(model, workdir / name, int(name[6:])))
    return name


def release() -> None:
    """Give the memory of the engine just deleted back (engines are built one at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--target-layers", type=int,
                        help="deepen the target to this many layers (see the module docstring)")
    parser.add_argument("--drafts", default="self,layers4,layers2")
    parser.add_argument("--k", default="4", help="num_speculative_tokens values, e.g. 2,4")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per point; the best counts")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    engine_args = dict(device=args.device, attention_backend=args.attention_backend,
                       enforce_eager=args.enforce_eager, max_num_seqs=max(batches),
                       max_model_len=args.prompt_len + args.max_tokens + max(ks) + 1)
    if args.device == "cuda":
        engine_args["gpu_memory_utilization"] = 0.4
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=0 if args.temperature else None)

    tmp_dir = tempfile.TemporaryDirectory()
    target = args.model
    if args.target_layers:
        target = str(write_deepened_checkpoint(args.model, Path(tmp_dir.name) / "target",
                                               args.target_layers))
    llm = LLM(target, **engine_args)
    prompts = code_prompts(llm.get_tokenizer(), max(batches), args.prompt_len)
    run_once(llm, prompts[: max(batches)], params)  # warm-up
    baseline = {b: measure(llm, prompts[:b], params, args.repeat) for b in batches}
    del llm
    release()

    print(HEADER)
    rows = [HEADER]
    summaries: list[str] = []
    with tmp_dir as tmp:
        for name in args.drafts.split(","):
            draft = draft_path(name, args.model, target, Path(tmp))
            for k in ks:
                llm = LLM(target, speculative_method="draft_model", speculative_model=draft,
                          num_speculative_tokens=k, **engine_args)
                run_once(llm, prompts[: max(batches)], params)  # warm-up
                stats = llm.engine.proposer.cache.stats
                speedups = {}
                for b in batches:
                    before = (stats.num_drafts, stats.num_accepted)
                    spec = measure(llm, prompts[:b], params, args.repeat)
                    verified = stats.num_drafts - before[0]
                    accept = (stats.num_accepted - before[1]) / verified if verified else 0.0
                    base = baseline[b]
                    row = (f"| {name} | {k} | {b} | {base.tpot_ms:.2f} | {spec.tpot_ms:.2f} | "
                           f"{base.tpot_ms / spec.tpot_ms:.2f}x | {spec.tokens_per_step:.2f} | "
                           f"{accept:.2f} |")
                    print(row, flush=True)
                    rows.append(row)
                    speedups[b] = base.tpot_ms / spec.tpot_ms
                summaries.append(pays_until(name, k, speedups))
                del llm
                release()
    print("\n".join(summaries))
    if args.results:
        deepened = f" deepened to {args.target_layers} layers" if args.target_layers else ""
        note = (f"(target {Path(args.model).name}{deepened}, prompts of {args.prompt_len} "
                f"held-out stdlib tokens, {args.max_tokens} new tokens, "
                f"temperature {args.temperature}, "
                f"device {args.device}{', eager' if args.enforce_eager else ''})")
        command = "python benchmarks/specdec_gpu.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k not in ("results", "model") and v not in (None, False))
        append_results(args.results, [*entry_heading("draft_model speculative decoding",
                                                     command, note), *rows, "", *summaries],
                       SECTION, ABOUT)


if __name__ == "__main__":
    main()
