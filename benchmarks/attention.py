"""Paged attention backends side by side: TRITON_ATTN, FLASHINFER and FLASH_ATTN (the ones
whose libraries are installed), each called through hitchllm's backend API (metadata builder,
then the impl's forward: K/V write plus attention), exactly as the engine calls them.

Shapes follow ../shared/gpu/README.md's reference table (bf16, 32 query heads, head dim 128,
page 16, random page order) plus a decode sweep over batch and context. For each shape it
prints microseconds and achieved KV bandwidth (decode) or TFLOP/s (prefill) per backend and
the speed ratio to TRITON_ATTN, and checks every output agrees with TRITON_ATTN's. ``--tune``
also times a grid of launch configurations for the headline shapes (used to choose
hitchllm_attention_triton/config.py). Times are device times of calls replayed from CUDA
graphs, for every backend.

``--kv-cache-dtype fp8`` (or ``fp8_e5m2``) instead times every backend that reads fp8 with a
bf16 cache and with an fp8 cache of the same values side by side (issue 15: fp8 decode at
most 0.6x the bf16 time, ideally the byte ratio 0.5x), checks each fp8 output against the
bf16 one within fp8's rounding, and with ``--tune`` tunes the fp8 decode tile instead.

    python benchmarks/attention.py [--sweep] [--tune] [--kv-cache-dtype fp8]
                                   [--results benchmarks/RESULTS.md]
    python benchmarks/attention.py --order | --decode-tiles
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import random
from datetime import date
from pathlib import Path

import numpy as np
import torch
import triton.testing

from hitchllm.attention import (
    AttentionBackend,
    AttentionSpec,
    CommonAttentionMetadata,
    quantize_kv,
)
from hitchllm.attention.selector import discover_backends
from hitchllm.config import parse_kv_cache_dtype
from hitchllm.entrypoints.machine import describe_machine
from hitchllm_attention_triton import TritonAttentionBackend
from hitchllm_attention_triton.config import KernelConfig

VENDOR = ("FLASHINFER", "FLASH_ATTN")

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

    def kv_bytes(self, itemsize: int = 2) -> int:
        return sum(self.seq_lens) * self.num_kv_heads * HEAD * 2 * itemsize

    def flops(self) -> int:
        visible = sum(c * q + q * (q + 1) // 2 for c, q in zip(self.context_lens, self.query_lens))
        return 4 * visible * self.num_heads * HEAD


class Bench:
    """The tensors of one case: a shared paged cache with randomly permuted pages, and KV
    scales of 1.0 bound to each impl as an ``Attention`` layer binds them."""

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
        # One spare page: the write sink of the FLASHINFER / FLASH_ATTN layout.
        self.cache = torch.randn(2, num_pages + 1, PAGE, case.num_kv_heads, HEAD, dtype=DTYPE,
                                 device="cuda")
        self.scale = torch.ones((), dtype=torch.float32, device="cuda")
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
            block_table=self.block_table.cuda(), block_table_cpu=self.block_table,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device="cuda"),
            num_reqs=len(pages), num_actual_tokens=num_tokens,
            max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens),
        )
        self.spec = AttentionSpec.for_device(
            torch.device("cuda"), dtype=DTYPE, kv_cache_dtype=DTYPE, head_size=HEAD,
            num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, block_size=PAGE)

    def with_kv_dtype(self, kv_dtype: torch.dtype) -> Bench:
        """The same case (queries, pages) over this cache's values stored in ``kv_dtype``."""
        other = copy.copy(self)
        other.cache = quantize_kv(self.cache, self.scale, kv_dtype)
        other.spec = dataclasses.replace(self.spec, kv_cache_dtype=kv_dtype)
        return other

    def triton_fn(self, kernel: KernelConfig | None = None, longest_first: bool = True):
        builder = TritonAttentionBackend.get_builder_cls()(self.spec, torch.device("cuda"))
        builder.kernel_override = kernel
        builder.longest_first = longest_first
        meta = builder.build(self.common)
        c = self.case
        impl = TritonAttentionBackend.get_impl_cls()(c.num_heads, HEAD, HEAD**-0.5,
                                                     c.num_kv_heads, self.spec)
        impl.k_scale = impl.v_scale = self.scale
        empty = self.q.new_empty(self.q.shape[0], c.num_kv_heads, HEAD)
        return meta.kernel, lambda: impl.forward(self.q, empty, empty, self.cache, meta)

    def backend_fn(self, backend: type[AttentionBackend]):
        """``backend``'s forward on this case (None when it cannot serve it)."""
        if backend.validate(self.spec):
            return None
        c = self.case
        meta = backend.get_builder_cls()(self.spec, torch.device("cuda")).build(self.common)
        impl = backend.get_impl_cls()(c.num_heads, HEAD, HEAD**-0.5, c.num_kv_heads, self.spec)
        impl.k_scale = impl.v_scale = self.scale
        new_kv = self.q.new_zeros(self.q.shape[0], c.num_kv_heads, HEAD)
        return lambda: impl.forward(self.q, new_kv, new_kv, self.cache, meta)


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


