"""Throughput cost of structured outputs on this machine's CPU: the bundled default model
generates for 32 prompts at temperature 1, unconstrained and then under a JSON schema, a
regex and a logit_bias (the core's logits-processor seam alone), the fastest of ``--repeat``
runs each. Output lengths differ between rows (a constraint ends the output when it is
complete), so compare output tokens per second, i.e. the cost per generated token. Prints the
table and appends it to benchmarks/RESULTS.md. Needs hitchllm-structured-output installed.

    python benchmarks/structured_output.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from datetime import date
from pathlib import Path

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
    ("unconstrained", {}),
    ("logit_bias (5 ids)", {"logit_bias": {i: 1.0 for i in range(100, 105)}}),
    ("json schema", {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}),
    ("regex", {"structured_outputs": StructuredOutputsParams(
        regex=r"def [a-z_]{1,20}\((a|b|c)(, (a|b|c)){0,3}\):\n    return [a-z +*]{1,40}")}),
]


def run(llm: LLM, prompts: list[str], extra: dict, repeat: int) -> tuple[float, int]:
    """(fastest seconds, output tokens) for one case."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, **extra)
              for i in range(len(prompts))]
    best, tokens = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(default_model_path(), device="cpu")
    prompts = [f"# task {i}: describe a small program as JSON\n" for i in range(NUM_PROMPTS)]
    run(llm, prompts[:2], CASES[2][1], 1)  # warm-up: the grammar library's tokenizer index
    rows = []
    base_rate = None
    for label, extra in CASES:
        seconds, tokens = run(llm, prompts, extra, args.repeat)
        rate = tokens / seconds
        base_rate = base_rate or rate
        rows.append(f"| {label} | {NUM_PROMPTS} | {tokens} | {seconds:.2f} | {rate:.1f} | "
                    f"{rate / base_rate:.2f} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    table = "\n".join([
        f"### Structured output throughput, bundled default model ({date.today()}, "
        f"{describe_machine()}, commit {commit}, backend {llm.engine.attention_backend.name})",
        "",
        f"`python benchmarks/structured_output.py --repeat {args.repeat}` ({NUM_PROMPTS} "
        f"prompts, temperature 1, max_tokens {MAX_TOKENS}, fastest of {args.repeat})",
        "",
        "| case | requests | output tokens | seconds | output tok/s | vs unconstrained |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(table)
    with RESULTS.open("a") as f:
        f.write("\n" + table + "\n")


if __name__ == "__main__":
    main()
