"""Per-step sampling state for the rows that sample a token, gathered on the host.

``build_sampling_metadata`` turns the per-request ``SamplingParams`` of one step into the
tensors the ``Sampler`` needs. Every decision that depends on values (is any row greedy? does
any row use penalties?) is made here, on the host, so that ``Sampler.forward`` never has to
read a tensor back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hitchllm.engine.rejection_sampler import DraftTokens
from hitchllm.logits_processor import LogitsEdit
from hitchllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Sampling parameters of the N rows that sample this step, as tensors on the logits' device.

    Optional tensors are ``None`` when no row uses the feature, so the sampler skips that work.
    Token-id tensors are right-padded with ``vocab_size``, an id outside the vocabulary that
    the sampler routes to a scratch column.
    """

    # [N] float32; 0 marks a greedy row.
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [N] int64, 0 = off for that row.
    top_k: torch.Tensor | None = None
    # [N] float32, 1 = off for that row.
    top_p: torch.Tensor | None = None
    # [N] float32, 0 = off for that row.
    min_p: torch.Tensor | None = None
    # Row index -> the request's own generator, for seeded random rows only.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Noise for unseeded random rows; None means torch's global RNG.
    default_generator: torch.Generator | None = None
    # [N] float32 each; all three are None together when no row uses any penalty.
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    # [N, Lp] and [N, Lo] int64, set exactly when the penalty tensors are.
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    # [N, S] int64 ids forbidden this step because the row's output is shorter than its
    # min_tokens; None when no row is under its minimum.
    stop_token_mask_rows: torch.Tensor | None = None
    # Largest ``logprobs`` any row asked for; None when no row asked.
    max_num_logprobs: int | None = None
    # Edits from logits processors (logit_bias, allowed ids, bad words, grammar masks),
    # applied in order before min_tokens and penalties; empty when no row uses any.
    logits_edits: list[LogitsEdit] = field(default_factory=list)
    # Speculative decoding: the draft each row verifies (random rows then go through
    # ``rejection_sample``; greedy rows take the argmax, which accepts a draft iff they agree).
    drafts: DraftTokens | None = None

    @property
    def no_penalties(self) -> bool:
        """True when no row uses a presence, frequency or repetition penalty."""
        return self.repetition_penalty is None

    @property
    def reusable(self) -> bool:
        """True when the metadata holds for the same rows' next steps too: nothing in it
        depends on the tokens the rows output (penalties count them, min_tokens forbids stop
        tokens until enough are out, logits processors may follow them; drafts change every
        step). A row past its min_tokens stays past it, so the tensors are then constant."""
        return (self.no_penalties and self.stop_token_mask_rows is None
                and not self.logits_edits and self.drafts is None)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``values`` on ``device``; the copy to a GPU does not wait for the GPU."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    # At least one column so scatter-based consumers never see a zero-width index.
    width = max(1, max((len(r) for r in rows), default=0))
    padded = [r + [pad_id] * (width - len(r)) for r in rows]
    return _to_device(padded, torch.int64, device)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    eos_token_ids: list[int | Sequence[int] | None],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Gather the sampling state of N rows into a ``SamplingMetadata`` on ``device``.

    All list arguments are per row and of equal length. ``generators[i]`` is the request's own
    generator when it was given a seed (ignored for greedy rows, which draw no noise).
    A row whose output is shorter than ``min_tokens`` may not produce its ``stop_token_ids``
    nor its EOS token(s) (``eos_token_ids[i]`` is an id, several ids, or None; EOS is not a
    stop token under ``ignore_eos``, so it stays allowed).
    """
    n = len(params)
    lengths = {len(prompt_token_ids), len(output_token_ids), len(eos_token_ids), len(generators)}
    if lengths != {n}:
        raise ValueError(
            "build_sampling_metadata needs one prompt, output, eos id and generator per row; "
            f"got {n} params and list lengths {sorted(lengths)}."
        )

    temperature: list[float] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    row_generators: dict[int, torch.Generator] = {}
    forbidden: list[list[int]] = []
    max_num_logprobs: int | None = None
    for i, p in enumerate(params):
        if p.greedy:
            # Filters cannot change an argmax, so greedy rows leave them off; that keeps the
            # None-ness of the filter tensors a property of the random rows alone.
            temperature.append(0.0)
            top_k.append(0)
            top_p.append(1.0)
            min_p.append(0.0)
        else:
            temperature.append(p.temperature)
            top_k.append(p.top_k if p.top_k < vocab_size else 0)
            top_p.append(p.top_p)
            min_p.append(p.min_p)
            gen = generators[i]
            if gen is not None:
                row_generators[i] = gen
        row_forbidden: list[int] = []
        if len(output_token_ids[i]) < p.min_tokens:
            row_forbidden = list(p.stop_token_ids or [])
            eos = eos_token_ids[i]
            if eos is not None and not p.ignore_eos:
                row_forbidden.extend([eos] if isinstance(eos, int) else eos)
        forbidden.append(row_forbidden)
        if p.logprobs is not None:
            # More top tokens than the vocabulary holds cannot be returned.
            max_num_logprobs = max(min(p.logprobs, vocab_size), max_num_logprobs or 0)

    num_greedy = sum(t == 0.0 for t in temperature)

    def tensor(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return _to_device(values, dtype, device)

    metadata = SamplingMetadata(
        temperature=tensor(temperature, torch.float32),
        all_greedy=num_greedy == n,
        all_random=num_greedy == 0,
        top_k=tensor(top_k, torch.int64) if any(k > 0 for k in top_k) else None,
        top_p=tensor(top_p, torch.float32) if any(x < 1.0 for x in top_p) else None,
        min_p=tensor(min_p, torch.float32) if any(x > 0.0 for x in min_p) else None,
        generators=row_generators,
        default_generator=default_generator,
        stop_token_mask_rows=(_pad(forbidden, vocab_size, device) if any(forbidden) else None),
        max_num_logprobs=max_num_logprobs,
    )

    uses_penalties = [p.uses_penalties for p in params]
    if any(uses_penalties):
        metadata.presence_penalty = tensor([p.presence_penalty for p in params], torch.float32)
        metadata.frequency_penalty = tensor([p.frequency_penalty for p in params], torch.float32)
        metadata.repetition_penalty = tensor([p.repetition_penalty for p in params], torch.float32)
        # Rows without penalties contribute no tokens: their neutral penalties would ignore
        # them anyway, and leaving them out keeps the padded width small.
        metadata.prompt_token_ids = _pad(
            [list(t) if u else [] for t, u in zip(prompt_token_ids, uses_penalties, strict=True)],
            vocab_size,
            device,
        )
        metadata.output_token_ids = _pad(
            [list(t) if u else [] for t, u in zip(output_token_ids, uses_penalties, strict=True)],
            vocab_size,
            device,
        )
    return metadata