def vendor_backends() -> dict[str, type[AttentionBackend]]:
    found = {backend.name: backend for backend, _ in discover_backends()}
    return {name: found[name] for name in VENDOR if name in found}


def measure(case: Case, kernel: KernelConfig | None = None) -> dict:
    bench = Bench(case)
    cfg, ours = bench.triton_fn(kernel)
    row = {"case": case.name, "config": cfg, "TRITON_ATTN": time_us(ours)}
    expected = ours().float()
    for name, backend in vendor_backends().items():
        fn = bench.backend_fn(backend)
        if fn is None:
            continue
        err = (fn().float() - expected).abs().max().item()
        if err > 5e-2:
            raise AssertionError(f"{case.name}: {name} and TRITON_ATTN differ by {err}")
        row[name] = time_us(fn)
    row["scale"] = case.kv_bytes() / 1e12 if case.decode else case.flops() / 1e12
    return row


def fmt(row: dict, decode: bool) -> str:
    unit = "TB/s" if decode else "TFLOP/s"
    cells = []
    for name in ("TRITON_ATTN", *VENDOR):
        if name not in row:
            cells.append("-")
            continue
        rate = row["scale"] / (row[name] / 1e6)
        ratio = "" if name == "TRITON_ATTN" else f", {row['TRITON_ATTN'] / row[name]:.2f}x"
        cells.append(f"{row[name]:.1f} us, {rate:.2f} {unit}{ratio}")
    c = row["config"]
    cfg = f"q{c.block_q} m{c.block_m} n{c.block_n} w{c.num_warps} s{c.num_stages} x{c.num_splits}"
    return f"| {row['case']:<28} | " + " | ".join(cells) + f" | {cfg} |"


HEADER = ("| shape | TRITON_ATTN | FLASHINFER (speed vs TRITON_ATTN) | FLASH_ATTN (speed vs "
          "TRITON_ATTN) | TRITON_ATTN config |\n|---|---|---|---|---|")


def measure_kv_dtypes(case: Case, kv_dtype: torch.dtype) -> dict:
    """Each backend that reads ``kv_dtype`` timed over a bf16 cache and over the same values
    in ``kv_dtype``: {name: (bf16 us, fp8 us)}, plus TRITON_ATTN's fp8 configuration."""
    full = Bench(case)
    fp8 = full.with_kv_dtype(kv_dtype)
    # The fp8 values read back into a bf16 cache (exact with scale 1): what the fp8 kernels
    # must compute, up to bf16 arithmetic.
    dequantized = copy.copy(full)
    dequantized.cache = fp8.cache.to(DTYPE)
    backends = {"TRITON_ATTN": TritonAttentionBackend, **vendor_backends()}
    row: dict = {"case": case.name, "times": {}}
    for name, backend in backends.items():
        fns = full.backend_fn(backend), fp8.backend_fn(backend)
        if None in fns:  # cannot serve the case, or cannot read fp8
            continue
        err = (fns[1]().float() - dequantized.backend_fn(backend)().float()).abs().max().item()
        if err > 5e-2:
            raise AssertionError(f"{case.name}: {name} over the {kv_dtype} cache and over its "
                                 f"values in bf16 differ by {err}")
        row["times"][name] = tuple(time_us(fn) for fn in fns)
    row["config"] = fp8.triton_fn()[0]
    row["bytes"] = case.kv_bytes(), case.kv_bytes(kv_dtype.itemsize)
    return row


