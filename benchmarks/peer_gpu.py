"""hitchllm vs nano-vllm on one GPU, nano-vllm's own benchmark workload, alternating rounds.

Issue 21, point 1. The peer (nano-vllm, unmodified, on FlashAttention-4 through a shim) and
its driver live in ../shared/peer (or a copy at .peer, as on the GPU machine; ``--peer``); its
README says how to stage FlashAttention-4 there. Each run is a fresh process: nano-vllm through
the peer's own ``bench_pair.py``, hitchllm through this script's ``--child`` mode, which takes
the identical workload from ``bench_pair.make_workload`` (the workload hash printed by both
proves it) and times it the same way (the same warm-up generate, CUDA synchronised around one
timed ``generate``), so hitchllm variants can pass engine arguments the peer driver does not
know (``--variant NAME key=value ...``).

    python benchmarks/peer_gpu.py --model /tmp/qwen3-0.6b --rounds 2 \\
        --variant default --variant budget16k max_num_batched_tokens=16384 --append-results

Without nano-vllm's dependencies (``--no-peer``) only the hitchllm variants run. Prints one
line per run and a summary (best and mean per engine, each variant's best over nano-vllm's
best), and with ``--append-results`` appends every round to benchmarks/RESULTS.md. Each
hitchllm run also reports its start-up phases and what compiled during its timed generate
(Triton kernels compiled or loaded from the disk cache, Dynamo graphs): one-time costs that
the peer's protocol, one timed generate per process, counts. ``--warm-pass`` has it generate
the workload once more in the same process (reported, not ranked) to show their size.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, unquote

HERE = Path(__file__).resolve().parent
SECTION = "## hitchllm vs nano-vllm on nano-vllm's workload (issue 21, benchmarks/peer_gpu.py)"


def find_peer(given: str | None) -> Path | None:
    """The peer folder: ``given``, else ../shared/peer beside the checkout, else .peer."""
    candidates = [Path(given)] if given else [HERE.parent.parent / "shared" / "peer",
                                               HERE.parent / ".peer"]
    return next((p.resolve() for p in candidates if (p / "bench_pair.py").exists()), None)


def parse_value(text: str) -> object:
    """An engine argument's value: a Python literal where it is one, else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


class CompileWatch:
    """Kernels Triton compiled or loaded from its disk cache (``triton.knobs`` hooks: each
    is a first launch of a specialization of a ``@triton.jit`` kernel in this process; the
    time excludes loading the binary onto the GPU) and Dynamo's graphs (inductor's kernels are
    in them), counted between ``start`` and ``stop``: one-time costs in a timed generate."""

    def __init__(self) -> None:
        self.kernels = 0
        self.kernel_s = 0.0
        self._began: float | None = None
        self._graphs = 0
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one before knobs: kernels stay uncounted
            return
        if hasattr(knobs.runtime, "jit_post_compile_hook"):
            knobs.runtime.jit_cache_hook = self._before
            knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *args: object, **kwargs: object) -> bool:
        self._began = time.perf_counter()
        return False  # compile as usual

    def _after(self, *args: object, **kwargs: object) -> bool:
        if self._began is not None:
            self.kernels += 1
            self.kernel_s += time.perf_counter() - self._began
            self._began = None
        return False

    @staticmethod
    def _dynamo_graphs() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    def start(self) -> None:
        self.kernels, self.kernel_s = 0, 0.0
        self._graphs = self._dynamo_graphs()

    def stop(self, prefix: str = "") -> str:
        """``key=value`` words for the RESULT line, each key starting with ``prefix``."""
        return (f"{prefix}jit_kernels={self.kernels} {prefix}jit_s={self.kernel_s:.2f} "
                f"{prefix}dynamo_graphs={self._dynamo_graphs() - self._graphs}")


