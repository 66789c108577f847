"""Speculative decoding on the CPU: the ``ngram`` proposer (prompt lookup, hitchllm-specdec)
against no speculation, in the same run, on the bundled code model at batch 1.

Prompts are code completions cut from the bundled model's held-out standard-library files
(tests/data/heldout_stdlib): the ``--context`` characters before a ``def`` line, ending with
that line's indentation and ``def``, so the model writes the next function. Each prompt is
generated greedily, one request at a time (``--max-tokens`` tokens, EOS ignored), and each
method's runs alternate with the others' ``--repeat`` times; the fastest repetition of each
method counts. Tokens per step are output tokens over engine steps (forward passes, the
prefill step included); ``speed-up`` is wall-clock output tokens per second over no
speculation's. Greedy speculative output must equal the output without speculation; the last
column checks it.

    python benchmarks/specdec_cpu.py [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path

from results_md import append_results, entry_heading

from hitchllm import LLM, SamplingParams, default_model_path

HELD_OUT = sorted((Path(__file__).parent.parent / "tests/data/heldout_stdlib").glob("*.py"))
SECTION = "## Speculative decoding on the CPU (issue 16)"
ABOUT = ("Reproduce: `python benchmarks/specdec_cpu.py --results benchmarks/RESULTS.md` "
         "(hitchllm-specdec installed). Bundled model, batch 1, greedy code completion of "
         "held-out standard-library files; ngram drafts vs no speculation in the same run.")
HEADER = ("| method | K | output tokens | engine steps | tokens / step | acceptance | tok/s | "
          "speed-up | same output |\n|---|---|---|---|---|---|---|---|---|")


@dataclass
class Run:
    seconds: float
    steps: int
    outputs: list[list[int]]
    draft_tokens: int
    accepted: int

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def code_prompts(count: int, context: int) -> list[str]:
    """``count`` completion prompts spread evenly over the held-out files' ``def`` lines."""
    cuts = []
    for path in HELD_OUT:
        text = path.read_text()
        cuts += [(text, m.start() + len(m.group(1)) + 4)
                 for m in re.finditer(r"^( *)def ", text, re.M) if m.start() >= context]
    step = max(1, len(cuts) // count)
    return [text[end - context - 4:end] for text, end in cuts[::step][:count]]


def generate_one_by_one(llm: LLM, prompts: list[str], max_tokens: int) -> Run:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    steps, outputs = 0, []
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    outputs.append(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    after = engine.stats()
    return Run(seconds, steps, outputs,
               after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
               after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--context", type=int, default=900, help="prompt characters")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[3, 5],
                        help="num_speculative_tokens values to run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()
    prompts = code_prompts(args.num_prompts, args.context)
    methods = [("none", 0)] + [("ngram", k) for k in args.k]
    # Without overlap every step is one forward pass (speculation turns it off anyway; on a
    # CPU it changes nothing but the order of work).
    engines = {(name, k): LLM(args.model, device="cpu", async_scheduling=False, **(
        {"speculative_method": name, "num_speculative_tokens": k} if k else {}))
        for name, k in methods}
    for llm in engines.values():  # warm-up
        generate_one_by_one(llm, prompts[:1], 8)
    best: dict[tuple[str, int], Run] = {}
    for _ in range(args.repeat):
        for key, llm in engines.items():
            run = generate_one_by_one(llm, prompts, args.max_tokens)
            if key not in best or run.seconds < best[key].seconds:
                best[key] = run
    base = best[methods[0]]
    rows = []
    for name, k in methods:
        run = best[(name, k)]
        acceptance = f"{run.accepted / run.draft_tokens:.1%}" if run.draft_tokens else "-"
        rows.append(
            f"| {name} | {k or '-'} | {run.tokens} | {run.steps} | "
            f"{run.tokens / run.steps:.2f} | {acceptance} | {run.tokens / run.seconds:.1f} | "
            f"{base.seconds / run.seconds:.2f}x | "
            f"{'yes' if run.outputs == base.outputs else 'NO'} |")
    backend = engines[methods[0]].engine.attention_backend.name
    note = (f"({len(prompts)} prompts of {args.context} characters, {args.max_tokens} tokens "
            f"each, batch 1, greedy, backend {backend}, fastest of {args.repeat})")
    print(note)
    print(HEADER)
    print("\n".join(rows))
    if args.results:
        command = "python benchmarks/specdec_cpu.py"
        lines = [*entry_heading("ngram speculative decoding, bundled model, batch 1", command,
                                note), HEADER, *rows]
        append_results(args.results, lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
