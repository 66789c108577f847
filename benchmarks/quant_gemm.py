"""fp8 W8A8 GEMM vs bfloat16 ``F.linear`` at a Llama-8B layer's shapes (issue 15, point 5).

The fp8 side is what ``Fp8LinearMethod.apply`` runs on an sm_89+ GPU: quantize the bf16
activations per token (``quantize_activations``), then ``torch._scaled_mm`` with row-wise
scales against the fp8 weight (``scaled_mm_fp8_linear``). The bf16 side is one ``F.linear``.
For each ``K x N`` (4096 x 14336: gate/up; 14336 x 4096: down; 4096 x 4096: o) and each
number of tokens ``M``, it prints microseconds, TFLOP/s (``2 M N K`` per call) and the speed
ratio (bf16 time / fp8 time; above 1: fp8 faster), plus the fp8 output's relative error
against bf16 as a sanity check. Times are CUDA-event times of calls replayed from a CUDA graph
(the engine replays decode steps from graphs too, so Python launch overhead counts for
neither side); the fp8 time includes the activation quantization (one kernel compiled by
torch.compile, as in the engine; the first shapes include compile time only in warm-up).

Needs only torch and the core and plugin sources (no pydantic):

    PYTHONPATH=core:plugins/quantization python benchmarks/quant_gemm.py \
        [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from graph_timing import graph_time_us
from hitchllm_quantization.fp8_gemm import (
    check_fp8_device,
    quantize_activations,
    quantize_rows,
    scaled_mm_fp8_linear,
)
from results_md import append_results, entry_heading

SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096)]  # (K, N)
TOKENS = [1, 16, 64, 256, 1024, 2048, 4096, 8192]
CALLS_PER_GRAPH = 20


def time_us(fn: Callable[[], torch.Tensor], repeats: int = 10) -> float:
    """Median CUDA-event time of one call, over graph replays of ``CALLS_PER_GRAPH`` calls."""
    return graph_time_us(fn, repeats, CALLS_PER_GRAPH)


def measure(k: int, n: int, m: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    w8, w_scale = quantize_rows(weight)

    def fp8() -> torch.Tensor:
        xq, x_scale = quantize_activations(x)
        return scaled_mm_fp8_linear(xq, x_scale, w8, w_scale, torch.bfloat16)

    def bf16() -> torch.Tensor:
        return F.linear(x, weight)

    want = bf16().float()
    error = ((fp8().float() - want).norm() / want.norm()).item()
    row = {"k": k, "n": n, "m": m, "fp8": time_us(fp8), "bf16": time_us(bf16), "error": error}
    torch.cuda.empty_cache()
    return row


def fmt(row: dict) -> str:
    flop = 2 * row["m"] * row["n"] * row["k"]
    rates = [flop / (row[name] * 1e-6) / 1e12 for name in ("bf16", "fp8")]
    return (f"| {row['k']} x {row['n']} | {row['m']} | {row['bf16']:.1f} | {rates[0]:.1f} | "
            f"{row['fp8']:.1f} | {rates[1]:.1f} | {row['bf16'] / row['fp8']:.2f}x | "
            f"{row['error']:.3f} |")


HEADER = ("| K x N | M | bf16 us | bf16 TFLOP/s | fp8 us (incl. act. quant) | fp8 TFLOP/s | "
          "fp8 speed vs bf16 | fp8 rel. error |\n|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, help="append the table to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU with fp8 (sm_89+)")
    check_fp8_device(torch.device("cuda"))
    lines = [*entry_heading("fp8 W8A8 GEMM vs bf16", "python benchmarks/quant_gemm.py"), HEADER]
    print(HEADER)
    for k, n in SHAPES:
        for m in TOKENS:
            line = fmt(measure(k, n, m))
            print(line, flush=True)
            lines.append(line)
    if args.results:
        append_results(args.results, lines)


if __name__ == "__main__":
    main()
