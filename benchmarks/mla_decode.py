"""TRITON_MLA's paged MLA decode kernel vs FlashInfer's MLA decode (issue 18, point 4).

DeepSeek-V3's attention dims (128 heads, latent ``kv_lora_rank`` 512 + rope 64, absorbed
form), bf16, pages of 16 and 64 tokens, at 64 requests x 2048 tokens and 1 request x 32768
tokens. Each request's pages are scattered over the pool (a shuffled block table). For each
case it checks both kernels' outputs against a float32 reference (float64 on the CPU), then
times them: medians of CUDA-event times of calls replayed from a CUDA graph (as the engine
replays decode steps), in microseconds, in ``ROUNDS`` alternating rounds (ours, then
FlashInfer's); the table shows each kernel's best round and every round's ratio, so clocks
drifting between two single timings weigh less.

Bytes read per second count what a decode step must move once: every request's cached
latents (``seq_len x 576`` values, read once for all heads), the queries and the outputs
(``heads x 512``), in bf16 bytes, divided by the time. TRITON_MLA's time includes the merge
of its split-KV partials (as the backend runs it); FlashInfer's is ``wrapper.run`` after
``plan`` (planned once, outside the timing, as an engine plans once per step for all layers).

    PYTHONPATH=core:plugins/attention_mla python benchmarks/mla_decode.py \
        [--results benchmarks/RESULTS.md]

``--device cpu`` runs tiny dims in float32 through Triton's interpreter (a smoke run: its
times mean nothing; FlashInfer is GPU-only and shows "not installed" or "GPU only").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from graph_timing import device_time_us, kernel_bench_args
from results_md import append_results, entry_heading

SECTION = "## MLA decode: TRITON_MLA vs FlashInfer MLA (issue 18)"
ABOUT = ("Paged MLA decode (absorbed form) at DeepSeek-V3 dims, bf16: TRITON_MLA's split-KV "
         "Triton kernel against flashinfer.mla.BatchMLAPagedAttentionWrapper, bytes read per "
         "second (latents once per request + queries + outputs); benchmarks/mla_decode.py. "
         "Goal: TRITON_MLA at least 85% of FlashInfer's bandwidth.")


@dataclass(frozen=True)
class Dims:
    """Attention dims, and the cases as (requests, context length, page size)."""

    heads: int
    kv_lora_rank: int
    rope: int
    cases: tuple[tuple[int, int, int], ...]
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope


GPU_DIMS = Dims(heads=128, kv_lora_rank=512, rope=64, dtype=torch.bfloat16,
                cases=tuple((n, ctx, page) for n, ctx in ((64, 2048), (1, 32768))
                            for page in (16, 64)))
CPU_DIMS = Dims(heads=4, kv_lora_rank=32, rope=8, dtype=torch.float32,
                cases=((3, 20, 4), (1, 50, 16)))


@dataclass
class Case:
    """One decode step's inputs: queries, the paged latent cache and its block table."""

    q: torch.Tensor  # [N, heads, width]
    cache: torch.Tensor  # [blocks, page, width]
    block_table: torch.Tensor  # [N, cols] int32
    seq_lens: torch.Tensor  # [N] int32
    scale: float


def make_case(dims: Dims, requests: int, context: int, page: int, device: torch.device,
              seed: int = 0) -> Case:
    gen = torch.Generator(device).manual_seed(seed)
    cols = -(-context // page)
    num_blocks = requests * cols + 1
    cache = torch.randn(num_blocks, page, dims.width, generator=gen, device=device)
    table = torch.randperm(num_blocks, generator=gen, device=device)[: requests * cols]
    q = torch.randn(requests, dims.heads, dims.width, generator=gen, device=device)
    seq_lens = torch.full((requests,), context, dtype=torch.int32, device=device)
    return Case(q.to(dims.dtype), cache.to(dims.dtype), table.view(requests, cols).int(),
                seq_lens, dims.width**-0.5)


def reference(case: Case, rank: int) -> torch.Tensor:
    """softmax(scale * q . latent) @ latent[:, :rank] per request, in float64 on the CPU and
    float32 on a GPU."""
    dtype = torch.float64 if case.q.device.type == "cpu" else torch.float32
    out = []
    for i, n in enumerate(case.seq_lens.tolist()):
        latent = case.cache[case.block_table[i].long()].flatten(0, 1)[:n].to(dtype)
        probs = (case.q[i].to(dtype) @ latent.T * case.scale).softmax(-1)
        out.append(probs @ latent[:, :rank])
    return torch.stack(out)


def useful_bytes(case: Case, rank: int) -> int:
    """Latents read once per request, queries read, latent outputs written (model dtype)."""
    size = case.cache.element_size()
    latents = int(case.seq_lens.sum()) * case.cache.shape[-1]
    return size * (latents + case.q.numel() + case.q.shape[0] * case.q.shape[1] * rank)


def triton_fn(case: Case, rank: int) -> Callable[[], torch.Tensor]:
    from hitchllm_attention_mla.triton_mla import mla_decode

    max_len = int(case.seq_lens.max())
    return lambda: mla_decode(case.q, case.cache, case.block_table, case.seq_lens, case.scale,
                              rank, max_len)


def flashinfer_status(device: torch.device) -> str | None:
    """Why FlashInfer's MLA column is empty, or None when it can run."""
    if importlib.util.find_spec("flashinfer") is None:
        return "not installed"
    if device.type != "cuda":
        return "GPU only"
    return None


def flashinfer_fn(case: Case, rank: int) -> Callable[[], torch.Tensor]:
    """FlashInfer's paged MLA wrapper, planned for ``case`` (pages in CSR form)."""
    import flashinfer

    n, heads, _ = case.q.shape
    device = case.q.device
    page = case.cache.shape[1]
    pages_per_req = -(-case.seq_lens.long() // page)
    kv_indptr = torch.zeros(n + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = pages_per_req.cumsum(0)
    cols = torch.arange(case.block_table.shape[1], device=device)
    kv_indices = case.block_table[cols[None, :] < pages_per_req[:, None]].int()
    qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=device)
    # The CUDA-graph form (page lists in buffers of its own), as an engine replaying decode
    # steps would use it, since the timing replays a graph.
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        workspace, use_cuda_graph=True, qo_indptr=torch.empty_like(qo_indptr),
        kv_indptr=torch.empty_like(kv_indptr), kv_indices=torch.empty_like(kv_indices),
        kv_len_arr=torch.empty_like(case.seq_lens))
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, case.seq_lens, heads, rank,
                 case.cache.shape[-1] - rank, page, False, case.scale, case.q.dtype,
                 case.cache.dtype)
    q_nope, q_pe = case.q[..., :rank].contiguous(), case.q[..., rank:].contiguous()
    ckv, kpe = case.cache[..., :rank], case.cache[..., rank:]
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


