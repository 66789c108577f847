"""Turn one step's logits into sampled token ids (and, if asked, their logprobs).

Order of operations in ``Sampler.forward``, per row:

a. Logits are cast to float32.
b. Raw logprobs: ``log_softmax`` of the unprocessed logits, computed only when some row asked
   for logprobs. Reported logprobs describe the model's distribution, not the one sampled from
   (vLLM's default "raw" mode).
c. Logits processors (``hitchllm.logits_processor``): logit_bias, allowed_token_ids,
   bad_words and plugins' edits such as a grammar's token mask, in ``metadata.logits_edits``
   order. Then min_tokens: ids in ``stop_token_mask_rows`` get logit -inf.
d. Penalties: repetition first (a token seen in the prompt or the output has a positive logit
   divided by the penalty, a negative one multiplied), then frequency (minus
   ``frequency * count in output``) and presence (minus ``presence * [count in output > 0]``).
e. Greedy rows (temperature 0) take the argmax of the processed logits; ties go to the lowest id.
f. Random rows: divide by temperature; keep the top-k logits; of the renormalized remainder keep
   the smallest set of most probable tokens whose cumulative probability reaches top-p (the top
   token always stays); then drop tokens whose probability is below ``min_p`` times the largest;
   then sample from the renormalized distribution with the exponential race: the token is
   ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn independently per token, which picks token i
   with probability ``probs[i]`` (computed as ``argmax(logits - log q)``, the same winner
   without the softmax). Rows that verify a speculative draft use the same
   distribution and noise in ``rejection_sample`` instead (``hitchllm.engine.rejection_sampler``).

Ties at a filter boundary are kept: every filter is a per-row logit threshold ("keep logits
>= t"), so a token tied with the k-th largest logit, or with the last token top-p needs, survives
too. A row may therefore keep more than k tokens, but the outcome never depends on the order in
which a sort placed equal values, which keeps seeded rows reproducible across batch shapes.

Seeded rows draw their noise from their own generator, one ``[V]`` draw per step, so a seeded
row's token depends only on its logits and its generator, never on its position or neighbours.

Mixed batches run the random path on every row (greedy rows with temperature 1) and pick per
row with ``torch.where``: selecting the random rows first would need their count on the host.
Nothing in ``forward`` reads a device tensor back to the host.

On CUDA, a step of plain temperature sampling (greedy rows allowed; none of b-d, no top-k,
top-p, min-p, seeded rows or drafts) runs the same race in one Triton kernel that reads the
logits once and draws its noise in registers (``hitchllm.engine.race_kernel``): the same
distribution and greedy tokens, another random stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hitchllm.engine.rejection_sampler import rejection_sample
from hitchllm.engine.sampling_metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Logprobs of the sampled token and of the k most likely tokens, per row.

    ``token_ids`` and ``logprobs`` are ``[N, k+1]``: column 0 is the sampled token, columns
    1..k the top-k tokens under the raw distribution, most likely first. ``ranks`` is ``[N]``:
    the 1-based rank of the sampled token under the raw distribution (1 + the number of tokens
    with a strictly larger logprob, so tied tokens share a rank).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """What the sampler produced for the N rows: one token id each, plus optional logprobs."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def _scatter_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` bool mask of the ids in ``token_ids`` (padding id ``vocab_size`` is dropped)."""
    n = token_ids.shape[0]
    # One extra column absorbs the padding id, so no per-row lengths are needed.
    mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    mask.scatter_(1, token_ids, True)
    return mask[:, :vocab_size]


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` int64 count of each id in ``token_ids`` (padding id ``vocab_size`` dropped)."""
    n = token_ids.shape[0]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_min_tokens(logits: torch.Tensor, forbidden_ids: torch.Tensor) -> torch.Tensor:
    """Return ``logits`` with the ids of each row of ``forbidden_ids`` set to -inf."""
    return logits.masked_fill(_scatter_mask(forbidden_ids, logits.shape[-1]), float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """Return ``logits`` after repetition, then frequency and presence penalties.

    Token-id tensors are ``[N, L]`` padded with the vocabulary size; penalties are ``[N]``.
    The repetition penalty looks at prompt and output tokens; frequency and presence only at
    output tokens (the OpenAI definition).
    """
    vocab_size = logits.shape[-1]
    output_counts = _token_counts(output_token_ids, vocab_size)
    in_output = output_counts > 0
    seen = _scatter_mask(prompt_token_ids, vocab_size) | in_output

    factor = torch.where(seen, repetition_penalty[:, None], 1.0)
    # Dividing positive and multiplying negative logits both push a seen token down.
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - frequency_penalty[:, None] * output_counts
    return logits - presence_penalty[:, None] * in_output


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Return ``logits`` with tokens outside each row's top-k / top-p / min-p set at -inf.

    ``top_k`` is ``[N]`` int64 (0 = off), ``top_p`` and ``min_p`` are ``[N]`` float32 (1 and 0 =
    off). Each filter becomes a per-row logit threshold; tokens tied with a threshold stay.
    """
    if top_k is None and top_p is None and min_p is None:
        return logits
    vocab_size = logits.shape[-1]
    threshold = torch.full_like(logits[:, :1], float("-inf"))

    if top_k is not None or top_p is not None:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
            kth_largest = sorted_logits.gather(1, (k - 1)[:, None])
            threshold = torch.maximum(threshold, kth_largest)
            # Top-p works on the distribution renormalized over the top-k survivors.
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
        if top_p is not None:
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # A token is needed while the mass of the tokens above it is still short of top_p;
            # the first token always is (mass 0 < top_p), so num_needed >= 1.
            # clamp: a row whose logits are all -inf has NaN probabilities and would need 0.
            num_needed = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_min(1)
            last_needed = sorted_logits.gather(1, num_needed - 1)
            # top_p = 1 keeps everything; without this, cumsum rounding could drop a tiny tail.
            last_needed = last_needed.masked_fill(top_p[:, None] >= 1.0, float("-inf"))
            threshold = torch.maximum(threshold, last_needed)

    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p); probabilities after
        # renormalization keep their ratios and the top token survives top-k/top-p, so this
        # holds for the filtered distribution too. log(0) = -inf turns the filter off.
        max_logit = logits.amax(dim=-1, keepdim=True)
        threshold = torch.maximum(threshold, max_logit + torch.log(min_p[:, None]))

    return logits.masked_fill(logits < threshold, float("-inf"))


def _exponential_noise(
    shape: torch.Size,
    device: torch.device,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """``Exp(1)`` noise; seeded rows draw theirs from their own generator."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    q.exponential_(generator=default_generator)
    # Seeded rows overwrite the shared draw, so their stream does not depend on the batch.
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return q


def _gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    sampled = sampled[:, None]
    sampled_logprob = raw_logprobs.gather(1, sampled)
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    return LogprobsTensors(
        token_ids=torch.cat([sampled, top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        ranks=ranks,
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first index of its maximum (a NaN counts as the maximum), as
    ``torch.argmax``. On the CPU through ``max``, whose reduction over the last dimension is
    vectorized where argmax's is not (32 x 4,096 float32 logits: about 65 us against 190 us on
    one thread) and which returns the same indices, ties and NaN included."""
    return logits.argmax(dim=-1) if logits.is_cuda else logits.max(dim=-1).indices


def _plain_temperature(metadata: SamplingMetadata) -> bool:
    """Whether the step is temperature sampling alone (greedy rows allowed): no logits
    processors, min_tokens, penalties, top-k/top-p/min-p, seeded rows, drafts or logprobs."""
    return (not metadata.all_greedy and metadata.max_num_logprobs is None
            and not metadata.logits_edits and metadata.stop_token_mask_rows is None
            and metadata.no_penalties and metadata.top_k is None and metadata.top_p is None
            and metadata.min_p is None and not metadata.generators and metadata.drafts is None)


class Sampler(torch.nn.Module):
    """Samples one token per row from ``[N, V]`` logits; see the module docstring for the order
    in which penalties, filters and temperature apply."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Return the sampled token id of each row and, if any row asked, its logprobs.

        ``logits`` is not modified. No host-device synchronization happens here.
        """
        if logits.is_cuda and _plain_temperature(metadata):
            # One pass over the logits (``hitchllm.engine.race_kernel``), same distribution.
            from hitchllm.engine.race_kernel import race_sample

            return SamplerOutput(race_sample(logits, metadata.temperature,
                                             metadata.default_generator), None)
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        for edit in metadata.logits_edits:
            logits = edit(logits)
        if metadata.stop_token_mask_rows is not None:
            logits = apply_min_tokens(logits, metadata.stop_token_mask_rows)
        if not metadata.no_penalties:
            assert metadata.prompt_token_ids is not None
            assert metadata.output_token_ids is not None
            assert metadata.presence_penalty is not None
            assert metadata.frequency_penalty is not None
            assert metadata.repetition_penalty is not None
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalty,
                metadata.frequency_penalty,
                metadata.repetition_penalty,
            )

        if metadata.all_greedy:
            sampled = greedy_tokens(logits)
        else:
            sampled = self._sample_random(logits, metadata)
            if not metadata.all_random:
                greedy = metadata.temperature == 0.0
                sampled = torch.where(greedy, greedy_tokens(logits), sampled)

        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = _gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        temperature = metadata.temperature
        if not metadata.all_random:
            # Greedy rows are overwritten by the caller; temperature 1 keeps them finite.
            temperature = torch.where(temperature == 0.0, 1.0, temperature)
        logits = logits / temperature[:, None]
        if not metadata.no_penalties:
            # A tiny repetition penalty can overflow float32 (validation keeps it positive);
            # +inf would make the softmax NaN, the largest finite value keeps the order.
            logits = logits.clamp_max(torch.finfo(logits.dtype).max)
        logits = apply_top_k_top_p_min_p(logits, metadata.top_k, metadata.top_p, metadata.min_p)
        q = _exponential_noise(
            logits.shape, logits.device, metadata.generators, metadata.default_generator
        )
        # A zero draw would make 0/0 = NaN for a filtered-out token, and argmax picks NaN.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        if metadata.drafts is not None:
            return rejection_sample(logits.softmax(dim=-1), q, metadata.drafts)
        # argmax(probs / q) without the softmax: probs is exp(logits - c) for one c per row,
        # and log is increasing, so the race's winner is argmax(logits - log q) (two passes
        # over [N, V] fewer; a filtered-out token keeps -inf).
        return (logits - q.log_()).argmax(dim=-1)
