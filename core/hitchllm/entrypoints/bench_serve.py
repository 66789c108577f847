"""``hitchllm bench serve``: a load test of a running OpenAI-compatible server.

Sends N streaming completion requests of random token ids (``ignore_eos``, so every request
produces exactly its output length) at a Poisson request rate or all at once, optionally under
a concurrency cap, and reports request throughput, output tokens/s, and TTFT, inter-token
latency and end-to-end latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import numpy as np

from hitchllm.bundled_model import DEFAULT_SERVED_MODEL_NAME
from hitchllm.entrypoints.machine import describe_machine
from hitchllm.entrypoints.sse_client import split_url, stream_events


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None  # None: no chunk carried text (the tokens decode to nothing)
    latency: float = 0.0
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for a one-token request, or when no
        chunk carried text)."""
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=DEFAULT_SERVED_MODEL_NAME,
                        help="served model name (default: the name `hitchllm serve` gives the "
                             f"bundled model, {DEFAULT_SERVED_MODEL_NAME})")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--vocab-size", type=int, default=256,
                        help="random prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--append-results", type=Path,
                        help="append a row to this markdown file (e.g. benchmarks/RESULTS.md)")
    parser.add_argument("--label", default="", help="what to call this run in the results file")


def make_workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.num_prompts):
        n_in = rng.randint(*args.input_len)
        n_out = rng.randint(*args.output_len)
        work.append(([rng.randrange(args.vocab_size) for _ in range(n_in)], n_out))
    return work


def arrival_times(args: argparse.Namespace) -> list[float]:
    """When each request of the workload is sent, in seconds from the start: Poisson arrivals
    at ``--request-rate`` (all at 0 when it is inf)."""
    if args.request_rate == float("inf"):
        return [0.0] * args.num_prompts
    gaps = np.random.default_rng(args.seed).exponential(1.0 / args.request_rate,
                                                        args.num_prompts)
    return [float(t) for t in np.concatenate([[0.0], np.cumsum(gaps[:-1])])]


async def _one(base: tuple[str, int, str], headers: dict[str, str], model: str,
               prompt: list[int], max_tokens: int) -> RequestResult:
    host, port, path = base
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }).encode()
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async for now, data in stream_events(host, port, f"{path}/completions", body, headers):
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "error event"))
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            if last is None:
                result.ttft = now - start
            else:
                result.chunk_gaps.append(now - last)
            last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # a failed request is counted, not fatal to the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    base = split_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    work = make_workload(args)
    limit = asyncio.Semaphore(args.max_concurrency or len(work))

    async def limited(prompt: list[int], n_out: int) -> RequestResult:
        async with limit:
            return await _one(base, headers, args.model, prompt, n_out)

    start = time.perf_counter()
    tasks = []
    for (prompt, n_out), at in zip(work, arrival_times(args), strict=True):
        if (wait := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(limited(prompt, n_out)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.chunk_gaps]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    e2e = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
        "req_per_s": len(ok) / duration, "output_tok_per_s": out_tokens / duration,
        "output_tokens": out_tokens,
        "textless": sum(r.ttft is None and r.output_tokens > 0 for r in ok),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", gaps), ("e2e", e2e)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = _pct(values, q)
    return summary


def print_table(s: dict[str, float]) -> None:
    print(f"requests {int(s['requests'])} (failed {int(s['failed'])}), "
          f"duration {s['duration_s']:.2f} s")
    print(f"request throughput {s['req_per_s']:.2f} req/s, "
          f"output {s['output_tok_per_s']:.1f} tok/s ({int(s['output_tokens'])} tokens)")
    if s["textless"]:
        print(f"warning: {int(s['textless'])} requests streamed tokens but no text (the "
              "tokenizer decodes their ids to nothing): TTFT, TPOT and ITL leave them out. "
              "Serve a tokenizer that covers the model's vocabulary (benchmarks/build_model.py "
              "writes one).")
    print(f"{'metric':<8}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"{name:<8}" + "".join(f"{s[f'{name}_p{q}_ms']:>10.1f}" for q in (50, 90, 99)))


def _command(args: argparse.Namespace) -> str:
    parts = ["hitchllm bench serve", f"--num-prompts {args.num_prompts}"]
    if args.request_rate != float("inf"):
        parts.append(f"--request-rate {args.request_rate:g}")
    if args.max_concurrency:
        parts.append(f"--max-concurrency {args.max_concurrency}")
    parts += [f"--input-len {args.input_len[0]} {args.input_len[1]}",
              f"--output-len {args.output_len[0]} {args.output_len[1]}",
              f"--vocab-size {args.vocab_size}", f"--seed {args.seed}"]
    return " ".join(parts)


def append_results(path: Path, args: argparse.Namespace, s: dict[str, float]) -> None:
    new = not path.exists() or not path.read_text().strip()
    with path.open("a") as f:
        if new:
            f.write("# Benchmark results\n\n")
        f.write(
            f"\n### bench serve {args.label} ({date.today()}, {describe_machine()})\n\n"
            f"`{_command(args)}`\n\n"
            "| req/s | output tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | "
            "ITL p50/p90/p99 ms | E2E p50/p90/p99 ms | failed |\n|---|---|---|---|---|---|---|\n"
            f"| {s['req_per_s']:.2f} | {s['output_tok_per_s']:.1f} | "
            + " | ".join("/".join(f"{s[f'{n}_p{q}_ms']:.1f}" for q in (50, 90, 99))
                         for n in ("ttft", "tpot", "itl", "e2e"))
            + f" | {int(s['failed'])} |\n")


def main(args: argparse.Namespace) -> int:
    results, duration = asyncio.run(run_load(args))
    summary = summarize(results, duration)
    print_table(summary)
    errors = {r.error for r in results if not r.ok}
    for err in list(errors)[:3]:
        print(f"error: {err}")
    if args.append_results:
        append_results(args.append_results, args, summary)
    return 0 if summary["failed"] == 0 else 1
