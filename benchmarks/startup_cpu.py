"""Start-up to the first token on the CPU: ``hitchllm generate --prompt Hello --max-tokens 1``
with the bundled model (or ``--model``), each run a fresh process, timed from the process's
start to the first generated token on its stdout, and to its exit, and the CPU seconds it used
(user + system: steadier than wall time on a machine other processes share). Prints a table
(median of the rounds, with the spread) and appends it to ``--results``.

``--trees`` compares checkouts in interleaved rounds (``LABEL=DIR``, comma-separated; each run
imports hitchllm and its plugins from that checkout's ``core/`` and ``plugins/*``), e.g. a
change against the main checkout on a machine other processes share:

    python benchmarks/startup_cpu.py [--rounds 5] [--trees main=MAIN_CHECKOUT,this=.] \
        [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from checkouts import add_trees_argument, command_line, parse_trees, tree_pythonpath

SECTION = "## Start-up to the first token on CPU (benchmarks/startup_cpu.py)"
ABOUT = ("Reproduce: `python benchmarks/startup_cpu.py --results benchmarks/RESULTS.md`. "
         "Seconds from a fresh `hitchllm generate --prompt Hello --max-tokens 1` process's "
         "start to its first generated token on stdout, and to its exit, and its CPU seconds "
         "(user + system); median of the rounds (min-max), rounds interleaving the checkouts "
         "compared.")
PROMPT = "Hello"


def run_once(tree: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    """One fresh process: seconds to the first generated token and to the exit, and the CPU
    seconds it used."""
    env = dict(os.environ, PYTHONPATH=tree_pythonpath(tree), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "hitchllm.entrypoints.cli", "generate", "--prompt", PROMPT,
           "--max-tokens", "1", *args.engine_args]
    if args.model:
        cmd += ["--model", args.model]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    seen = b""
    first = None
    try:
        # The command writes the prompt, then each token as it is sampled (flushed).
        while first is None:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            if len(seen.rstrip(b"\n")) > len(PROMPT.encode()):
                first = time.perf_counter() - started
        _, err = proc.communicate(timeout=args.timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    exited = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode or first is None:
        raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({proc.returncode}, first token "
                           f"seen: {first is not None}):\n{err.decode()[-3000:]}")
    return first, exited, cpu


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(runs: dict[str, list[tuple[float, float, float]]], loads: list[float]) -> list[str]:
    lines = ["| checkout | rounds | to first token, s | to exit, s | CPU, s |",
             "|---|---|---|---|---|"]
    for label, times in runs.items():
        lines.append(f"| {label} | {len(times)} | **{spread([t[0] for t in times])}** | "
                     f"{spread([t[1] for t in times])} | {spread([t[2] for t in times])} |")
    lines += ["", f"Load average (1 min) during the rounds: {min(loads):.1f}-{max(loads):.1f}."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    add_trees_argument(parser)
    parser.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per run")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    parser.add_argument("engine_args", nargs="*",
                        help="more `hitchllm generate` flags, after `--`")
    args = parser.parse_args()
    trees = parse_trees(parser, args.trees)

    runs: dict[str, list[tuple[float, float, float]]] = {label: [] for label in trees}
    loads = []
    for r in range(args.rounds):
        for label, tree in trees.items():
            loads.append(os.getloadavg()[0])
            first, exited, cpu = run_once(tree, args)
            runs[label].append((first, exited, cpu))
            print(f"round {r + 1} {label:10s} first token {first:5.2f} s, exit {exited:5.2f} s, "
                  f"CPU {cpu:5.2f} s", flush=True)
    lines = table(runs, loads)
    print("\n".join(lines))
    if args.results:
        from results_md import append_results, entry_heading

        heading = entry_heading("startup_cpu", command_line("startup_cpu.py", sys.argv[1:]),
                                f"{args.rounds} rounds, {args.model or 'the bundled model'}")
        append_results(args.results, heading + lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
