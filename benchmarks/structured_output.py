"""Throughput cost of structured outputs on this machine's CPU: the bundled default model
generates for 32 prompts at temperature 1 under a JSON schema, a regex, and a logit_bias (the
core's logits-processor seam alone), the fastest of ``--repeat`` runs each. A constraint ends
each output at its own length, and a batch that thins out as requests finish runs slower per
token, so each case is compared with an unconstrained run of exactly the same output lengths
(``ignore_eos`` and ``max_tokens`` set to each constrained output's length). Prints the table
and appends it to benchmarks/RESULTS.md. Needs hitchllm-structured-output installed.

    python benchmarks/structured_output.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from datetime import date
from pathlib import Path

from results_md import current_commit

from hitchllm import LLM, SamplingParams, StructuredOutputsParams, default_model_path
from hitchllm.entrypoints.machine import describe_machine

RESULTS = Path(__file__).with_name("RESULTS.md")
NUM_PROMPTS = 32
MAX_TOKENS = 128
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "language": {"enum": ["python", "c", "rust", "go"]},
        "lines": {"type": "integer", "minimum": 1, "maximum": 10000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 4},
        "tested": {"type": "boolean"},
    },
    "required": ["name", "language", "lines", "tags", "tested"],
    "additionalProperties": False,
}
CASES: list[tuple[str, dict]] = [
    ("logit_bias (5 ids)", {"logit_bias": {i: 1.0 for i in range(100, 105)}}),
    ("json schema", {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}),
    ("regex", {"structured_outputs": StructuredOutputsParams(
        regex=r"def [a-z_]{1,20}\((a|b|c)(, (a|b|c)){0,3}\):\n    return [a-z +*]{1,40}")}),
]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams],
        repeat: int) -> tuple[float, list[int]]:
    """(fastest seconds, output length of each prompt)."""
    best, lengths = float("inf"), []
    for _ in range(repeat):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
    return best, lengths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(default_model_path(), device="cpu")
    prompts = [f"# task {i}: describe a small program as JSON\n" for i in range(NUM_PROMPTS)]
    warm = SamplingParams(max_tokens=8, structured_outputs=CASES[1][1]["structured_outputs"])
    llm.generate(prompts[:2], warm, use_tqdm=False)  # the grammar library's tokenizer index
    rows = []
    for label, extra in CASES:
        constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, **extra)
                       for i in range(len(prompts))]
        seconds, lengths = run(llm, prompts, constrained, args.repeat)
        matched = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                   for i, n in enumerate(lengths)]
        base_seconds, _ = run(llm, prompts, matched, args.repeat)
        tokens = sum(lengths)
        rows.append(f"| {label} | {NUM_PROMPTS} | {tokens} | {base_seconds:.2f} | "
                    f"{seconds:.2f} | {tokens / base_seconds:.1f} | {tokens / seconds:.1f} | "
                    f"{base_seconds / seconds:.2f} |")
    commit = current_commit()
    table = "\n".join([
        f"### Structured output throughput, bundled default model ({date.today()}, "
        f"{describe_machine()}, commit {commit}, backend {llm.engine.attention_backend.name})",
        "",
        f"`python benchmarks/structured_output.py --repeat {args.repeat}` ({NUM_PROMPTS} "
        f"prompts, temperature 1, max_tokens {MAX_TOKENS}, fastest of {args.repeat})",
        "",
        "| case | requests | output tokens | unconstrained s | constrained s | "
        "unconstrained tok/s | constrained tok/s | throughput ratio |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(table)
    with RESULTS.open("a") as f:
        f.write("\n" + table + "\n")


if __name__ == "__main__":
    main()
