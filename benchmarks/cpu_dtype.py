"""float32 or bfloat16 on this CPU? The engine's offline throughput in both dtypes, interleaved
(fp32, bf16, fp32, bf16, ... each run a fresh process), on benchmarks/cpu_steady.py's workload
and models (a random Llama hidden 256 x 4 layers, and the bundled model), for the given engine
configurations (cpu_steady's names: ``default``, ``t1`` = one torch thread, ...). Prints the
median tok/s of each dtype and the median of the per-round ratios bf16 / fp32 (> 1: bf16 is
faster), with the CPU's bf16 flags; ``--results`` appends the table. This is the measurement
behind the CPU's default dtype (docs/performance.md, "bf16 on the CPU").

    python benchmarks/cpu_dtype.py [--rounds 3] [--configs default,t1] \
        [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cpu_peer import cpu_description
from cpu_steady import build_llama, run_once

DTYPES = ("float32", "bfloat16")
SECTION = "## CPU: float32 vs bfloat16 (benchmarks/cpu_dtype.py)"
ABOUT = ("Reproduce: `python benchmarks/cpu_dtype.py --results benchmarks/RESULTS.md`. Output "
         "tokens/s of one `generate` of 32 requests (64-512 prompt tokens, 64-256 output, "
         "greedy, `ignore_eos`), median of the rounds; ratio: median over rounds of bf16 / fp32 "
         "in the same round (> 1: bf16 faster). Fresh process per run, OMP_WAIT_POLICY=PASSIVE.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="default,t1")
    parser.add_argument("--models", default="llama,bundled")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--output-len", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--note", default="", help="said in the entry (e.g. the machine load)")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()

    from hitchllm.bundled_model import default_model_path

    configs = args.configs.split(",")
    runs: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: (str(build_llama(Path(tmp) / "llama-256x4")) if name == "llama"
                         else default_model_path() if name == "bundled" else name)
                  for name in args.models.split(",")}
        for r in range(args.rounds):
            for model, path in models.items():
                for config in configs:
                    for dtype in DTYPES:
                        run_args = copy.copy(args)
                        run_args.dtype = dtype
                        # The bundled model has 512 positions: its prompts stay within 256.
                        if model == "bundled":
                            run_args.input_len = [args.input_len[0], min(args.input_len[1], 256)]
                        res = run_once(path, config, False, run_args)
                        runs.setdefault((model, config, dtype), []).append(res["tok_s"])
                        print(f"round {r + 1} {model:8s} {config:8s} {dtype:9s} "
                              f"{res['tok_s']:8.1f} tok/s ({res['threads']} threads)",
                              flush=True)
    lines = ["| model | config | float32 tok/s | bfloat16 tok/s | bf16 / fp32 per round | median |",
             "|---|---|---|---|---|---|"]
    for model in models:
        for config in configs:
            fp32, bf16 = runs[(model, config, "float32")], runs[(model, config, "bfloat16")]
            ratios = [b / f for f, b in zip(fp32, bf16)]
            lines.append(f"| {model} | {config} | {statistics.median(fp32):,.0f} | "
                         f"{statistics.median(bf16):,.0f} | "
                         f"{', '.join(f'{x:.2f}' for x in ratios)} | "
                         f"**{statistics.median(ratios):.2f}** |")
    cpu = cpu_description()
    print(f"\n{cpu}\n" + "\n".join(lines))
    if args.results:
        from results_md import append_results, entry_heading

        argv = sys.argv[1:]
        said = ("--results", "--note")  # the entry says these itself
        kept = [a for i, a in enumerate(argv) if a not in said
                and (i == 0 or argv[i - 1] not in said)]
        note = f"CPU: {cpu}; {args.rounds} rounds." + (f" {args.note}" if args.note else "")
        heading = entry_heading("cpu_dtype", " ".join(["python benchmarks/cpu_dtype.py",
                                                       *kept]), note)
        append_results(args.results, heading + lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
