"""Prefill on the CPU: microseconds per prompt token for the bundled model (or ``--model``)
at a few prompt shapes, fp32 and bf16, each (checkout, dtype) a fresh process.

Each process builds ``LLM(..., device="cpu")`` with the attention backend auto mode picks
(CPU_ATTN), prefix caching off, then per shape: one warm-up batch, then ``--repeats`` batches
of new prompts with ``max_tokens=1`` (the prefill and one sampled token), timed one by one.
Shapes: ``4x512`` and ``16x128`` (every prompt that long), and ``mixed``: 32 prompts of
64-512 tokens (the peer workload's prompts), new lengths every batch, so the step's token
count is new every time as in a real run. Prints median (min-max) us per prompt token and
appends the table to ``--results``.

``--trees`` compares checkouts in interleaved rounds (``LABEL=DIR``, comma-separated), e.g. a
change against the main checkout on a machine other processes share:

    python benchmarks/prefill_cpu.py [--rounds 3] [--trees main=MAIN_CHECKOUT,this=.] \\
        [--dtypes float32,bfloat16] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from checkouts import add_trees_argument, command_line, parse_trees, tree_pythonpath

SECTION = "## Prefill on CPU (benchmarks/prefill_cpu.py)"
ABOUT = ("Reproduce: `python benchmarks/prefill_cpu.py --results benchmarks/RESULTS.md`. "
         "Microseconds per prompt token of `LLM.generate(..., max_tokens=1)` batches (the "
         "prefill and one sampled token), CPU_ATTN, prefix caching off; median (min-max) over "
         "the rounds' repeats, a fresh process per checkout, dtype and round, interleaved.")
SHAPES = ("4x512", "16x128", "mixed")

# Runs in the measured process: argv = model, dtype, repeats, shapes (comma-separated).
_WORKER = r"""
import json, random, sys, time
from hitchllm import LLM, SamplingParams
model, dtype, repeats, shapes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
llm = LLM(model=model, device="cpu", dtype=dtype, enable_prefix_caching=False)
rng = random.Random(0)
def batch(shape):
    lens = [rng.randint(64, 512) for _ in range(32)] if shape == "mixed" else \
        [int(shape.split("x")[1])] * int(shape.split("x")[0])
    return [{"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(n)]} for n in lens]
params = SamplingParams(max_tokens=1, temperature=0.0)
out = {}
for shape in shapes.split(","):
    llm.generate(batch(shape), params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        prompts = batch(shape)
        tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append((time.perf_counter() - start) * 1e6 / tokens)
    out[shape] = times
print("RESULT " + json.dumps(out))
"""


def run_once(tree: Path, dtype: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """One fresh process: us per prompt token of each repeat, per shape."""
    env = dict(os.environ, PYTHONPATH=tree_pythonpath(tree))
    model = args.model or str(tree / "core" / "hitchllm" / "default_model")
    done = subprocess.run([sys.executable, "-c", _WORKER, model, dtype, str(args.repeats),
                           args.shapes], env=env, cwd=tree, capture_output=True, text=True,
                          timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the {dtype} run in {tree} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(runs: dict[tuple[str, str], dict[str, list[float]]], shapes: list[str],
          loads: list[float]) -> list[str]:
    lines = ["| checkout | dtype | " + " | ".join(f"{s}, us/token" for s in shapes) + " |",
             "|---|---|" + "---|" * len(shapes)]
    for (label, dtype), per_shape in runs.items():
        lines.append(f"| {label} | {dtype} | "
                     + " | ".join(spread(per_shape[s]) for s in shapes) + " |")
    lines += ["", f"Load average (1 min) during the rounds: {min(loads):.1f}-{max(loads):.1f}."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per shape")
    add_trees_argument(parser)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)} or NxLEN")
    parser.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()
    trees = parse_trees(parser, args.trees)
    shapes = args.shapes.split(",")
    for shape in shapes:
        n, x, length = shape.partition("x")
        if shape != "mixed" and not (x and n.isdigit() and length.isdigit()):
            parser.error(f"--shapes: {shape!r} is not 'mixed' or NxLEN (e.g. 4x512)")

    runs: dict[tuple[str, str], dict[str, list[float]]] = {}
    loads = []
    for r in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for label, tree in trees.items():
                loads.append(os.getloadavg()[0])
                got = run_once(tree, dtype, args)
                cell = runs.setdefault((label, dtype), {s: [] for s in shapes})
                for s in shapes:
                    cell[s] += got[s]
                print(f"round {r + 1} {label:8s} {dtype:9s} " + ", ".join(
                    f"{s} {statistics.median(got[s]):.1f}" for s in shapes), flush=True)
    lines = table(runs, shapes, loads)
    print("\n".join(lines))
    if args.results:
        from results_md import append_results, entry_heading

        heading = entry_heading("prefill_cpu", command_line("prefill_cpu.py", sys.argv[1:]),
                                f"{args.rounds} rounds x {args.repeats} repeats, "
                                f"{args.model or 'the bundled model'}")
        append_results(args.results, heading + lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
