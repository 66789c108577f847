"""What the OpenAI server keeps of the engine's speed: the same requests, at the same arrival
times, through ``hitchllm serve`` (streamed over HTTP, as `hitchllm bench serve` sends them) and
straight into an ``LLMEngine`` in a process of its own (no HTTP, no asyncio), in one run.

    python benchmarks/serve_vs_offline.py [workload flags] -- [hitchllm serve flags]
    # CPU, a small random Llama built here (no serve flags given):
    python benchmarks/serve_vs_offline.py --num-prompts 64 --output-len 64 64
    # GPU machine:
    python benchmarks/serve_vs_offline.py --num-prompts 200 --input-len 1024 1024 \\
        --output-len 256 256 --vocab-size 32000 -- --model /path/to/model

Each round runs the offline side, then the server once per ``--server-modes`` (the engine in a
thread of the server's process, and in a process of its own), all on the same requests.
Reports every side's output tok/s, TTFT and TPOT percentiles, and the ratios the serving goals
are stated in: served output tok/s over offline output tok/s, and served p50 TPOT over the
offline p50 TPOT (at the same arrivals the engine runs the same batches, so its TPOT is its
step time at that batch). The offline side replays the arrivals: a request joins the engine
once its arrival time has passed (and, under ``--max-concurrency``, a slot is free); its first
token and finish are timed when the step that produced them returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hitchllm.cpu_threads import default_omp_wait_policy

default_omp_wait_policy()  # as `hitchllm serve` does, before anything imports torch

from results_md import append_results, entry_heading  # noqa: E402
from server_process import running_server  # noqa: E402

from hitchllm.entrypoints import bench_serve  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS.md")
SERVED_NAME = "bench-model"
# Server mode -> the serve flag that selects it.
SERVER_MODES = {"engine-thread": "--no-engine-process", "engine-process": "--engine-process"}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, serve_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 128])
    parser.add_argument("--output-len", type=int, nargs=2, default=[64, 64])
    parser.add_argument("--vocab-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run both sides N times (alternating) and report every round")
    parser.add_argument("--hidden-size", type=int, default=64,
                        help="without serve flags: the hidden size of the random Llama built "
                             "(small, so that the engine step is fast and the server's own cost "
                             "shows)")
    parser.add_argument("--server-modes", nargs="+", choices=list(SERVER_MODES),
                        default=list(SERVER_MODES),
                        help="how the server runs its engine, each measured on the same "
                             "requests every round: in a thread of the server's process "
                             "(engine-thread, --no-engine-process) or in a process of its own "
                             "(engine-process, the default of hitchllm serve)")
    parser.add_argument("--append-results", type=Path, nargs="?", const=RESULTS)
    parser.add_argument("--label", default="")
    parser.add_argument("--offline-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    args.model, args.api_key = SERVED_NAME, "none"
    return args, serve_args


# ---- the offline side (run in a child process) ---------------------------------------------


def run_offline(args: argparse.Namespace, serve_args: list[str]) -> dict[str, float]:
    """Replay the workload's arrivals into an ``LLMEngine`` built from ``serve_args``."""
    from hitchllm.config import EngineConfig
    from hitchllm.engine.llm_engine import LLMEngine
    from hitchllm.entrypoints.cli import build_parser, engine_kwargs
    from hitchllm.sampling_params import SamplingParams

    parsed = build_parser().parse_args(["serve", *serve_args])
    model = parsed.model_tag or parsed.model
    kwargs = engine_kwargs(parsed)
    kwargs.pop("model", None)
    engine = LLMEngine(EngineConfig(model=model, **kwargs))
    work = bench_serve.make_workload(args)
    arrivals = bench_serve.arrival_times(args)
    cap = args.max_concurrency or len(work)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    warm = argparse.Namespace(**{**vars(args), "num_prompts": 1, "seed": args.seed + 1})
    [(prompt, _)] = bench_serve.make_workload(warm)
    engine.add_request({"prompt_token_ids": prompt}, params(4), "warm-up")
    while engine.has_unfinished_requests():
        engine.step()

    first: dict[str, float] = {}
    # When each request's output last grew, and the gaps between growths (inter-token latency,
    # as the served side measures it between streamed chunks).
    grew: dict[str, float] = {}
    gaps: dict[str, list[float]] = {}
    done: dict[str, float] = {}
    sent: dict[str, float] = {}
    next_up = 0
    start = time.perf_counter()
    while len(done) < len(work):
        now = time.perf_counter() - start
        while (next_up < len(work) and arrivals[next_up] <= now
               and len(sent) - len(done) < cap):
            rid = str(next_up)
            engine.add_request({"prompt_token_ids": work[next_up][0]}, params(work[next_up][1]),
                               rid)
            sent[rid] = max(arrivals[next_up], now)
            next_up += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_up] - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            rid = out.request_id
            if out.outputs[0].token_ids:
                if rid in grew:
                    gaps.setdefault(rid, []).append(now - grew[rid])
                grew[rid] = now
                first.setdefault(rid, now)
            if out.finished:
                done[out.request_id] = now
    duration = max(done.values())
    engine.close()
    results = []
    for rid, t_sent in sent.items():
        n_out = work[int(rid)][1]
        result = bench_serve.RequestResult(ok=True, ttft=first[rid] - t_sent,
                                           latency=done[rid] - t_sent, output_tokens=n_out,
                                           chunk_gaps=gaps.get(rid, []))
        results.append(result)
    return bench_serve.summarize(results, duration)