def check(fn: Callable[[], torch.Tensor], want: torch.Tensor, tol: float) -> float:
    """The relative error of ``fn()`` against ``want``; raises when it exceeds ``tol``."""
    got = fn().to(want.dtype)
    error = ((got - want).norm() / want.norm()).item()
    if not error <= tol:
        raise AssertionError(f"output differs from the reference: relative error {error:.2e}")
    return error


HEADER = ("| requests x context | page | TRITON_MLA us | TRITON_MLA GB/s | FlashInfer MLA us | "
          "FlashInfer MLA GB/s | TRITON / FlashInfer bandwidth | each round's ratio | "
          "rel. err Triton / FlashInfer |\n|---|---|---|---|---|---|---|---|---|")
#: Alternating timing rounds per case (each kernel's best is reported).
ROUNDS = 3


def measure(dims: Dims, requests: int, context: int, page: int, device: torch.device,
            repeats: int) -> str:
    """One table row: both kernels checked against the reference, then timed."""
    case = make_case(dims, requests, context, page, device)
    want = reference(case, dims.kv_lora_rank)
    tol = 2e-2 if dims.dtype == torch.bfloat16 else 1e-5
    nbytes = useful_bytes(case, dims.kv_lora_rank)
    ours = triton_fn(case, dims.kv_lora_rank)
    ours_err = check(ours, want, tol)
    reason = flashinfer_status(device)
    theirs = None
    if reason is None:
        theirs = flashinfer_fn(case, dims.kv_lora_rank)
        theirs_err = check(theirs, want, tol)
    rounds = []
    for _ in range(ROUNDS):
        rounds.append((device_time_us(ours, device, repeats),
                       device_time_us(theirs, device, repeats) if theirs is not None else None))
    ours_us = min(r[0] for r in rounds)
    cells = [f"{requests} x {context}", str(page), f"{ours_us:.1f}",
             f"{nbytes / ours_us / 1e3:.0f}"]
    if theirs is not None:
        theirs_us = min(r[1] for r in rounds)
        cells += [f"{theirs_us:.1f}", f"{nbytes / theirs_us / 1e3:.0f}",
                  f"{theirs_us / ours_us:.0%}", " ".join(f"{b / a:.0%}" for a, b in rounds),
                  f"{ours_err:.1e} / {theirs_err:.1e}"]
    else:
        cells += [reason, reason, "-", "-", f"{ours_err:.1e} / -"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return "| " + " | ".join(cells) + " |"


def decode_kernel_note(device: torch.device) -> str:
    """Which of TRITON_MLA's decode kernels the device's tiles ran, and the Hopper kernel's
    fallbacks to the Triton kernel if any (so an entry never credits one with the other)."""
    from hitchllm_attention_mla import triton_mla

    kernel = triton_mla.tiles_for(device).kernel
    failed = sorted(f"{str(dtype).removeprefix('torch.')} lengths, page {page}"
                    for dtype, page in triton_mla.hopper_kernel_fallbacks())
    return f"kernel {kernel}" + (f" (fell back to triton for {'; '.join(failed)})"
                                 if failed else "")


def main(argv: list[str] | None = None) -> list[str]:
    """Run the cases, print the table, append it to ``--results``; returns the rows."""
    args, device, repeats = kernel_bench_args(argv, __doc__)
    dims = GPU_DIMS if device.type == "cuda" else CPU_DIMS
    title = (f"MLA decode, {dims.heads} heads, latent {dims.kv_lora_rank} + {dims.rope}, "
             f"{str(dims.dtype).removeprefix('torch.')}, {args.device}")
    command = "python benchmarks/mla_decode.py" + (" --device cpu" if args.device == "cpu"
                                                    else "")
    print(HEADER)
    rows = []
    for requests, context, page in dims.cases:
        rows.append(measure(dims, requests, context, page, device, repeats))
        print(rows[-1], flush=True)
    kernel = decode_kernel_note(device)
    title += f", {kernel}"
    print(f"TRITON_MLA decode kernel: {kernel}")
    if args.results:
        append_results(args.results, [*entry_heading(title, command), HEADER, *rows],
                       SECTION, ABOUT)
    return rows


if __name__ == "__main__":
    main()
