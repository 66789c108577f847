"""Where a whole offline run's time goes: every step of nano-vllm's workload, by kind and batch.

Issue 21, point 2. One engine runs nano-vllm's benchmark workload (256 prompts of 100-1024
random token ids, 100-1024 output tokens, temperature 0.6, ``ignore_eos``; ``--num-prompts``
takes its first N) with the step timeline on (``hitchllm.timeline``: CUDA events at each
step's first and last work and around the forward). Every step is put in one group: prompt
steps (only prompt chunks), mixed steps (prompt chunks with decodes), and decode steps by batch
size. Per group: steps, output tokens, the device's time in its steps, the device's idle time
before them (the host was behind), and that group's output tok/s. Against it, the floor: the
bytes every decode must read (its request's KV cache, the weights once per step) at the card's
measured copy bandwidth.

``--warmup-run`` runs the workload once untimed first (prompts shifted by two token ids), so
one-time costs (kernel compiles for shapes the start-up did not meet) stay out of the table.
``--prefill-only`` gives every prompt one output token, so the run is its prompt steps alone
(with ``--engine-arg enable_fusion=False`` it tells whether compiled elementwise kernels or
the host pace those eager steps). ``--profile`` runs the workload once more under
``torch.profiler`` (prompts shifted by one token id so the prefix cache does not serve them)
and adds the device time of the run's kernels by category (attention, GEMMs, fused
elementwise, sampling, copies, other).

    python benchmarks/run_breakdown.py --model /tmp/qwen3-0.6b [--profile] [--append-results]
    python benchmarks/run_breakdown.py --model M --engine-arg max_num_batched_tokens=16384

On the CPU it runs too (``--device cpu``; device times are then host times).
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from hitchllm import LLM, SamplingParams, timeline

HERE = Path(__file__).resolve().parent
SECTION = "## Where a whole run's time goes (issue 21 point 2, benchmarks/run_breakdown.py)"
DECODE_EDGES = (192, 128, 64, 32, 16, 1)
KERNEL_CATEGORIES = (  # first match wins; matched against the kernel's name
    ("attention", r"paged_attention|merge_splits|mla_decode|attn|fmha|flash"),
    ("KV cache write", r"write_kv|reshape_and_cache|kv_cache"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm90_|sm80_"),
    ("fused elementwise (compiled)", r"^triton_|fused"),
    ("sampling", r"softmax|exponential|race|argmax|argmin|sort|topk|cumsum|distribution|multinomial"
                 r"|reduce|max_kernel"),
    ("copies and fills", r"[Mm]emcpy|[Mm]emset|copy|fill|index|gather|scatter|cat"),
)


def nano_workload(num_prompts: int = 256) -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's workload: seed 0, all prompt lengths and ids drawn first, then the
    output lengths (``num_prompts`` < 256 keeps the first ones of the 256)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    return prompts[:num_prompts], max_tokens[:num_prompts]


def shifted(prompts: list[list[int]], by: int) -> list[dict[str, list[int]]]:
    """The prompts with every token id moved by ``by`` (so the prefix cache misses them)."""
    return [{"prompt_token_ids": [(t + by) % 10000 for t in p]} for p in prompts]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write), best of 5."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * (1 << 30) / best


@dataclass
class Step:
    """One step of a run, from its timeline marks."""

    requests: int
    tokens: int
    decodes: int
    device_s: float  # first to last device work of the step
    idle_s: float  # device idle between the previous step's end and this one's start
    forward_s: float
    graph: bool

    @property
    def group(self) -> str:
        if self.tokens == self.decodes:
            low = next(e for e in DECODE_EDGES if self.requests >= e)
            high = max(self.requests, 256) if low == DECODE_EDGES[0] else \
                DECODE_EDGES[DECODE_EDGES.index(low) - 1] - 1
            return f"decode {low}-{high}"
        return "prompt only" if self.decodes == 0 else "mixed"


def read_steps(marks: list[timeline.Mark]) -> list[Step]:
    """The run's steps in order (the driver's plans matched with the runner's device marks)."""
    launched = sorted((m for m in marks if m.what == "launched" and m.info.get("requests")),
                      key=lambda m: m.step)
    at: dict[str, dict[int, float]] = defaultdict(dict)
    for m in marks:
        if m.what in ("step_start", "step_end", "forward_start", "forward_end"):
            at[m.what][m.step] = m.t
    graphs = {m.step for m in marks if m.what in ("graph_replay", "pieces_replay")}
    device_steps = sorted(at["step_start"])
    if len(device_steps) != len(launched):
        raise RuntimeError(f"{len(launched)} plans but {len(device_steps)} device steps")
    steps, prev_end = [], None
    for plan, s in zip(launched, device_steps, strict=True):
        start, end = at["step_start"][s], at["step_end"][s]
        steps.append(Step(
            requests=plan.info["requests"], tokens=plan.info["tokens"],
            decodes=plan.info.get("decodes", 0), device_s=end - start,
            idle_s=max(0.0, start - prev_end) if prev_end is not None else 0.0,
            forward_s=at["forward_end"].get(s, end) - at["forward_start"].get(s, start),
            graph=s in graphs))
        prev_end = end
    return steps


