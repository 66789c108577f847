"""A decoder layer's o_proj and down_proj with the add-and-norm after them, at decode sizes:
cuBLAS (``F.linear``) and ``fused.add_rms_norm`` against the split-K partial sums summed by the
norm's kernel (``hitchllm.models.split_k``), Qwen3-0.6B shapes, bf16, device times replayed
from CUDA graphs. The last columns give each route's largest distance from float64 over the
projection's output.

    python benchmarks/split_k.py [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from results_md import append_results, entry_heading

from hitchllm.models import fused, split_k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    header = ("| projection | rows | cuBLAS + norm us | split sums + norm us | speed-up | "
              "max error vs float64, cuBLAS | split sums |\n|---|---|---|---|---|---|---|")
    lines = [*entry_heading("o_proj / down_proj + add-and-norm at decode sizes, Qwen3-0.6B, bf16",
                            "python benchmarks/split_k.py"), header]
    print(header)
    for name, inner in (("o_proj", 2048), ("down_proj", 3072)):
        weight = torch.randn(1024, inner, device="cuda", generator=gen).bfloat16() * 0.02
        norm_weight = (torch.rand(1024, device="cuda", generator=gen) + 0.5).bfloat16()
        for rows in (1, 16, 64, 128, 256):
            x = torch.randn(rows, inner, device="cuda", generator=gen).bfloat16()
            residual = torch.randn(rows, 1024, device="cuda", generator=gen).bfloat16()

            def plain(x=x, residual=residual, weight=weight, norm_weight=norm_weight):
                return fused.add_rms_norm(F.linear(x, weight), residual, norm_weight, 1e-6)

            def split(x=x, residual=residual, weight=weight, norm_weight=norm_weight):
                return split_k.add_rms_norm(split_k.partial_sums(x, weight), residual,
                                            norm_weight, 1e-6)

            times = [triton.testing.do_bench_cudagraph(f, rep=50) * 1e3 for f in (plain, split)]
            exact = x.double() @ weight.double().T
            errors = [(y.double() - exact).abs().max().item()
                      for y in (F.linear(x, weight), split_k.partial_sums(x, weight).total())]
            line = (f"| {name} | {rows} | {times[0]:.1f} | {times[1]:.1f} | "
                    f"{times[0] / times[1]:.2f}x | {errors[0]:.2g} | {errors[1]:.2g} |")
            print(line, flush=True)
            lines.append(line)
    if args.results:
        append_results(args.results, lines)


if __name__ == "__main__":
    main()
