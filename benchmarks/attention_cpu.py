"""Paged attention on the CPU: the core's TORCH backend vs CPU_ATTN (hitchllm-attention-cpu),
each called through hitchllm's backend API (metadata builder, then the impl's forward: K/V
write plus attention) on the same paged cache with random block order, as the engine calls them.

For each shape it prints the fastest of ``--repeat`` calls per backend (the backends alternate,
so a noisy machine slows both alike), the KV bytes read per second by CPU_ATTN (decodes) and
the speed ratio, and checks both outputs agree. Uses every thread torch uses.

    python benchmarks/attention_cpu.py [--repeat 20] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from datetime import date
from pathlib import Path

import torch

from hitchllm.attention import (
    AttentionBackend,
    AttentionSpec,
    CommonAttentionMetadata,
    TorchAttentionBackend,
)
from hitchllm.entrypoints.machine import describe_machine
from hitchllm_attention_cpu import CpuAttentionBackend

BLOCK = 16


@dataclasses.dataclass
class Case:
    name: str
    context_lens: list[int]
    query_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    def kv_bytes(self) -> int:
        tokens = sum(c + q for c, q in zip(self.context_lens, self.query_lens))
        return tokens * self.num_kv_heads * self.head_size * 2 * self.cache_dtype.itemsize


CASES = [
    Case("decode 32 x 512, 8/4 heads, d32", [511] * 32, [1] * 32, 8, 4, 32),
    Case("decode 32 x 1024, 32/8 heads, d128", [1023] * 32, [1] * 32, 32, 8, 128),
    Case("decode 8 x 4096, 32/8 heads, d128", [4095] * 8, [1] * 8, 32, 8, 128),
    Case("decode 32 x 1024, 32/8, d128, bf16", [1023] * 32, [1] * 32, 32, 8, 128,
         torch.bfloat16),
    Case("decode 32 x 1024, 32/8, d128, fp8 KV", [1023] * 32, [1] * 32, 32, 8, 128,
         kv_cache_dtype=torch.float8_e4m3fn),
    Case("mixed: 2 prompts of 256 + 30 decodes x 1024, 32/8, d128", [0] * 2 + [1023] * 30,
         [256] * 2 + [1] * 30, 32, 8, 128),
]


class Step:
    """One engine step of ``case`` over a random paged cache, runnable by either backend."""

    def __init__(self, case: Case) -> None:
        g = torch.Generator().manual_seed(0)
        n = len(case.context_lens)
        seq = torch.tensor([c + q for c, q in zip(case.context_lens, case.query_lens)])
        blocks = (seq + BLOCK - 1) // BLOCK
        total = int(blocks.sum())
        perm = torch.randperm(total, generator=g).to(torch.int32)
        self.block_table = torch.zeros(n, int(blocks.max()), dtype=torch.int32)
        start = 0
        for i, b in enumerate(blocks.tolist()):
            self.block_table[i, :b] = perm[start:start + b]
            start += b
        qsl = torch.zeros(n + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(case.query_lens).cumsum(0)
        num_tokens = int(qsl[-1])
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(case.context_lens,
                                                                case.query_lens)])
        req = torch.repeat_interleave(torch.arange(n), torch.tensor(case.query_lens))
        slots = self.block_table[req, pos // BLOCK].long() * BLOCK + pos % BLOCK
        self.common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq.int(),
            seq_lens_cpu=seq.int(), num_computed_tokens_cpu=torch.tensor(case.context_lens,
                                                                         dtype=torch.int32),
            block_table=self.block_table, slot_mapping=slots, num_reqs=n,
            num_actual_tokens=num_tokens, max_query_len=max(case.query_lens),
            max_seq_len=int(seq.max()), block_table_cpu=self.block_table,
        )
        self.spec = AttentionSpec(device_type="cpu", dtype=case.dtype,
                                  kv_cache_dtype=case.cache_dtype, head_size=case.head_size,
                                  num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                                  block_size=BLOCK)
        shape = TorchAttentionBackend.get_kv_cache_shape(total, BLOCK, case.num_kv_heads,
                                                         case.head_size)
        self.cache = torch.randn(shape, generator=g).to(case.cache_dtype)
        self.q = torch.randn(num_tokens, case.num_heads, case.head_size, generator=g)
        self.kv = torch.randn(num_tokens, case.num_kv_heads, case.head_size, generator=g)
        self.q, self.kv = self.q.to(case.dtype), self.kv.to(case.dtype)
        self.case = case

    def runner(self, backend: type[AttentionBackend]):
        c = self.case
        impl = backend.get_impl_cls()(c.num_heads, c.head_size, c.head_size**-0.5,
                                      c.num_kv_heads, self.spec)
        builder = backend.get_builder_cls()(self.spec, torch.device("cpu"))

        def run() -> torch.Tensor:
            meta = builder.build(self.common)
            return impl.forward(self.q, self.kv, self.kv, self.cache, meta)

        return run


def measure(case: Case, repeat: int) -> dict:
    step = Step(case)
    runs = {"TORCH": step.runner(TorchAttentionBackend),
            "CPU_ATTN": step.runner(CpuAttentionBackend)}
    outs = {name: run().float() for name, run in runs.items()}
    torch.testing.assert_close(outs["CPU_ATTN"], outs["TORCH"],
                               atol=3e-2 if case.dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {"case": case, "torch_us": best["TORCH"] * 1e6, "cpu_us": best["CPU_ATTN"] * 1e6}


def fmt(row: dict) -> str:
    case = row["case"]
    gbps = case.kv_bytes() / row["cpu_us"] / 1e3
    return (f"| {case.name} | {row['torch_us']:,.0f} | {row['cpu_us']:,.0f} | {gbps:.1f} | "
            f"{row['torch_us'] / row['cpu_us']:.2f}x |")


HEADER = ("| step (one layer) | TORCH us | CPU_ATTN us | CPU_ATTN KV GB/s | speed-up |\n"
          "|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--results", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    lines = [HEADER, *(fmt(measure(case, args.repeat)) for case in CASES)]
    table = "\n".join(lines)
    print(table)
    if args.results:
        with args.results.open("a") as f:
            f.write(f"\n### Paged attention on the CPU: TORCH vs CPU_ATTN ({date.today()}, "
                    f"{describe_machine()}, {torch.get_num_threads()} "
                    f"threads)\n\n`python benchmarks/attention_cpu.py --repeat {args.repeat}` "
                    "(fastest call of each, backends alternating; KV GB/s counts each "
                    "request's cached keys and values once)\n\n" + table + "\n")


if __name__ == "__main__":
    main()