def run_child(peer: Path, model: str, engine_args: dict[str, object], warm_pass: bool) -> int:
    """One timed hitchllm run on the peer workload (a fresh process). Besides the peer's
    measure it reports the engine's start-up phases, what compiled during the timed generate,
    and with ``warm_pass`` the same workload generated again in the same process (prompts
    shifted by one id, so the prefix cache does not serve them)."""
    sys.path.insert(0, str(peer))
    from bench_pair import fingerprint, make_workload

    prompts, max_tokens = make_workload()
    work = (f"requests={len(prompts)} prompt_tokens={sum(map(len, prompts))} "
            f"sum_max_tokens={sum(max_tokens)} workload={fingerprint(prompts, max_tokens)}")
    import torch

    from hitchllm import LLM, SamplingParams

    kwargs = dict(block_size=16, dtype="bfloat16", max_model_len=4096) | engine_args
    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    setup = time.perf_counter() - start
    watch = CompileWatch()
    phases = ",".join(f"{quote(name)}:{sec:.1f}" for name, sec in llm.engine.startup_times.items())
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    llm.generate(["Benchmark: "], SamplingParams(temperature=1.0, max_tokens=64), use_tqdm=False)
    sync()
    watch.start()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    compiled = watch.stop()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    ok = produced == sum(max_tokens)
    warm = ""
    if warm_pass:
        vocab = llm.engine.model_config.vocab_size
        shifted = [{"prompt_token_ids": [(t + 1) % vocab for t in p]} for p in prompts]
        watch.start()
        start = time.perf_counter()
        llm.generate(shifted, params, use_tqdm=False)
        sync()
        warm = f" warm_s={time.perf_counter() - start:.3f} {watch.stop('warm_')}"
    print(f"RESULT engine=hitchllm output_tokens={produced} seconds={seconds:.3f} "
          f"output_tok_s={produced / seconds:.1f} ok={str(ok).lower()} {work} "
          f"setup_s={setup:.1f} attention={llm.engine.attention_backend.name} "
          f"startup={phases} {compiled}{warm}", flush=True)
    return 0 if ok else 1