def fmt_kv_dtypes(row: dict, names: list[str]) -> str:
    cells = []
    for name in names:
        if name not in row["times"]:
            cells.append("-")
            continue
        full, fp8 = row["times"][name]
        tbs = [b / 1e12 / (us / 1e6) for b, us in zip(row["bytes"], (full, fp8))]
        cells.append(f"{full:.1f} us ({tbs[0]:.2f} TB/s) -> {fp8:.1f} us ({tbs[1]:.2f} TB/s), "
                     f"**{fp8 / full:.2f}x**")
    c = row["config"]
    cfg = (f"q{c.block_q} m{c.block_m} n{c.block_n} w{c.num_warps} s{c.num_stages} "
           f"x{c.num_splits} v{c.v_word}")
    return f"| {row['case']:<28} | " + " | ".join(cells) + f" | {cfg} |"


def tune(case: Case, kv_dtype: torch.dtype = DTYPE) -> None:
    print(f"\n## tuning {case.name}, KV cache {str(kv_dtype).removeprefix('torch.')}")
    grid = []
    group = case.num_heads // case.num_kv_heads
    bench = Bench(case) if kv_dtype == DTYPE else Bench(case).with_kv_dtype(kv_dtype)
    v_word = bench.triton_fn()[0].v_word  # how the default configuration reads fp8 V
    for block_n in (32, 64, 128, 256):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                if case.decode:
                    grid.append(KernelConfig(1, 16, block_n, warps, stages, 1, v_word))
                else:
                    for block_m in (64, 128):
                        grid.append(KernelConfig(block_m // group, block_m, block_n, warps,
                                                 stages, 1, v_word))
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
    parser.add_argument("--kv-cache-dtype", choices=["fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="time bf16 against this fp8 cache, side by side")
    parser.add_argument("--order", action="store_true",
                        help="time decode of mixed context lengths in index order and longest "
                             "first, side by side")
    parser.add_argument("--decode-tiles", action="store_true",
                        help="time the default decode configuration against a grid of split "
                             "counts, tiles and stages at the throughput run's batch sizes")
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    if args.order:
        compare_orders(args)
        return
    if args.decode_tiles:
        compare_decode_tiles(args)
        return
    if args.kv_cache_dtype:
        compare_kv_dtypes(args, parse_kv_cache_dtype(args.kv_cache_dtype, DTYPE))
        return
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


def compare_orders(args: argparse.Namespace) -> None:
    """TRITON_ATTN decode with its programs taking requests in index order and as the builder
    orders them by default (longest context first above two waves of SMs; Qwen3-0.6B's 16
    query and 8 KV heads), on equal contexts and on mixed ones: uniform
    over 100-2047 tokens, and the throughput run's mix (a prompt of 100-1,024 tokens plus up to
    1,000 generated)."""
    rng = random.Random(0)
    mixes = {
        "equal, 1024": lambda: 1023,
        "uniform 100-2047": lambda: rng.randint(100, 2047),
        "prompt 100-1024 + 0-1000 out": lambda: rng.randint(100, 1024) + rng.randint(0, 1000),
    }
    header = ("| requests | contexts | splits | index order us | default us | default TB/s | "
              "speed-up |\n|---|---|---|---|---|---|---|")
    lines = [f"### TRITON_ATTN decode, launch order ({date.today()}, {describe_machine()})", "",
             "`python benchmarks/attention.py --order`", "", header]
    print(header)
    for n in (8, 16, 32, 64, 96, 128, 192, 256):
        for mix, draw in mixes.items():
            case = Case(f"{n}", [draw() for _ in range(n)], [1] * n, num_heads=16,
                        num_kv_heads=8)
            bench = Bench(case)
            cfg, by_index = bench.triton_fn(longest_first=False)
            _, longest = bench.triton_fn()
            if not torch.equal(by_index(), longest()):
                raise AssertionError(f"{n} requests, {mix}: the orders' outputs differ")
            t_index, t_longest = time_us(by_index), time_us(longest)
            line = (f"| {n} | {mix} | {cfg.num_splits} | {t_index:.1f} | {t_longest:.1f} | "
                    f"{case.kv_bytes() / t_longest / 1e6:.2f} | {t_index / t_longest:.3f} |")
            print(line, flush=True)
            lines.append(line)
    if args.results:
        with args.results.open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


def compare_decode_tiles(args: argparse.Namespace) -> None:
    """TRITON_ATTN decode at the throughput run's batch sizes and context mix (Qwen3-0.6B's 16
    query and 8 KV heads, prompts of 100-1,024 tokens plus up to 1,000 generated): the default
    configuration against a grid of split counts, tile lengths and pipeline stages. Each replay
    runs enough copies of the case (caches of their own, about 200 MB in all) that the KV comes
    from memory, as across a forward's layers, not from the L2 cache. The default is chosen as
    for a CUDA-graph batch, whose longest context is taken to be ``max_model_len`` (4,096 as in
    the throughput run); each line is appended to ``--results`` as it is measured."""
    rng = random.Random(0)
    grid = [KernelConfig(1, 16, block_n, 4, stages, splits) for splits in (1, 2, 4, 8, 16)
            for block_n in (64, 128) for stages in (2, 3)]
    header = ("| requests | default config | default us | TB/s | best of the grid | its us | "
              "default vs best |\n|---|---|---|---|---|---|---|")
    lines = [f"### TRITON_ATTN decode configurations ({date.today()}, {describe_machine()})",
             "", "`python benchmarks/attention.py --decode-tiles`", "", header]
    print(header)
    if args.results:
        with args.results.open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")

    def per_case_us(fns: list) -> float:
        def run() -> None:
            for fn in fns:
                fn()
        return time_us(run) / len(fns)

    def label(c: KernelConfig) -> str:
        return f"x{c.num_splits} n{c.block_n} s{c.num_stages}"

    for n in (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 192):
        case = Case(f"{n}", [rng.randint(100, 1024) + rng.randint(0, 1000) for _ in range(n)],
                    [1] * n, num_heads=16, num_kv_heads=8)
        benches = [Bench(case) for _ in range(max(1, math.ceil(200e6 / case.kv_bytes())))]
        for bench in benches:
            bench.common = dataclasses.replace(bench.common, max_seq_len=4096, cuda_graph=True)
        default, fn = benches[0].triton_fn()
        expected = fn().float()
        t_default = per_case_us([b.triton_fn()[1] for b in benches])
        timed = []
        for cfg in grid:
            fns = [b.triton_fn(cfg)[1] for b in benches]
            err = (fns[0]().float() - expected).abs().max().item()
            if err > 2e-2:
                raise AssertionError(f"{n} requests, {cfg}: differs from the default by {err}")
            timed.append((per_case_us(fns), cfg))
        t_best, best = min(timed, key=lambda r: r[0])
        line = (f"| {n} | {label(default)} | {t_default:.1f} | "
                f"{case.kv_bytes() / t_default / 1e6:.2f} | {label(best)} | {t_best:.1f} | "
                f"{t_best / t_default:.3f} |")
        print(line, flush=True)
        if args.results:
            with args.results.open("a") as f:
                f.write(line + "\n")


def compare_kv_dtypes(args: argparse.Namespace, kv_dtype: torch.dtype) -> None:
    kv = str(kv_dtype).removeprefix("torch.")
    probe = AttentionSpec.for_device(torch.device("cuda"), dtype=DTYPE, kv_cache_dtype=kv_dtype,
                                     head_size=HEAD, num_heads=32, num_kv_heads=8,
                                     block_size=PAGE)
    names = [name for name, backend in {"TRITON_ATTN": TritonAttentionBackend,
                                        **vendor_backends()}.items()
             if not backend.validate(probe)]  # the backends that read fp8
    header = ("| shape | " + " | ".join(f"{n}: bf16 -> {kv} (time ratio)" for n in names)
              + f" | TRITON_ATTN {kv} config |\n|---|" + "---|" * (len(names) + 1))
    lines = [f"### attention kernels, bf16 vs {kv} KV cache ({date.today()}, "
             f"{describe_machine()})", "",
             f"`python benchmarks/attention.py --kv-cache-dtype {args.kv_cache_dtype}"
             + (" --sweep" if args.sweep else "") + "`", "",
             "Same values in both caches (the fp8 one rounded, scales 1.0); TB/s counts the "
             "bytes each cache holds. Issue 15's goal: decode 64x2048 at most 0.6x the bf16 "
             "time (about 0.5x, the byte ratio).", "", header]
    # Decode only: the bytes read are the point (a prefill step is compute bound).
    cases = [c for c in headline_cases() + (sweep_cases() if args.sweep else []) if c.decode]
    print(header)
    for case in cases:
        line = fmt_kv_dtypes(measure_kv_dtypes(case, kv_dtype), names)
        print(line, flush=True)
        lines.append(line)
        torch.cuda.empty_cache()
    if args.tune:
        for case in headline_cases()[:1] + headline_cases()[-1:]:
            tune(case, kv_dtype)
    if args.results:
        with args.results.open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
