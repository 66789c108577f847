"""EAGLE drafts on the CPU: acceptance and tokens per step of a trained head vs no speculation.

    python scripts/train_eagle_head.py --out /tmp/eagle-head --threads 2   # about 7 minutes
    python benchmarks/specdec_eagle_cpu.py --head /tmp/eagle-head [--results benchmarks/RESULTS.md]

Target: the bundled model (or ``--model``). Prompts: code-completion prompts cut from the
held-out files of the bundled model's corpus (the standard library split of
``scripts/demo_corpus.py``, files neither the model nor the head trained on): ``--prompts``
windows of ``--prompt-tokens`` tokens, each starting at a line start. Batch 1, greedy,
``--max-tokens`` new tokens per prompt, one request at a time (the engine steps counted per
request). Columns: acceptance = accepted drafts / proposed drafts; tokens per step = output
tokens per decode step (1 without speculation); ms per token = wall time per output token; the
last column checks that every output equals the one without speculation.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

from results_md import append_results, entry_heading

from hitchllm import LLM, SamplingParams
from hitchllm.bundled_model import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from demo_corpus import load_corpus

SECTION = "## Speculative decoding on the CPU: EAGLE head trained on the bundled model"
ABOUT = ("Reproduce: `python scripts/train_eagle_head.py --out /tmp/eagle-head --threads 2` "
         "then `python benchmarks/specdec_eagle_cpu.py --head /tmp/eagle-head --results "
         "benchmarks/RESULTS.md`. Batch 1, greedy, held-out standard-library prompts.")
HEADER = ("| method | K | acceptance | accepted per step | tokens per step | ms per token | "
          "speed-up | same output |\n|---|---|---|---|---|---|---|---|")


def heldout_prompts(llm: LLM, stdlib: Path, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, spread over the held-out files, each starting
    at a line start."""
    files = [text for _, text in load_corpus(stdlib, 5.0, 1.0).held_out]
    tok = llm.get_tokenizer()
    prompts: list[list[int]] = []
    per_file = -(-count // len(files))
    for i in range(count):
        lines = files[i % len(files)].splitlines(keepends=True)
        # The file's k-th prompt starts k / (per_file + 1) of the way in.
        start = len(lines) * (i // len(files) + 1) // (per_file + 1)
        ids = tok("".join(lines[start:])).input_ids[:length]
        if len(ids) == length:
            prompts.append(ids)
    return prompts


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int):
    """(outputs, decode steps, seconds), one request at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, steps = [], 0
    began = time.perf_counter()
    for prompt in prompts:
        llm.engine.add_request({"prompt_token_ids": prompt}, params)
        steps -= 1  # the prefill step
        while llm.engine.has_unfinished_requests():
            steps += 1
            for out in llm.engine.step():
                if out.finished:
                    outputs.append(out.outputs[0].token_ids)
    return outputs, steps, time.perf_counter() - began


def count_proposed(llm: LLM) -> list[int]:
    """A one-element counter of the drafts the engine's proposer hands out."""
    proposer = llm.engine.proposer
    counter = [0]
    propose = proposer.propose

    def counting(batch):
        proposal = propose(batch)
        limits = {r.request_id: r.max_num_drafts for r in batch.requests}
        counter[0] += sum(min(len(d.token_ids), limits[rid])
                          for rid, d in proposal.drafts.items())
        return proposal

    proposer.propose = counting
    return counter


def describe_head(head: Path) -> str:
    """How the head was trained, from its train_run.json when it has one."""
    run_file = head / "train_run.json"
    if not run_file.is_file():
        return f"head {head}"
    run = json.loads(run_file.read_text())
    return (f"head: `{run['command']}`, {run['steps_run']} steps in {run['train_seconds']:.0f}s "
            f"on {run['threads']} threads, held-out first draft = target argmax "
            f"{run['held_out']['draft_is_target_argmax']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="EAGLE head directory")
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4],
                        help="num_speculative_tokens values to measure")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()

    # Without overlapped steps, so that each engine step shows its own tokens (on a CPU
    # overlapping changes nothing but the order).
    base_llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, async_scheduling=False)
    prompts = heldout_prompts(base_llm, args.stdlib, args.prompts, args.prompt_tokens)
    generate(base_llm, prompts[:1], 8)  # warm-up
    expected, base_steps, base_seconds = generate(base_llm, prompts, args.max_tokens)
    num_tokens = sum(len(o) for o in expected)
    base_ms = 1000 * base_seconds / num_tokens
    rows = [f"| none | 0 | - | - | {(num_tokens - len(prompts)) / base_steps:.2f} | "
            f"{base_ms:.2f} | 1.00x | yes |"]
    print(HEADER)
    print(rows[0], flush=True)
    for k in args.k:
        llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, speculative_method="eagle",
                  num_speculative_tokens=k, speculative_model=args.head)
        generate(llm, prompts[:1], 8)
        proposed = count_proposed(llm)
        outputs, steps, seconds = generate(llm, prompts, args.max_tokens)
        decoded = sum(len(o) for o in outputs) - len(prompts)  # after each prefill's token
        accepted = decoded - steps
        ms = 1000 * seconds / sum(len(o) for o in outputs)
        rows.append(f"| eagle | {k} | {accepted / max(1, proposed[0]):.1%} | "
                    f"{accepted / steps:.2f} | {decoded / steps:.2f} | {ms:.2f} | "
                    f"{base_ms / ms:.2f}x | {'yes' if outputs == expected else 'NO'} |")
        print(rows[-1], flush=True)
    if args.results:
        note = (f"({len(prompts)} held-out prompts of {args.prompt_tokens} tokens, "
                f"{args.max_tokens} new tokens each; {describe_head(Path(args.head))})")
        lines = [*entry_heading("EAGLE head vs no speculation, bundled model, batch 1",
                                "python benchmarks/specdec_eagle_cpu.py", note), HEADER, *rows]
        append_results(args.results, lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
