"""The fused Triton MoE kernel vs a per-expert loop of torch matmuls (issue 18, point 4).

DeepSeek-V2-Lite's expert layers (64 experts, top-6, hidden 2048, expert intermediate 1408),
bf16, routing uniformly random (each token picks 6 distinct experts), for each number of
tokens ``M``:

- **fused**: ``fused_moe`` from the attention_triton plugin (expert sort on the device, two
  grouped GEMM launches, top-k weights applied in the second one's epilogue), timed as the
  engine runs it: replayed from a CUDA graph, CUDA-event median per call;
- **loop**: the core's PyTorch method (``grouped_experts``: sort by expert, read the
  per-expert counts on the host, one pair of matmuls per expert with tokens); it cannot be
  captured in a graph, so it is timed eagerly with CUDA events (launch overhead included, as
  the engine pays it when it runs this path outside graphs).

Each row also shows the weights' bytes read per second by the fused kernel (every expert
with a token read once) and how far its result is from the loop's (relative error).

    PYTHONPATH=core:plugins/attention_triton python benchmarks/moe_kernels.py \
        [--results benchmarks/RESULTS.md]

``--device cpu`` runs tiny shapes through Triton's interpreter (a smoke run: its times mean
nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from graph_timing import graph_time_us, kernel_bench_args
from results_md import append_results, entry_heading

SECTION = "## Fused MoE kernel vs a per-expert loop (issue 18)"
ABOUT = ("The fused Triton MoE kernel (expert-sorted blocks, grouped GEMMs, top-k weights in "
         "the epilogue) against the core's per-expert loop of torch matmuls, "
         "DeepSeek-V2-Lite expert shapes in bf16; benchmarks/moe_kernels.py.")

CALLS_PER_GRAPH = 10


@dataclass(frozen=True)
class Workload:
    """Expert layer shape and the token counts to time."""

    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: tuple[int, ...]


GPU_WORKLOAD = Workload(experts=64, top_k=6, hidden=2048, inter=1408,
                        tokens=(1, 4, 16, 64, 256, 1024, 4096))
CPU_WORKLOAD = Workload(experts=8, top_k=2, hidden=32, inter=24, tokens=(1, 5, 19))


def eager_time_us(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median time of one eager call: CUDA events on a GPU, wall time on the CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000)
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e6)
    return sorted(times)[len(times) // 2]


def measure(tokens: int, work: Workload, device: torch.device, repeats: int) -> dict:
    from hitchllm.layers.moe import grouped_experts
    from hitchllm_attention_triton.moe import fused_moe

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(tokens)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = randn(tokens, work.hidden)
    w13 = randn(work.experts, 2 * work.inter, work.hidden, scale=work.hidden**-0.5)
    w2 = randn(work.experts, work.hidden, work.inter, scale=work.inter**-0.5)
    scores = torch.rand(tokens, work.experts, generator=gen, device=device)
    ids = scores.topk(work.top_k, dim=1).indices
    weights = torch.softmax(scores.gather(1, ids), dim=1)

    def fused() -> torch.Tensor:
        return fused_moe(x, w13, w2, weights, ids)

    def loop() -> torch.Tensor:
        return grouped_experts(x, weights, ids, w13, w2)

    want = loop().float()
    error = ((fused().float() - want).norm() / want.norm().clamp(min=1e-30)).item()
    fused_us = (graph_time_us(fused, repeats, CALLS_PER_GRAPH) if device.type == "cuda"
                else eager_time_us(fused, device, repeats))
    loop_us = eager_time_us(loop, device, repeats)
    active = int(torch.unique(ids).numel())
    weight_bytes = active * 3 * work.inter * work.hidden * w13.element_size()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": tokens, "active": active, "fused": fused_us, "loop": loop_us,
            "gbps": weight_bytes / (fused_us * 1e-6) / 1e9, "error": error}


HEADER = ("| M | experts hit | fused Triton us | per-expert loop us | loop / fused | "
          "fused weight GB/s | rel. diff |\n|---|---|---|---|---|---|---|")


def fmt(row: dict) -> str:
    return (f"| {row['tokens']} | {row['active']} | {row['fused']:.1f} | {row['loop']:.1f} | "
            f"{row['loop'] / row['fused']:.1f}x | {row['gbps']:.0f} | {row['error']:.1e} |")


def main(argv: list[str] | None = None) -> None:
    args, device, repeats = kernel_bench_args(argv, __doc__)
    work = GPU_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD
    title = (f"Fused MoE vs per-expert loop ({work.experts} experts, top-{work.top_k}, "
             f"hidden {work.hidden}, intermediate {work.inter}, {args.device})")
    command = "python benchmarks/moe_kernels.py" + (" --device cpu" if args.device == "cpu"
                                                     else "")
    lines = [*entry_heading(title, command), HEADER]
    print(HEADER)
    for tokens in work.tokens:
        lines.append(fmt(measure(tokens, work, device, repeats)))
        print(lines[-1], flush=True)
    if args.results:
        append_results(args.results, lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
