"""Plain temperature sampling at decode batch sizes: the race kernel the engine runs on CUDA
(``hitchllm.engine.race_kernel``) against the sampler's general path (the same exponential race
in PyTorch ops: float32 logits over the temperature, exponential noise, ``argmax(logits - log
q)``) and, when installed, FlashInfer's ``sampling_from_logits`` on the logits divided by the
temperature. Qwen3's vocabulary (151,936 ids), bf16 logits, temperature 0.6, device times
replayed from CUDA graphs (FlashInfer's noise is fixed inside a graph, which does not change
its time); TB/s is the logits' bf16 read over the time (replays read the same logits, which
at up to about 128 rows stay in an H100's 50 MB L2 cache: not HBM bandwidth there).

    python benchmarks/sampling_kernel.py [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton.testing
from results_md import append_results, entry_heading

from hitchllm.engine.race_kernel import race_sample

VOCAB = 151_936


def general_path(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The sampler's general path for plain temperature rows (``Sampler._sample_random``)."""
    scaled = logits.float() / temperature[:, None]
    q = torch.empty_like(scaled).exponential_()
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (scaled - q.log_()).argmax(dim=-1)


def flashinfer_sampler():
    """FlashInfer's logits sampler, or the reason it is not available."""
    try:
        from flashinfer.sampling import sampling_from_logits
    except Exception as e:  # not installed, or built for another torch
        return None, f"{type(e).__name__}: {e}"

    def sample(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        # A seed and offset given: without them it reads the generator's state, which CUDA
        # graph capture refuses.
        return sampling_from_logits(logits.float() / temperature[:, None], seed=0, offset=0)

    return sample, ""


def graph_us(fn, args: tuple) -> float:
    """Microseconds a call of ``fn(*args)`` takes, replayed from a CUDA graph."""
    return triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=50) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flashinfer, why_not = flashinfer_sampler()
    header = ("| rows | race kernel us | TB/s | general path us | FlashInfer us | "
              "general / race | FlashInfer / race |\n|---|---|---|---|---|---|---|")
    note = "" if flashinfer else f"(FlashInfer not run: {why_not})"
    lines = [*entry_heading("plain temperature sampling, 151,936 ids, bf16 logits",
                            "python benchmarks/sampling_kernel.py", note), header]
    print(header)
    failures = []  # after the table: a line inside it would end the markdown table
    for rows in (1, 16, 64, 128, 256):
        logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 3).bfloat16()
        temperature = torch.full((rows,), 0.6, device="cuda")
        call = (logits, temperature)
        race = graph_us(lambda x, t: race_sample(x, t, None), call)
        general = graph_us(general_path, call)
        vendor = None
        if flashinfer:
            try:
                vendor = graph_us(flashinfer, call)
            except Exception as e:  # e.g. a version that cannot be captured in a graph
                failed = f"FlashInfer at {rows} rows: {type(e).__name__}: {e}"
                print(failed)
                failures.append(f"({failed})")
        tbps = logits.numel() * logits.element_size() / (race * 1e-6) / 1e12
        line = (f"| {rows} | {race:.1f} | {tbps:.2f} | {general:.1f} | "
                f"{f'{vendor:.1f}' if vendor else 'n/a'} | {general / race:.2f}x | "
                f"{f'{vendor / race:.2f}x' if vendor else 'n/a'} |")
        print(line, flush=True)
        lines.append(line)
    for failed in failures:
        lines += ["", failed]
    if args.results:
        append_results(args.results, lines)


if __name__ == "__main__":
    main()
