"""Paged attention kernels side by side: TRITON_ATTN vs FlashInfer (when installed).

Shapes follow ../shared/gpu/README.md's reference table (bf16, 32 query heads, head dim 128,
page 16, random page order) plus a decode sweep over batch and context. For each shape it
prints microseconds, achieved KV bandwidth (decode) or TFLOP/s (prefill) and the ratio to
FlashInfer, and checks both outputs agree. ``--tune`` also times a grid of launch
configurations for the headline shapes (used to choose hitchllm_attention_triton/config.py).
Times are device times of calls replayed from CUDA graphs, for both implementations.

    python benchmarks/attention.py [--sweep] [--tune] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from datetime import date
from pathlib import Path

import numpy as np
import torch
import triton.testing

from hitchllm.attention import AttentionSpec, CommonAttentionMetadata
from hitchllm.entrypoints.machine import describe_machine
from hitchllm_attention_triton import TritonAttentionBackend
from hitchllm_attention_triton.config import KernelConfig

DTYPE = torch.bfloat16
HEAD = 128
PAGE = 16


@dataclasses.dataclass
class Case:
    name: str
    context_lens: list[int]  # cached tokens before the step
    query_lens: list[int]
    num_heads: int = 32
    num_kv_heads: int = 8

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def decode(self) -> bool:
        return max(self.query_lens) == 1

    def kv_bytes(self) -> int:
        return sum(self.seq_lens) * self.num_kv_heads * HEAD * 2 * 2

    def flops(self) -> int:
        visible = sum(c * q + q * (q + 1) // 2 for c, q in zip(self.context_lens, self.query_lens))
        return 4 * visible * self.num_heads * HEAD


class Bench:
    """The tensors of one case: a shared paged cache with randomly permuted pages."""

    def __init__(self, case: Case) -> None:
        self.case = case
        g = torch.Generator().manual_seed(0)
        pages = [math.ceil(s / PAGE) for s in case.seq_lens]
        num_pages = sum(pages)
        perm = torch.randperm(num_pages, generator=g)
        self.block_table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        self.indptr = [0]
        start = 0
        for i, n in enumerate(pages):
            self.block_table[i, :n] = perm[start:start + n].int()
            start += n
            self.indptr.append(start)
        self.indices = torch.cat([self.block_table[i, :n] for i, n in enumerate(pages)])
        self.cache = torch.randn(2, num_pages, PAGE, case.num_kv_heads, HEAD, dtype=DTYPE,
                                 device="cuda")
        num_tokens = sum(case.query_lens)
        self.q = torch.randn(num_tokens, case.num_heads, HEAD, dtype=DTYPE, device="cuda")
        qsl = np.zeros(len(pages) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(case.query_lens)
        self.qsl = torch.from_numpy(qsl)
        seq = torch.tensor(case.seq_lens, dtype=torch.int32)
        self.common = CommonAttentionMetadata(
            query_start_loc=self.qsl.cuda(), query_start_loc_cpu=self.qsl,
            seq_lens=seq.cuda(), seq_lens_cpu=seq,
            num_computed_tokens_cpu=torch.tensor(case.context_lens, dtype=torch.int32),
            block_table=self.block_table.cuda(),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device="cuda"),
            num_reqs=len(pages), num_actual_tokens=num_tokens,
            max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens),
        )
        self.spec = AttentionSpec.for_device(
            torch.device("cuda"), dtype=DTYPE, kv_cache_dtype=DTYPE, head_size=HEAD,
            num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, block_size=PAGE)

    def triton_fn(self, kernel: KernelConfig | None = None):
        builder = TritonAttentionBackend.get_builder_cls()(self.spec, torch.device("cuda"))
        builder.kernel_override = kernel
        meta = builder.build(self.common)
        c = self.case
        impl = TritonAttentionBackend.get_impl_cls()(c.num_heads, HEAD, HEAD**-0.5,
                                                     c.num_kv_heads, self.spec)
        empty = self.q.new_empty(self.q.shape[0], c.num_kv_heads, HEAD)
        return meta.kernel, lambda: impl.forward(self.q, empty, empty, self.cache, meta)

    def flashinfer_fn(self):
        try:
            import flashinfer
        except ImportError:
            return None
        c = self.case
        workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        indptr = torch.tensor(self.indptr, dtype=torch.int32, device="cuda")
        indices = self.indices.cuda()
        last = torch.tensor([(s - 1) % PAGE + 1 for s in c.seq_lens], dtype=torch.int32,
                            device="cuda")
        kv = (self.cache[0], self.cache[1])
        if c.decode:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(indptr, indices, last, c.num_heads, c.num_kv_heads, HEAD, PAGE,
                   q_data_type=DTYPE, kv_data_type=DTYPE)
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(self.qsl.cuda(), indptr, indices, last, c.num_heads, c.num_kv_heads, HEAD,
                   PAGE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)
        return lambda: w.run(self.q, kv)


def time_us(fn) -> float:
    """Device time of one call, replayed from a CUDA graph so that Python launch overhead
    (which CUDA graphs remove in the engine) does not count for either implementation."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1000


