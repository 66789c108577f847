"""Qwen3's q/k RMSNorm + rotary: the Triton kernel the engine runs on CUDA
(``hitchllm.models.rotary_kernel``) against the same function compiled with ``torch.compile``
(``fused``'s route before it, four kernels), at Qwen3-0.6B's heads (16 query, 8 key, d 128,
bf16) from decode to prompt-step token counts. Times are device times replayed from CUDA
graphs; the table also gives the share of output values unlike those of PyTorch's op-by-op
arithmetic (same rounding steps, eager).

    python benchmarks/rotary_kernel.py [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton.testing
from results_md import append_results, entry_heading

from hitchllm.models import fused, rotary_kernel
from hitchllm.models.rope import RotaryEmbedding


def _op_by_op(positions, q, k, q_weight, k_weight, eps, cos, sin):
    return fused._apply_rotary(positions, fused._normalize(q, q_weight, eps),
                               fused._normalize(k, k_weight, eps), cos, sin)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    compiled = torch.compile(_op_by_op, dynamic=True, fullgraph=True)
    rope = RotaryEmbedding(128, 40960, 1e6, None).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    header = ("| tokens | compiled us | Triton kernel us | speed-up | values unlike PyTorch's, "
              "compiled | Triton kernel |\n|---|---|---|---|---|---|")
    lines = [*entry_heading("q/k RMSNorm + rotary, Qwen3-0.6B heads, bf16",
                            "python benchmarks/rotary_kernel.py"), header]
    print(header)
    for tokens in (1, 64, 256, 2048, 8192):
        qkv = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
        q = qkv[:, :2048].reshape(tokens, 16, 128)
        k = qkv[:, 2048:3072].reshape(tokens, 8, 128)
        weights = [(torch.rand(128, device="cuda", generator=gen) + 0.5).bfloat16()
                   for _ in range(2)]
        positions = torch.randint(0, 40960, (tokens,), device="cuda", generator=gen)
        call = (positions, q, k, *weights, 1e-6, rope.cos, rope.sin)
        want = _flat(_op_by_op(*call))
        times = [triton.testing.do_bench_cudagraph(lambda f=f, c=call: f(*c), rep=50) * 1e3
                 for f in (compiled, rotary_kernel.qk_norm_rotary)]
        unlike = [f"{(_flat(f(*call)) != want).float().mean():.2%}"
                  for f in (compiled, rotary_kernel.qk_norm_rotary)]
        line = (f"| {tokens} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / times[1]:.1f}x | "
                f"{unlike[0]} | {unlike[1]} |")
        print(line, flush=True)
        lines.append(line)
    if args.results:
        append_results(args.results, lines)


if __name__ == "__main__":
    main()
