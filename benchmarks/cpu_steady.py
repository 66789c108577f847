"""Is the CPU engine steady on a busy machine? Offline throughput of a fixed workload (issue 22's:
32 requests, 64-512 prompt tokens, 64-256 output tokens, greedy, ignore_eos) on a random Llama
(hidden 256 x 4 layers, fp32, built here with transformers' LlamaConfig) and on the bundled
model, quiet and with one busy-looping process pinned to one core, for several engine
configurations, in interleaved rounds, each run a fresh process (OpenMP's settings are read once
per process). Prints a table of output tokens/s (median over the rounds, with the spread) and
appends it to ``--results``.

Configurations (``--configs``, comma-separated):
  default      the engine's defaults (threads from the usable cores, forward on a worker thread)
  old          before issue 22: torch threads = every core, each step computed before the host
               work (``--no-async-scheduling``; overlap without a thread only reordered work)
  sync         default threads, no worker thread (``--no-async-scheduling``)
  tN / tN-sync N torch threads (``--cpu-threads N``), with / without the worker thread

Every run sets ``OMP_WAIT_POLICY=PASSIVE``, as the ``hitchllm`` command does.

    python benchmarks/cpu_steady.py [--rounds 3] [--configs default,old] \
        [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SECTION = "## CPU engine on a busy machine (benchmarks/cpu_steady.py)"
ABOUT = ("Reproduce: `python benchmarks/cpu_steady.py --results benchmarks/RESULTS.md`. Output "
         "tokens/s, median of the rounds (min-max); `busy`: one other process busy-looping on "
         "one core during the run. Each run is a fresh process; rounds interleave every "
         "configuration and load.")


def config_kwargs(name: str, cores: int) -> dict:
    """The engine arguments of a named configuration (see the module docstring)."""
    if name == "default":
        return {}
    if name == "old":
        return {"cpu_threads": cores, "async_scheduling": False}
    if name == "sync":
        return {"async_scheduling": False}
    if name.startswith("t"):
        threads, _, sync = name[1:].partition("-")
        if threads.isdigit() and sync in ("", "sync"):
            kwargs: dict = {"cpu_threads": int(threads)}
            if sync:
                kwargs["async_scheduling"] = False
            return kwargs
    raise ValueError(f"unknown configuration {name!r}; use default, old, sync, tN or tN-sync")


def workload(num_prompts: int, vocab_size: int, input_len: tuple[int, int],
             output_len: tuple[int, int], seed: int = 0) -> tuple[list, list[int]]:
    """Prompts of random token ids with lengths uniform in ``input_len``, and output lengths
    uniform in ``output_len`` (the same for every run: seeded)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*input_len))]
               for _ in range(num_prompts)]
    return prompts, [rng.randint(*output_len) for _ in range(num_prompts)]


def child(args: argparse.Namespace) -> None:
    """One run (in a fresh process): print the throughput as JSON."""
    from hitchllm.cpu_threads import usable_cpus

    kwargs = config_kwargs(args.child_config, usable_cpus())
    import torch

    from hitchllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.child_model, device="cpu", dtype=args.dtype, **kwargs)
    prompts, outs = workload(args.num_prompts, llm.engine.vocab_size,
                             tuple(args.input_len), tuple(args.output_len))
    llm.generate([{"prompt_token_ids": prompts[0][:16]}],
                 SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    warm = time.perf_counter() - started
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(r.outputs[0].token_ids) for r in results]
    print(json.dumps({
        "tok_s": sum(map(len, tokens)) / seconds, "seconds": seconds, "start_s": warm,
        "threads": torch.get_num_threads(), "backend": llm.engine.attention_backend.name,
        "digest": zlib.crc32(repr(tokens).encode()),
    }))


def build_llama(path: Path) -> Path:
    """A random Llama, hidden 256 x 4 layers (8 query / 4 KV heads), fp32, with the bundled
    model's tokenizer (the workload is token ids; the tokenizer only detokenizes)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hitchllm.bundled_model import default_model_path

    torch.manual_seed(0)
    bundled = Path(default_model_path())
    vocab = json.loads((bundled / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / name, path / name)
    return path


def busy_loop(core: int) -> subprocess.Popen:
    """A process spinning on ``core``."""
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def run_once(model: str, config: str, busy: bool, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, __file__, "--child-model", model, "--child-config", config,
           "--num-prompts", str(args.num_prompts), "--dtype", args.dtype,
           "--input-len", *map(str, args.input_len), "--output-len", *map(str, args.output_len)]
    spinner = busy_loop(max(os.sched_getaffinity(0))) if busy else None
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if out.returncode:
        raise RuntimeError(f"run {config} on {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="default,old")
    parser.add_argument("--models", default="llama,bundled",
                        help="llama (random 256 x 4), bundled, or checkpoint directories")
    parser.add_argument("--loads", default="quiet,busy")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--output-len", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_model:
        child(args)
        return

    from hitchllm.bundled_model import default_model_path
    from hitchllm.cpu_threads import usable_cpus

    configs = args.configs.split(",")
    loads = args.loads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name in args.models.split(","):
            models[name] = (str(build_llama(Path(tmp) / "llama-256x4")) if name == "llama"
                            else default_model_path() if name == "bundled" else name)
        runs: dict[tuple[str, str, str], list[dict]] = {}
        for r in range(args.rounds):
            for model in models:
                for load in loads:
                    for config in configs:
                        res = run_once(models[model], config, load == "busy", args)
                        runs.setdefault((model, load, config), []).append(res)
                        print(f"round {r + 1} {model:8s} {load:5s} {config:10s} "
                              f"{res['tok_s']:8.1f} tok/s ({res['threads']} threads, "
                              f"{res.get('backend')}, start {res['start_s']:.1f} s)",
                              flush=True)
    lines = table(runs, models, loads, configs)
    print("\n".join(lines))
    if args.results:
        from results_md import append_results, entry_heading

        argv = sys.argv[1:]
        kept = [a for i, a in enumerate(argv) if a != "--results"
                and (i == 0 or argv[i - 1] != "--results")]
        note = (f"{usable_cpus()} usable cores, {args.rounds} rounds, {args.num_prompts} "
                f"requests, {args.dtype}")
        heading = entry_heading("cpu_steady", " ".join(["python benchmarks/cpu_steady.py",
                                                        *kept]), note)
        append_results(args.results, heading + lines, SECTION, ABOUT)


def table(runs: dict, models: dict, loads: list[str], configs: list[str]) -> list[str]:
    """Markdown: one row per model and configuration, a column per load, then busy/quiet."""
    both = {"quiet", "busy"} <= set(loads)
    head = "| model | config | threads | " + " | ".join(loads)
    head += (" | busy / quiet" if both else "") + " | same tokens |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for model in models:
        digests = {r["digest"] for (m, _, _), rs in runs.items() if m == model for r in rs}
        for config in configs:
            cells, medians = [], {}
            for load in loads:
                rates = [r["tok_s"] for r in runs[(model, load, config)]]
                medians[load] = statistics.median(rates)
                cells.append(f"{medians[load]:.0f} ({min(rates):.0f}-{max(rates):.0f})")
            threads = runs[(model, loads[0], config)][0]["threads"]
            row = f"| {model} | {config} | {threads} | " + " | ".join(cells)
            if both:
                row += f" | {medians['busy'] / medians['quiet']:.2f}"
            lines.append(row + f" | {'yes' if len(digests) == 1 else 'NO'} |")
    return lines


if __name__ == "__main__":
    main()
