"""AWQ int4 weights (hitchllm-quantization's Triton kernel) vs a bf16 ``F.linear``, at a
Llama-8B layer's shapes (K x N: 4096 x 14336 gate/up, 14336 x 4096 down, 4096 x 4096 o) and
batch M = 1, 2, 4, 8, 16 (decode), 64, 256 and 2048 (prompts), group size 128.

The int4 weight is a round-to-nearest quantization of a random bf16 weight; each output is
checked against ``F.linear`` on the dequantized weight. Times are device times (CUDA events)
of calls replayed from CUDA graphs, as the engine's decode runs them, so that Python launch
overhead counts for neither side; the kernel's autotuning runs on the first, eager call.
Weights are read cold, as in a model whose layers' weights together exceed the L2 cache: each
timed graph cycles through enough copies of the layer (other random values, same shapes) to
read three times the L2 cache, and the time is per call. (Replaying one layer alone would
serve the 29 MB int4 weight of a 4096 x 14336 layer largely from the H100's 50 MB L2.)
``speedup`` is bf16 time / int4 time (above 1: int4 faster); ``int4 GB/s`` counts the packed
weight, zeros and scales read once. For M <= 4 both small-batch paths (gemv, split_k) are
timed (``select_path`` picks by batch size). The int4 tensors are in the layout the engine
loads them into (``pack_along_k``).

    python benchmarks/quant_awq.py [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from hitchllm_quantization.awq_packing import dequantize, pack_along_k, quantize_rtn
from hitchllm_quantization.awq_triton import PATHS, awq_gemm, gemv_config, select_path
from results_md import append_results, entry_heading

SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096))  # (K, N)
BATCHES = (1, 2, 4, 8, 16, 64, 256, 2048)
GROUP = 128
DTYPE = torch.bfloat16


def time_us(fn) -> float:
    """Device time of one call, replayed from a CUDA graph (after one eager call)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1000


def cold_time_us(fns: list) -> float:
    """Device time per call of ``fns`` (each on its own copy of the weights) run in turn."""
    def run() -> None:
        for fn in fns:
            fn()
    return time_us(run) / len(fns)


def copies(nbytes: int) -> int:
    """How many copies of ``nbytes`` of weights read three times the L2 cache."""
    return math.ceil(3 * torch.cuda.get_device_properties(0).L2_cache_size / nbytes)


def best_config(path: str, n: int, k: int) -> str:
    """The tile ``path`` ran: the GEMV's rule, or the autotuner's choice."""
    if path == "dequantize":
        return "dequantize + F.linear"
    if path == "gemv":
        tile = gemv_config(n, k, GROUP)
        warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    else:
        config = PATHS[path][1].best_config
        tile, warps, stages = config.kwargs, config.num_warps, config.num_stages
    tile = " ".join(f"{k[6:].lower() if k.startswith('BLOCK_') else k.lower()}{v}"
                    for k, v in tile.items())
    return f"{path}: {tile} w{warps} s{stages}"


def measure(k: int, n: int) -> list[str]:
    weight = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
    qweight, qzeros, scales = quantize_rtn(weight, GROUP)
    reference_weight = dequantize(qweight, qzeros, scales, GROUP, DTYPE).contiguous()
    qweight, qzeros = pack_along_k(qweight, qzeros)  # the layout the engine loads
    int4_bytes = qweight.numel() * 4 + qzeros.numel() + scales.numel() * 2
    weights = [weight] + [torch.randn_like(weight) * 0.02
                          for _ in range(copies(weight.numel() * 2) - 1)]
    packed = [(qweight, qzeros, scales)] + [
        (torch.randint_like(qweight, -2**31, 2**31 - 1), torch.randint_like(qzeros, 0, 16),
         scales.clone())
        for _ in range(copies(int4_bytes) - 1)]
    rows = []
    for m in BATCHES:
        x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        want = F.linear(x.float(), reference_weight.float())
        bf16 = cold_time_us([lambda x=x, w=w: F.linear(x, w) for w in weights])
        chosen = select_path(m)
        paths = {chosen} | ({"gemv", "split_k"} if m <= 4 else set())
        times = {}
        for path in sorted(paths):
            got = awq_gemm(x, qweight, qzeros, scales, GROUP, path=path)
            error = (got.float() - want).abs().max().item() / want.abs().max().item()
            if error > 2e-2:
                raise AssertionError(f"K={k} N={n} M={m} {path}: relative error {error:.3g}")
            times[path] = (cold_time_us([lambda x=x, p=path, t=t: awq_gemm(x, *t, GROUP, path=p)
                                         for t in packed]),
                           best_config(path, n, k))
        us, config = times[chosen]
        others = ", ".join(f"{p} {t:.1f}" for p, (t, _) in sorted(times.items())
                           if p != chosen)
        rows.append(f"| {k} x {n} | {m} | {bf16:.1f} | {us:.1f} | {bf16 / us:.2f}x | "
                    f"{int4_bytes / us / 1e3:.0f} | {config} | {others or '-'} |")
        print(rows[-1], flush=True)
    return rows


SECTION = "## AWQ int4 weights: Triton dequantize-and-multiply vs bf16 F.linear"
ABOUT = ("Reproduce on the GPU machine: `python benchmarks/quant_awq.py --results "
         "benchmarks/RESULTS.md` (hitchllm-quantization with Triton). Llama-8B layer shapes, "
         "group size 128, CUDA-graph device times; speedup = bf16 time / int4 time (goal: "
         ">= 2x at M = 1). The chosen config is the GEMV's shape rule or the autotuner's "
         "choice for the path the batch takes; the last column times the other small-batch "
         "path.")
HEADER = ("| K x N | M | bf16 F.linear us | AWQ int4 us | speedup | int4 GB/s | chosen kernel "
          "config | other paths us |\n|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()
    lines = [*entry_heading("AWQ int4 GEMM vs bf16", "python benchmarks/quant_awq.py",
                            "(group size 128; CUDA-graph device times; cold weights)"), HEADER]
    print(HEADER)
    for k, n in SHAPES:
        lines += measure(k, n)
        torch.cuda.empty_cache()
    if args.results:
        append_results(args.results, lines, SECTION, ABOUT)


if __name__ == "__main__":
    main()