def run_one(cmd: list[str], timeout: float, env: dict[str, str]) -> dict[str, str]:
    """Run one engine process; its RESULT line as a dict (``error`` set when it failed)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if line is None:
        return {"error": "\n".join(out.splitlines()[-15:]), "wall_s": f"{wall:.0f}"}
    result = dict(w.split("=", 1) for w in line.split()[1:] if "=" in w)
    result["wall_s"] = f"{wall:.0f}"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint both engines load")
    parser.add_argument("--peer", help="the peer folder (default ../shared/peer, else .peer)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", nargs="+", action="append", metavar="NAME [key=value]",
                        help="a hitchllm configuration: a name, then LLM(...) arguments; "
                             "repeatable (default: one variant, 'default')")
    parser.add_argument("--no-peer", action="store_true", help="hitchllm variants only")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per engine run")
    parser.add_argument("--append-results", action="store_true")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--warm-pass", action="store_true",
                        help="hitchllm runs the workload a second time in the same process "
                             "(reported, not ranked)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON engine arguments: one run
    args = parser.parse_args()

    peer = find_peer(args.peer)
    if peer is None:
        parser.error("no peer folder with bench_pair.py (../shared/peer or .peer; or --peer)")
    if args.child is not None:
        return run_child(peer, args.model, json.loads(args.child), args.warm_pass)

    variants = [(v[0], {k: parse_value(x) for k, _, x in (a.partition("=") for a in v[1:])})
                for v in (args.variant or [["default"]])]
    for name, kw in variants:
        if any(not k for k in kw):
            parser.error(f"variant {name}: arguments are key=value")
    runs: list[tuple[str, list[str]]] = [
        (name, [sys.executable, __file__, "--model", args.model, "--peer", str(peer),
                "--child", json.dumps(kw), *(["--warm-pass"] if args.warm_pass else [])])
        for name, kw in variants]
    if not args.no_peer:
        runs.append(("nano-vllm", [sys.executable, str(peer / "bench_pair.py"), "--engine",
                                   "nanovllm", "--model", args.model]))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    rows: list[tuple[int, str, dict[str, str]]] = []
    for r in range(1, args.rounds + 1):
        for name, cmd in runs:
            res = run_one(cmd, args.timeout, env)
            rows.append((r, name, res))
            if "error" in res:
                print(f"round {r} {name}: FAILED after {res['wall_s']} s\n{res['error']}",
                      flush=True)
            else:
                print(f"round {r} {name}: {float(res['output_tok_s']):,.0f} output tok/s "
                      f"({res['output_tokens']} tokens in {res['seconds']} s, start-up "
                      f"{res.get('setup_s', '?')} s, ok={res['ok']}, workload "
                      f"{res['workload']})", flush=True)
    lines = summarize(rows, variants, args.no_peer)
    print("\n".join(lines))
    if args.append_results:
        sys.path.insert(0, str(HERE))
        from results_md import append_results, entry_heading

        desc = "; ".join(f"{n}: {' '.join(f'{k}={v}' for k, v in kw.items()) or 'defaults'}"
                         for n, kw in variants)
        command = " ".join(["python benchmarks/peer_gpu.py --model MODEL_DIR",
                            f"--rounds {args.rounds}",
                            *(["--warm-pass"] if args.warm_pass else []),
                            *("--variant " + " ".join(v) for v in args.variant or [])])
        append_results(args.results, entry_heading(
            "hitchllm vs nano-vllm, Qwen3-0.6B shape, nano-vllm's workload", command,
            f"(hitchllm variants: {desc})") + lines, SECTION,
            "Fresh process per run, alternating; nano-vllm unmodified on FlashAttention-4 "
            "(../shared/peer/README.md). Output tokens per second of one timed generate.")
    return 0 if all("error" not in res for _, _, res in rows) else 1


def summarize(rows: list[tuple[int, str, dict[str, str]]],
              variants: list[tuple[str, dict[str, object]]], no_peer: bool) -> list[str]:
    """A Markdown table of every run and the best-of-rounds ratios."""
    lines = ["| round | engine | output tok/s | seconds | output tokens | start-up s | ok |",
             "|---|---|---|---|---|---|---|"]
    best: dict[str, float] = {}
    for r, name, res in rows:
        if "error" in res:
            lines.append(f"| {r} | {name} | failed | | | | |")
            continue
        rate = float(res["output_tok_s"])
        best[name] = max(best.get(name, 0.0), rate)
        lines.append(f"| {r} | {name} | {rate:,.0f} | {res['seconds']} | {res['output_tokens']} "
                     f"| {res.get('setup_s', '')} | {res['ok']} |")
    lines.append("")
    lines += one_time_costs(rows)
    peer_best = best.get("nano-vllm")
    for name, _ in variants:
        if name in best:
            ratio = f", {best[name] / peer_best:.3f}x nano-vllm's best" if peer_best else ""
            lines.append(f"- {name}: best {best[name]:,.0f} output tok/s{ratio}")
    if peer_best:
        lines.append(f"- nano-vllm: best {peer_best:,.0f} output tok/s")
    elif not no_peer:
        lines.append("- nano-vllm: no successful run")
    return lines


def one_time_costs(rows: list[tuple[int, str, dict[str, str]]]) -> list[str]:
    """A table of each hitchllm run's start-up phases, the kernels Triton compiled or loaded
    and the Dynamo graphs compiled during its timed generate, and its warm pass (empty when
    no run reported them)."""
    runs = [(r, name, res) for r, name, res in rows if "jit_kernels" in res]
    if not runs:
        return []
    lines = ["| round | engine | start-up phases s | timed generate: Triton kernels (s) "
             "| Dynamo graphs | warm pass s | warm pass: Triton kernels (s), Dynamo graphs |",
             "|---|---|---|---|---|---|---|"]
    for r, name, res in runs:
        phases = ", ".join(unquote(p).replace(":", " ") for p in res.get("startup", "").split(","))
        warm = (f"{res['warm_s']} | {res['warm_jit_kernels']} ({res['warm_jit_s']}), "
                f"{res['warm_dynamo_graphs']}" if "warm_s" in res else " | ")
        lines.append(f"| {r} | {name} | {phases} | {res['jit_kernels']} ({res['jit_s']}) "
                     f"| {res['dynamo_graphs']} | {warm} |")
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
