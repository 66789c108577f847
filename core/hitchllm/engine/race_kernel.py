"""Temperature sampling in one pass over the logits, on CUDA (a Triton kernel).

Plain temperature sampling (no filters, penalties, logits processors, seeded rows or logprobs)
is most of a throughput run's sampling. The sampler's general path reads and writes ``[N, V]``
float32 tensors six times (cast, temperature, noise, log, difference, argmax): at 256 rows and a
151,936-token vocabulary about 1.5 GB a step, 0.35 ms on an H100. This kernel reads the logits
once, in their own dtype, and draws the noise in registers: token
``argmax(logits / temperature - log q)`` with ``q = -log u`` and ``u`` uniform from Philox
(keyed by one seed a step, drawn from the engine's generator; counters per row and position),
the same exponential race as ``Sampler`` (the token with probability ``softmax(logits / T)``).
Rows with temperature 0 take the argmax of the logits. Ties go to the lowest id, as
``torch.argmax``.

The kernel is bound by arithmetic, not by its read (Philox and two logarithms an id), so it
scores in base 2: ``logits * (log2(e) / T) - log2(q)``, the race's score times ``log2(e)``,
which has the same winner. ``q = -log u`` stays accurate (for ``u`` near 1, ``q`` is tiny
and decides the race); the outer logarithm is the GPU's fast one (``lg2.approx``: within
about 2^-22 for ``q`` in [0.5, 2], a few units in the last place of ``log2 q`` elsewhere, at
most about 2^-18 for the smallest ``q``), which moves any id's odds by a few parts in a
million at most, the order of float32's own rounding of ``logits * scale``.

Each program takes one row's chunk of up to 8,192 ids and writes its best score and id; a
``[N, chunks]`` argmax picks the row's winner (the first chunk among equal scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hitchllm.attention.triton_support import triton_interpreting

# Lanes per program (fewer for a small vocabulary); each loop step scores 4 ids per lane with
# one Philox call, and a program takes up to LOOPS steps of one row.
MAX_BLOCK = 1024
LOOPS = 2


@triton.jit
def _score(row_ptr, cols, vocab_size, bits, scale, greedy, FAST_LOG2: tl.constexpr):
    x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    q = -tl.log(tl.uint_to_uniform_float(bits))
    # The interpreter (and AMD GPUs) take the accurate logarithm.
    log2_q = libdevice.fast_log2f(q) if FAST_LOG2 else tl.log2(q)
    return tl.where(greedy, x, x * scale - log2_q)


@triton.jit
def _keep_best(best, best_id, score, cols):
    better = score > best  # strict: a lane keeps its earlier (lower) id on ties
    return tl.where(better, score, best), tl.where(better, cols, best_id)


@triton.jit
def _race_kernel(logits_ptr, stride_row, temperature_ptr, seed_ptr, score_out, id_out,
                 vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 FAST_LOG2: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    scale = 1.4426950408889634 / tl.where(greedy, 1.0, temperature)  # log2(e) / T
    seed = tl.load(seed_ptr)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    counters = (row.to(tl.int64) * num_chunks + chunk) * (CHUNK // 4) + lanes
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    start = chunk * CHUNK
    for i in range(CHUNK // (4 * BLOCK)):
        r0, r1, r2, r3 = tl.randint4x(seed, counters + i * BLOCK)
        base = start + i * 4 * BLOCK + lanes
        best, best_id = _keep_best(best, best_id, _score(row_ptr, base, vocab_size, r0,
                                                         scale, greedy, FAST_LOG2), base)
        best, best_id = _keep_best(best, best_id, _score(row_ptr, base + BLOCK, vocab_size, r1,
                                                         scale, greedy, FAST_LOG2), base + BLOCK)
        best, best_id = _keep_best(best, best_id, _score(row_ptr, base + 2 * BLOCK, vocab_size,
                                                         r2, scale, greedy, FAST_LOG2),
                                   base + 2 * BLOCK)
        best, best_id = _keep_best(best, best_id, _score(row_ptr, base + 3 * BLOCK, vocab_size,
                                                         r3, scale, greedy, FAST_LOG2),
                                   base + 3 * BLOCK)
    top = tl.max(best, axis=0)
    top_id = tl.min(tl.where(best == top, best_id, vocab_size), axis=0)
    tl.store(score_out + row * num_chunks + chunk, top)
    tl.store(id_out + row * num_chunks + chunk, top_id)


def race_sample(logits: torch.Tensor, temperature: torch.Tensor,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` [N, V] (any float dtype, rows contiguous): sampled at
    ``temperature`` [N] (float32; 0 = greedy), with the step's noise keyed by a seed drawn from
    ``generator`` (the device's default generator when None). No host synchronization."""
    n, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(triton.cdiv(vocab_size, 4))))
    chunk = 4 * block * min(LOOPS, triton.cdiv(vocab_size, 4 * block))
    num_chunks = triton.cdiv(vocab_size, chunk)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=logits.device,
                         generator=generator)
    scores = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    _race_kernel[(n, num_chunks)](logits, logits.stride(0), temperature, seed, scores, ids,
                                  vocab_size, num_chunks, CHUNK=chunk, BLOCK=block,
                                  FAST_LOG2=(logits.is_cuda and torch.version.hip is None
                                             and not triton_interpreting()))
    winner = scores.argmax(dim=1, keepdim=True)
    return ids.gather(1, winner).squeeze(1).to(torch.int64)