# ---- the served side, and the comparison ---------------------------------------------------


def run_served(args: argparse.Namespace, url: str) -> dict[str, float]:
    warm = argparse.Namespace(**{**vars(args), "num_prompts": 1, "seed": args.seed + 1,
                                 "request_rate": float("inf"), "output_len": [4, 4],
                                 "base_url": f"{url}/v1"})
    asyncio.run(bench_serve.run_load(warm))
    load = argparse.Namespace(**{**vars(args), "base_url": f"{url}/v1"})
    results, duration = asyncio.run(bench_serve.run_load(load))
    summary = bench_serve.summarize(results, duration)
    if summary["failed"]:
        errors = {r.error for r in results if not r.ok}
        raise SystemExit(f"{int(summary['failed'])} served requests failed: {sorted(errors)[:3]}")
    return summary


def offline_in_child(args: argparse.Namespace, serve_args: list[str], own_argv: list[str],
                     ) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        subprocess.run([sys.executable, __file__, *own_argv, "--offline-child", str(out),
                        "--", *serve_args], check=True)
        return json.loads(out.read_text())


def ratios(served: dict[str, float], offline: dict[str, float]) -> dict[str, float]:
    return {"throughput": served["output_tok_per_s"] / offline["output_tok_per_s"],
            "tpot_p50": served["tpot_p50_ms"] / offline["tpot_p50_ms"]}


def report(rounds: list[tuple[dict[str, float], dict[str, dict[str, float]]]]) -> str:
    """One row per side of each round: the offline engine, then each server mode with its
    ratios to that round's offline run."""
    lines = ["| round | side | output tok/s | TTFT p50/p99 ms | TPOT p50/p90/p99 ms | "
             "ITL p50/p99 ms | served/offline tok/s | served/offline TPOT p50 |",
             "|---|---|---|---|---|---|---|---|"]
    for i, (offline, served) in enumerate(rounds, 1):
        sides = [("offline", offline, " | "), *(
            (f"served, {mode}", s, "{throughput:.3f} | {tpot_p50:.3f}".format(
                **ratios(s, offline))) for mode, s in served.items())]
        for side, s, tail in sides:
            lines.append(
                f"| {i} | {side} | {s['output_tok_per_s']:.1f} | "
                f"{s['ttft_p50_ms']:.1f}/{s['ttft_p99_ms']:.1f} | "
                f"{s['tpot_p50_ms']:.2f}/{s['tpot_p90_ms']:.2f}/{s['tpot_p99_ms']:.2f} | "
                f"{s['itl_p50_ms']:.2f}/{s['itl_p99_ms']:.2f} | {tail} |")
    return "\n".join(lines)


def summary(rounds: list[tuple[dict[str, float], dict[str, dict[str, float]]]]) -> str:
    """Per server mode, the median (min-max) over the rounds of each ratio: on a shared
    machine the ratios within a round are what compare, not tok/s across rounds."""
    lines = ["| server mode | rounds | served/offline tok/s | served/offline TPOT p50 |",
             "|---|---|---|---|"]
    for mode in rounds[0][1]:
        per = [ratios(served[mode], offline) for offline, served in rounds]
        cells = []
        for key in ("throughput", "tpot_p50"):
            values = sorted(r[key] for r in per)
            cells.append(f"{statistics.median(values):.3f} ({values[0]:.3f}-{values[-1]:.3f})")
        lines.append(f"| {mode} | {len(per)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def recorded_command(argv: list[str]) -> str:
    """The command line as RESULTS.md records it: the model's folder (this machine's) as
    MODEL_DIR."""
    shown = ["MODEL_DIR" if i and argv[i - 1] == "--model" else a for i, a in enumerate(argv)]
    return shlex.join(["python", "benchmarks/serve_vs_offline.py", *shown])


def main(argv: list[str]) -> None:
    args, serve_args = parse_args(argv)
    if args.offline_child is not None:
        args.offline_child.write_text(json.dumps(run_offline(args, serve_args)))
        return
    own_argv = argv[: argv.index("--")] if "--" in argv else list(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if not serve_args:
            from hitchllm.tiny_model import build_tiny_checkpoint

            h = args.hidden_size
            model = build_tiny_checkpoint(Path(tmp) / f"llama-{h}x2", "LlamaForCausalLM",
                                          hidden_size=h, intermediate_size=3 * h,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=1024)
            serve_args = ["--model", str(model), "--device", "cpu"]
        rounds = []
        for _ in range(args.repeat):
            offline = offline_in_child(args, serve_args, own_argv)
            served = {}
            for mode in args.server_modes:
                flags = [*serve_args, SERVER_MODES[mode], "--served-model-name", SERVED_NAME]
                with running_server(flags, timeout=600) as url:
                    served[mode] = run_served(args, url)
            rounds.append((offline, served))
            print(report(rounds[-1:]), flush=True)
    table = report(rounds) + "\n\n" + summary(rounds)
    print(table)
    if args.append_results:
        append_results(args.append_results, [
            *entry_heading(f"served vs offline {args.label}", recorded_command(argv)), table])


if __name__ == "__main__":
    main(sys.argv[1:])
