"""A decoder layer's o_proj and down_proj with the add-and-norm after them, at decode sizes:
cuBLAS (``F.linear``) and ``fused.add_rms_norm`` against the split-K partial sums summed by the
norm's kernel (``hitchllm.models.split_k``), Qwen3-0.6B shapes, bf16, device times replayed
from CUDA graphs. Each replay runs 28 layers' worth (28 different weights, more than the L2
cache holds, so that weights come from memory as in a forward); times are per layer. The last
columns give each route's largest distance from float64 over the projection's output.

    python benchmarks/split_k.py [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton.testing
from results_md import append_results, entry_heading

from hitchllm.layers.linear import RowParallelLinear
from hitchllm.models import fused, split_k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    header = ("| projection | rows | cuBLAS + norm us/layer | split sums + norm us/layer | "
              "speed-up | max error vs float64, cuBLAS | split sums |\n"
              "|---|---|---|---|---|---|---|")
    lines = [*entry_heading("o_proj / down_proj + add-and-norm at decode sizes, Qwen3-0.6B, bf16",
                            "python benchmarks/split_k.py"), header]
    print(header)
    layers = 28
    for name, inner in (("o_proj", 2048), ("down_proj", 3072)):
        projs = []
        for _ in range(layers):
            proj = RowParallelLinear(inner, 1024).cuda().bfloat16()
            proj.weight.data.normal_(0, 0.02, generator=gen)
            projs.append(proj)
        norm_weight = (torch.rand(1024, device="cuda", generator=gen) + 0.5).bfloat16()
        for rows in (1, 16, 64, 128):
            x = torch.randn(rows, inner, device="cuda", generator=gen).bfloat16()
            residual = torch.randn(rows, 1024, device="cuda", generator=gen).bfloat16()

            def plain(x=x, residual=residual, projs=projs, norm_weight=norm_weight):
                for proj in projs:
                    fused.add_rms_norm(proj(x), residual, norm_weight, 1e-6)

            def split(x=x, residual=residual, projs=projs, norm_weight=norm_weight):
                for proj in projs:
                    split_k.add_rms_norm(split_k.project(proj, x), residual, norm_weight, 1e-6)

            times = [triton.testing.do_bench_cudagraph(f, rep=50) * 1e3 / layers
                     for f in (plain, split)]
            exact = x.double() @ projs[0].weight.double().T
            route = split_k.project(projs[0], x)
            assert isinstance(route, split_k.SplitSum), "the split route did not apply"
            errors = [(y.double() - exact).abs().max().item()
                      for y in (projs[0](x), route.total())]
            line = (f"| {name} | {rows} | {times[0]:.2f} | {times[1]:.2f} | "
                    f"{times[0] / times[1]:.2f}x | {errors[0]:.2g} | {errors[1]:.2g} |")
            print(line, flush=True)
            lines.append(line)
    if args.results:
        append_results(args.results, lines)


if __name__ == "__main__":
    main()
