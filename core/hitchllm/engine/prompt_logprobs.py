"""Log probabilities of prompt tokens (``SamplingParams.prompt_logprobs``).

For every scheduled position whose next token is still part of the prompt, the logits at that
position score the next prompt token: its logprob and rank, plus the ``k`` most likely
tokens. This reads results back to the host (one sync per asking request and chunk), so it
runs only for requests that ask. Requests that ask are never served from the prefix cache (a
cached prompt token has no logits).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hitchllm.engine.input_batch import RequestState
from hitchllm.outputs import Logprob

# Positions scored per matmul: bounds the [positions, vocab] logits kept in memory at once.
CHUNK = 1024

PromptLogprobs = list[tuple[int, dict[int, Logprob]]]


def compute_prompt_logprobs(
    model: nn.Module,
    hidden: torch.Tensor,
    requests: list[RequestState],
    num_computed: np.ndarray,
    query_start: np.ndarray,
) -> dict[str, PromptLogprobs]:
    """``request_id -> [(prompt index, {token: Logprob})]`` for the asking requests."""
    out: dict[str, PromptLogprobs] = {}
    for i, request in enumerate(requests):
        k = request.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = int(num_computed[i])
        num_new = int(query_start[i + 1] - query_start[i])
        stop = min(start + num_new, request.num_prompt_tokens - 1)
        if stop <= start:
            continue
        entries: PromptLogprobs = []
        for c in range(start, stop, CHUNK):
            end = min(c + CHUNK, stop)
            rows = torch.arange(end - c, device=hidden.device) + int(query_start[i]) + (c - start)
            targets = torch.tensor(request.prompt_token_ids[c + 1 : end + 1],
                                   device=hidden.device)
            logprobs = model.compute_logits(hidden[rows]).float().log_softmax(-1)
            chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
            ranks = (logprobs > chosen[:, None]).sum(1) + 1
            top_lp, top_ids = logprobs.topk(k, dim=-1)  # k == 0 gives empty rows
            for j, (tok, lp, rank, ids, lps) in enumerate(zip(
                targets.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(),
                top_lp.tolist(),
            )):
                entry = {tok: Logprob(lp, rank)}
                for r, (t, v) in enumerate(zip(ids, lps), start=1):
                    entry.setdefault(t, Logprob(v, r))
                entries.append((c + 1 + j, entry))
        out[request.request_id] = entries
    return out