def group_table(steps: list[Step], wall: float) -> list[str]:
    """Per group: steps, output tokens, device and idle seconds, share of the run, tok/s."""
    order = ["prompt only", "mixed"] + [s.group for s in sorted(
        (s for s in steps if s.tokens == s.decodes), key=lambda s: -s.requests)]
    groups: dict[str, list[Step]] = {g: [] for g in dict.fromkeys(order)}
    for s in steps:
        groups[s.group].append(s)
    lines = ["| steps | count | graph | output tokens | device s | idle before s | share of run "
             "| device ms/step | output tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, group in groups.items():
        if not group:
            continue
        dev, idle = sum(s.device_s for s in group), sum(s.idle_s for s in group)
        out = sum(s.decodes for s in group)
        rate = f"{out / (dev + idle):,.0f}" if out else ""
        lines.append(f"| {name} | {len(group)} | {sum(s.graph for s in group)} | {out:,} | "
                     f"{dev:.3f} | {idle:.3f} | {(dev + idle) / wall:.1%} | "
                     f"{1e3 * dev / len(group):.2f} | {rate} |")
    dev, idle = sum(s.device_s for s in steps), sum(s.idle_s for s in steps)
    lines.append(f"| all steps | {len(steps)} | {sum(s.graph for s in steps)} | "
                 f"{sum(s.decodes for s in steps):,} | {dev:.3f} | {idle:.3f} | "
                 f"{(dev + idle) / wall:.1%} | {1e3 * dev / len(steps):.2f} | |")
    return lines


def floor_lines(llm: LLM, prompts: list[list[int]], max_tokens: list[int], wall: float,
                produced: int, bandwidth: float) -> list[str]:
    """The bandwidth floor: every decode reads its KV cache, every step the weights."""
    mc = llm.engine.model_config
    kv_per_token = (2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
                    * torch.finfo(llm.engine.kv_cache_dtype).bits // 8)
    # decode t of a request (t = 1 .. n - 1; the first token comes from the prompt's step)
    # reads p + t tokens of context
    kv_reads = sum(n * len(p) - len(p) + (n - 1) * n // 2 for p, n in zip(prompts, max_tokens))
    model = llm.engine.executor.worker.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = max(max_tokens)
    kv_s = kv_reads * kv_per_token / bandwidth
    w_s = weights * steps / bandwidth
    floor = produced / (kv_s + w_s)
    return [f"Floor at {bandwidth / 1e12:.2f} TB/s (this card's copy bandwidth): KV reads "
            f"{kv_reads * kv_per_token / 1e12:.2f} TB ({kv_s:.2f} s) + weights "
            f"{weights / 1e9:.2f} GB x {steps} steps ({w_s:.2f} s) = {kv_s + w_s:.2f} s, "
            f"{floor:,.0f} output tok/s; this run {produced / wall:,.0f} tok/s in {wall:.2f} s "
            f"= {produced / wall / floor:.1%} of the floor."]


def kernel_table(prof: torch.profiler.profile, wall: float) -> list[str]:
    """Device time of the profiled run's kernels by category (``KERNEL_CATEGORIES``)."""
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0.0) or 0.0
        if us <= 0 or evt.key.startswith("ProfilerStep"):
            continue
        cat = next((c for c, pattern in KERNEL_CATEGORIES if re.search(pattern, evt.key)),
                   "other")
        totals[cat] += us
        top[cat][evt.key[:60]] += us
    busy = sum(totals.values())
    lines = [f"Kernels over the profiled run ({wall:.2f} s wall under the profiler, device busy "
             f"{busy / 1e6:.2f} s):", "",
             "| category | device s | share of busy | largest kernels |", "|---|---|---|---|"]
    for cat, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        names = sorted(top[cat].items(), key=lambda kv: -kv[1])[:2]
        biggest = "; ".join(f"`{n}` {v / 1e6:.2f} s" for n, v in names)
        lines.append(f"| {cat} | {us / 1e6:.3f} | {us / busy:.1%} | {biggest} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an LLM(...) argument (a Python literal or a string); repeatable")
    parser.add_argument("--profile", action="store_true", help="add kernel categories")
    parser.add_argument("--prefill-only", action="store_true",
                        help="one output token per prompt: the prompt steps alone")
    parser.add_argument("--warmup-run", action="store_true",
                        help="run the workload once untimed first (compiles out of the table)")
    parser.add_argument("--label", default="Qwen3-0.6B shape")
    parser.add_argument("--append-results", action="store_true")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()

    engine_args: dict[str, object] = {}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            engine_args[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            engine_args[key] = value
    if args.device:
        engine_args["device"] = args.device
    os.environ[timeline.ENV_VAR] = "1"
    prompts, max_tokens = nano_workload(args.num_prompts)
    if args.prefill_only:
        max_tokens = [1] * len(prompts)
    llm = LLM(args.model, **({"block_size": 16, "dtype": "bfloat16", "max_model_len": 4096}
                             | engine_args))
    device = llm.engine.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate(["Benchmark: "], SamplingParams(temperature=1.0, max_tokens=64), use_tqdm=False)
    sync()
    first = ""
    if args.warmup_run:  # the workload once untimed, so one-time compiles stay out of the table
        start = time.perf_counter()
        llm.generate(shifted(prompts, 2), params, use_tqdm=False)
        sync()
        first = f"; the untimed first pass took {time.perf_counter() - start:.2f} s"
    timeline.drain()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - start
    steps = read_steps(timeline.drain())
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    lines = [f"{produced:,} output tokens in {wall:.2f} s: {produced / wall:,.0f} output tok/s "
             f"({llm.engine.attention_backend.name}, {len(steps)} steps; engine arguments: "
             f"{engine_args or 'defaults'}{first})", ""]
    lines += [*group_table(steps, wall), ""]
    if device.type == "cuda" and not args.prefill_only:
        lines += floor_lines(llm, prompts, max_tokens, wall, produced, copy_bandwidth(device))
    if args.profile and device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            llm.generate(shifted(prompts, 1), params, use_tqdm=False)
            sync()
            prof_wall = time.perf_counter() - start
        lines += ["", *kernel_table(prof, prof_wall)]
    print("\n".join(lines), flush=True)
    if args.append_results:
        sys.path.insert(0, str(HERE))
        from results_md import append_results, entry_heading

        command = " ".join(["python benchmarks/run_breakdown.py --model MODEL_DIR",
                            *(f"--engine-arg {a}" for a in args.engine_arg),
                            "--prefill-only" * args.prefill_only,
                            "--warmup-run" * args.warmup_run, "--profile" * args.profile])
        append_results(args.results, entry_heading(f"whole run, {args.label}", command.strip())
                       + lines, SECTION,
                       "Every step of one run by kind and batch: the device's time in the "
                       "steps, its idle time before them, output tok/s per group; the "
                       "bandwidth floor; kernel time by category under the profiler.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