def headline_cases() -> list[Case]:
    return [
        Case("decode 64x2048", [2047] * 64, [1] * 64),
        Case("prefill 8x512 new on 2048", [1536] * 8, [512] * 8),
        Case("decode 1x32k", [32767], [1]),
        Case("decode 4x32k", [32767] * 4, [1] * 4),
        Case("decode 64x2048 gqa 32/4", [2047] * 64, [1] * 64, num_kv_heads=4),
        # The throughput benchmark's model (Qwen3-0.6B: 16 query, 8 KV heads) at full batch.
        Case("decode 256x1024 gqa 16/8", [1023] * 256, [1] * 256, num_heads=16),
    ]


def sweep_cases() -> list[Case]:
    cases = []
    for kv in (8, 4):
        for batch in (1, 4, 16, 64, 256):
            for ctx in (512, 2048, 8192, 32768):
                if batch * ctx > 2**21:  # keeps the sweep's memory and time bounded
                    continue
                cases.append(Case(f"decode {batch}x{ctx} gqa 32/{kv}", [ctx - 1] * batch,
                                  [1] * batch, num_kv_heads=kv))
    return cases


def measure(case: Case, kernel: KernelConfig | None = None) -> dict:
    bench = Bench(case)
    cfg, ours = bench.triton_fn(kernel)
    row = {"case": case.name, "config": cfg, "ours_us": time_us(ours)}
    fi = bench.flashinfer_fn()
    if fi is not None:
        err = (ours().float() - fi().float()).abs().max().item()
        if err > 5e-2:
            raise AssertionError(f"{case.name}: TRITON_ATTN and FlashInfer differ by {err}")
        row["fi_us"] = time_us(fi)
    scale = case.kv_bytes() / 1e12 if case.decode else case.flops() / 1e12
    row["ours_rate"] = scale / (row["ours_us"] / 1e6)
    if "fi_us" in row:
        row["fi_rate"] = scale / (row["fi_us"] / 1e6)
    return row


def fmt(row: dict, decode: bool) -> str:
    unit = "TB/s" if decode else "TFLOP/s"
    fi = (f"{row['fi_us']:9.1f} {row['fi_rate']:8.2f} {row['fi_us'] / row['ours_us']:6.2f}"
          if "fi_us" in row else f"{'-':>9} {'-':>8} {'-':>6}")
    c = row["config"]
    cfg = f"q{c.block_q} m{c.block_m} n{c.block_n} w{c.num_warps} s{c.num_stages} x{c.num_splits}"
    return (f"| {row['case']:<28} | {row['ours_us']:9.1f} | {row['ours_rate']:8.2f} {unit} | "
            f"{fi} | {cfg} |")


HEADER = ("| shape | TRITON_ATTN us | rate | FlashInfer us, rate, ratio (ours/FI speed) | "
          "config |\n|---|---|---|---|---|")


def tune(case: Case) -> None:
    print(f"\n## tuning {case.name}")
    grid = []
    group = case.num_heads // case.num_kv_heads
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                if case.decode:
                    grid.append(KernelConfig(1, 16, block_n, warps, stages, 1))
                else:
                    for block_m in (64, 128):
                        grid.append(KernelConfig(block_m // group, block_m, block_n, warps,
                                                 stages, 1))
    bench = Bench(case)
    results = []
    for cfg in grid:
        try:
            _, fn = bench.triton_fn(cfg)
            results.append((time_us(fn), cfg))
        except Exception as exc:  # configurations that do not compile are skipped
            print(f"  {cfg}: {type(exc).__name__}")
    for us, cfg in sorted(results, key=lambda r: r[0])[:8]:
        print(f"  {us:8.1f} us  {cfg}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    lines = [f"### attention kernels ({date.today()}, {describe_machine()})", "",
             "`python benchmarks/attention.py" + (" --sweep" if args.sweep else "") + "`", "",
             HEADER]
    cases = headline_cases() + (sweep_cases() if args.sweep else [])
    print(HEADER)
    for case in cases:
        line = fmt(measure(case), case.decode)
        print(line, flush=True)
        lines.append(line)
        torch.cuda.empty_cache()
    if args.tune:
        for case in headline_cases()[:2] + headline_cases()[-1:]:
            tune(case)
    if args.results:
        with args.results.open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
