"""Where one decode step's time goes: engine phases on the host and on the device.

Fills the engine with ``--batch-size`` requests of ``--context-len`` random prompt tokens, runs
until every request is decoding, times ``--steps`` plain steps (wall clock), then profiles a few
more with the torch profiler and prints, per phase, the host time (Python and launches) and the
device time of the kernels the phase launched. Attention is split out of the model only in
eager mode (a CUDA graph replays the whole forward as one launch).

    python benchmarks/profile_step.py --model /tmp/qwen3-0.6b --batch-size 256 --context-len 1024
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from hitchllm import LLM, SamplingParams
from hitchllm.attention import Attention
from hitchllm.entrypoints.cli import add_engine_args, engine_kwargs

PHASES = ("schedule", "prepare inputs", "attention metadata", "forward", "attention (in forward)",
          "logits", "sample + sync", "update requests", "detokenize + outputs")


def _wrap(obj: object, attr: str, label: str) -> None:
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapped)


def instrument(llm: LLM) -> None:
    """Wrap each engine phase in a named profiler range."""
    engine = llm.engine
    runner = engine.executor.runner
    _wrap(engine.scheduler, "schedule", "schedule")
    _wrap(runner, "_prepare_inputs", "prepare inputs")
    _wrap(runner.builder, "build", "attention metadata")
    _wrap(runner, "_eager_forward", "forward")
    _wrap(runner, "_replay", "forward")
    _wrap(runner.model, "compute_logits", "logits")
    _wrap(runner, "_sample", "sample + sync")
    _wrap(engine.scheduler, "update_from_output", "update requests")
    _wrap(engine.output_processor, "process", "detokenize + outputs")
    for layer in runner.model.modules():
        if isinstance(layer, Attention) and layer.impl is not None:
            _wrap(layer.impl, "forward", "attention (in forward)")


def fill(llm: LLM, batch: int, context: int, seed: int, temperature: float) -> None:
    """Queue ``batch`` requests and step until all of them are decoding."""
    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=temperature, max_tokens=100_000, ignore_eos=True)
    for _ in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    if len(engine.scheduler.running) != batch:
        raise SystemExit(f"only {len(engine.scheduler.running)} of {batch} requests fit the KV "
                         "cache; lower --batch-size or --context-len")


def busy_us(prof: torch.profiler.profile) -> float:
    """Microseconds during which at least one kernel or copy ran on the device."""
    spans = sorted({(e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA})
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy


def top_kernels(prof: torch.profiler.profile, k: int) -> list[tuple[str, int, float]]:
    """The ``k`` device kernels with the most total time: (name, calls, microseconds)."""
    calls: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    seen = set()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name in PHASES:
            continue
        key = (e.name, e.time_range.start)
        if key in seen:
            continue
        seen.add(key)
        calls[e.name] += 1
        total[e.name] += e.time_range.elapsed_us()
    return sorted(((n, calls[n], total[n]) for n in total), key=lambda r: -r[2])[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; the throughput workload samples at 0.6")
    parser.add_argument("--trace", type=Path, help="also write a Chrome trace here")
    args = parser.parse_args()

    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    cuda = engine.device.type == "cuda"
    fill(llm, args.batch_size, args.context_len, args.seed, args.temperature)
    for _ in range(3):
        engine.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3

    instrument(llm)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        sync()
    if args.trace:
        prof.export_chrome_trace(str(args.trace))

    host: dict[str, float] = defaultdict(float)
    device: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.name in PHASES:
            host[evt.name] += evt.cpu_time_total
            device[evt.name] += evt.device_time_total
    n = args.profile_steps
    runner_graphs = engine.executor.runner.graphs
    graphs = "CUDA graphs" if runner_graphs is not None and runner_graphs.captured else "eager"
    print(f"\nbatch {args.batch_size}, context ~{args.context_len}, backend "
          f"{engine.attention_backend.name}, {graphs}: {step_ms:.2f} ms/step wall "
          f"({args.batch_size / step_ms * 1e3:,.0f} tok/s), GPU busy "
          f"{busy_us(prof) / n / 1e3:.2f} ms/step\n")
    print("| phase | host ms/step | device ms/step |\n|---|---|---|")
    for name in PHASES:
        if name in host:
            print(f"| {name} | {host[name] / n / 1e3:.3f} | {device[name] / n / 1e3:.3f} |")
    print("\n| kernel (top 12 by device time) | calls/step | device ms/step |\n|---|---|---|")
    for name, calls, us in top_kernels(prof, 12):
        print(f"| `{name[:70]}` | {calls / n:.0f} | {us / n / 1e3:.3f} |")


if __name__ == "__main__":
    main()
