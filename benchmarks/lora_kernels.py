"""Grouped LoRA kernels vs a per-adapter loop and the base layer's GEMM (issue 17, point 5).

For each linear layer of a Llama-8B decoder layer (``qkv``: 4096 -> 4096 + 1024 + 1024;
``o``: 4096 -> 4096; ``gate_up``: 4096 -> 2 x 14336; ``down``: 14336 -> 4096), rank-16 adapters
in a pool of 8 slots and each number of tokens ``T``, it times:

- **grouped**: ``lora_shrink`` + ``lora_expand`` per output slice (one slice per adapter
  target: q, k and v; gate and up), sharing one ``group_tokens`` table, as a layer does;
- **loop**: the naive approach, a loop over adapters of torch matmuls on the adapter's rows
  (``x[rows] @ A.T * scaling @ B.T`` added into ``out[rows]``), row indices prepared outside
  the timing;
- **base**: the layer's own bf16 ``F.linear`` at the same ``T``.

A second table sums the four layers (one decoder layer's LoRA cost against its GEMMs).

Decode batches (``T`` up to 256) give token ``t`` adapter ``t % 8``; the 2048-token batch is
a prefill of 4 requests, 512 tokens each, with adapters 0..3. ``group_tokens``, built once
per step for all layers, is timed on its own. Times are medians of CUDA-event times of calls
replayed from a CUDA graph (as the engine replays decode steps), in microseconds; each row
also shows how far the grouped result is from the loop's (a sanity check, relative error).

    PYTHONPATH=core:plugins/lora python benchmarks/lora_kernels.py \
        [--results benchmarks/RESULTS.md]

``--device cpu`` runs tiny shapes through Triton's interpreter (a smoke run: its times mean
nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from graph_timing import device_time_us, kernel_bench_args
from results_md import append_results, entry_heading

SECTION = "## Grouped LoRA kernels vs a per-adapter loop (issue 17)"
ABOUT = ("Grouped shrink+expand (Triton) against a loop of per-adapter torch matmuls and the "
         "base layer's bf16 GEMM, Llama-8B layer shapes; benchmarks/lora_kernels.py.")



@dataclass(frozen=True)
class Workload:
    """Layers (name -> input width and output slice widths), token counts, rank, slots."""

    layers: dict[str, tuple[int, tuple[int, ...]]]
    tokens: tuple[int, ...]
    rank: int
    adapters: int
    prefill_tokens: int  # batches at least this large are prefills of 4 requests


GPU_WORKLOAD = Workload(
    layers={"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
            "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))},
    tokens=(1, 8, 64, 256, 2048), rank=16, adapters=8, prefill_tokens=2048)
CPU_WORKLOAD = Workload(layers={"qkv": (64, (48, 16, 16)), "down": (96, (64,))},
                        tokens=(1, 12, 40), rank=8, adapters=3, prefill_tokens=40)


def token_slots(tokens: int, work: Workload) -> torch.Tensor:
    if tokens >= work.prefill_tokens:
        return torch.arange(4).repeat_interleave(-(-tokens // 4))[:tokens] % work.adapters
    return torch.arange(tokens) % work.adapters


def measure(name: str, hidden: int, widths: tuple[int, ...], tokens: int, work: Workload,
            device: torch.device, repeats: int) -> dict:
    from hitchllm_lora.kernels import group_tokens, lora_expand, lora_shrink

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    x = randn(tokens, hidden)
    weight = randn(sum(widths), hidden, scale=hidden**-0.5)
    pools = [(randn(work.adapters, work.rank, hidden, scale=hidden**-0.5),
              randn(work.adapters, width, work.rank, scale=work.rank**-0.5))
             for width in widths]
    scaling = torch.full((work.adapters,), 2.0, device=device)
    slots = token_slots(tokens, work)
    rows = [(s, (slots == s).nonzero().flatten().to(device)) for s in range(work.adapters)]
    rows = [(s, r) for s, r in rows if r.numel()]
    token_slot = slots.to(device, torch.int32)
    groups = group_tokens(token_slot, work.adapters)
    out = torch.zeros(tokens, sum(widths), device=device, dtype=dtype)

    def grouped() -> None:
        offset = 0
        for (lora_a, lora_b), width in zip(pools, widths):
            y = lora_shrink(x, lora_a, token_slot, scaling, groups=groups)
            lora_expand(y, lora_b, token_slot, out, offset, groups=groups)
            offset += width

    def loop() -> None:
        offset = 0
        for (lora_a, lora_b), width in zip(pools, widths):
            for s, r in rows:
                delta = (x[r] @ lora_a[s].T * scaling[s]) @ lora_b[s].T
                out[:, offset:offset + width].index_add_(0, r, delta)
            offset += width

    grouped()
    got = out.float().clone()
    out.zero_()
    loop()
    want = out.float()
    error = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
    row = {"layer": name, "shape": f"{hidden} -> {' + '.join(map(str, widths))}",
           "tokens": tokens, "error": error,
           "base": device_time_us(lambda: F.linear(x, weight), device, repeats),
           "grouped": device_time_us(grouped, device, repeats),
           "loop": device_time_us(loop, device, repeats)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def grouping_us(tokens: int, work: Workload, device: torch.device, repeats: int) -> float:
    from hitchllm_lora.kernels import group_tokens

    token_slot = token_slots(tokens, work).to(device, torch.int32)
    return device_time_us(lambda: group_tokens(token_slot, work.adapters), device, repeats)


HEADER = ("| layer | H_in -> N | T | base GEMM us | grouped shrink+expand us | "
          "grouped / base | per-adapter loop us | loop / grouped | rel. diff |\n"
          "|---|---|---|---|---|---|---|---|---|")


SUMMARY_HEADER = ("| T | base GEMMs us | grouped LoRA us | grouped / base | per-adapter loop us | "
                  "group_tokens us (once per step) |\n|---|---|---|---|---|---|")


def fmt(row: dict) -> str:
    return (f"| {row['layer']} | {row['shape']} | {row['tokens']} | {row['base']:.1f} | "
            f"{row['grouped']:.1f} | {row['grouped'] / row['base']:.0%} | {row['loop']:.1f} | "
            f"{row['loop'] / row['grouped']:.1f}x | {row['error']:.1e} |")


def main(argv: list[str] | None = None) -> None:
    args, device, repeats = kernel_bench_args(argv, __doc__)
    work = GPU_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD
    title = f"Grouped LoRA kernels vs per-adapter loop (rank {work.rank}, " \
            f"{work.adapters} adapters, {args.device})"
    command = "python benchmarks/lora_kernels.py" + (" --device cpu" if args.device == "cpu"
                                                      else "")
    lines = [*entry_heading(title, command), HEADER]
    print(HEADER)
    rows = []
    for name, (hidden, widths) in work.layers.items():
        for tokens in work.tokens:
            rows.append(measure(name, hidden, widths, tokens, work, device, repeats))
            lines.append(fmt(rows[-1]))
            print(lines[-1], flush=True)
    summary = ["Sums over the layers above (one decoder layer):", "",
               SUMMARY_HEADER]
    for tokens in work.tokens:
        total = {key: sum(row[key] for row in rows if row["tokens"] == tokens)
                 for key in ("base", "grouped", "loop")}
        summary.append(
            f"| {tokens} | {total['base']:.1f} | {total['grouped']:.1f} | "
            f"{total['grouped'] / total['base']:.0%} | {total['loop']:.1f} | "
            f"{grouping_us(tokens, work, device, repeats):.1f} |")
    print("\n".join(summary))
    lines += ["", *summary]
    if args.results:
        append_results(args.results, lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
