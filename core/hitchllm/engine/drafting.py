"""Between two steps: ask the speculative proposer for drafts and give them to the requests.

The proposer protocol is ``hitchllm.speculative``; this module is the engine's side of it:
which requests are asked, what limits their drafts, and how a proposal is checked before the
next step computes it.
"""

from __future__ import annotations

import torch

from hitchllm.engine.runner_output import RunnerOutput
from hitchllm.logits_processor import host_to_device
from hitchllm.request import Request
from hitchllm.speculative import DraftRequest, Proposal, ProposalBatch, Proposer


class Drafter:
    """Runs one engine's ``Proposer`` after every step."""

    def __init__(
        self,
        proposer: Proposer,
        num_speculative_tokens: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device

    def propose(self, running: list[Request], output: RunnerOutput) -> None:
        """Set the drafts of every running request that sampled in the step of ``output``
        and is decoding (none for one that may not take any more). A decoding request that did
        not run in that step keeps its drafts: its context has not changed since they were
        made."""
        row_of = {rid: i for i, rid in enumerate(output.sampled)}
        decoding = []
        limits = []
        # (The scheduler cleared the old drafts of requests that sampled.)
        for r in running:
            if r.request_id in row_of and r.num_computed_tokens == r.num_tokens - 1:
                limit = self._max_num_drafts(r)
                if limit:
                    decoding.append(r)
                    limits.append(limit)
        if not decoding:
            return
        hidden = None
        if self.proposer.needs_hidden_states:
            assert output.hidden_states is not None, "the runner did not keep hidden states"
            rows = [row_of[r.request_id] for r in decoding]
            hidden = output.hidden_states
            if rows != list(range(len(row_of))):
                index = host_to_device(torch.tensor(rows, dtype=torch.int64), hidden.device)
                hidden = hidden[index]
        batch = ProposalBatch(
            [
                DraftRequest(r.request_id, r.all_token_ids, r.num_prompt_tokens, limit,
                             r.sampling_params)
                for r, limit in zip(decoding, limits, strict=True)
            ],
            hidden,
        )
        proposal = self.proposer.propose(batch)
        for r, limit in zip(decoding, limits, strict=True):
            self._apply(r, proposal, limit)

    def _max_num_drafts(self, r: Request) -> int:
        """Drafts beyond max_model_len, or beyond max_tokens counting the token that
        always follows them, could never be output."""
        max_tokens = r.sampling_params.max_tokens or self.max_model_len
        return max(
            0,
            min(
                self.num_speculative_tokens,
                self.max_model_len - r.num_tokens,
                max_tokens - r.num_output_tokens - 1,
            ),
        )

    def _apply(self, r: Request, proposal: Proposal, limit: int) -> None:
        draft = proposal.drafts.get(r.request_id)
        if draft is None:
            return
        proposed = [int(t) for t in draft.token_ids[:limit]]
        # A draft outside the vocabulary (a proposer bug) ends the draft there.
        valid = next(
            (i for i, t in enumerate(proposed) if not 0 <= t < self.vocab_size), len(proposed)
        )
        r.spec_token_ids = proposed[:valid]
        if draft.probs is not None and valid:
            expected = (len(draft.token_ids), self.vocab_size)
            if tuple(draft.probs.shape) != expected:
                raise ValueError(
                    f"{type(self.proposer).__name__} returned draft probs of shape "
                    f"{tuple(draft.probs.shape)} for request {r.request_id!r}; expected "
                    f"{list(expected)} (one row of vocabulary probabilities per draft token)"
                )
            r.spec_token_probs = draft.probs[:valid].to(self.device, torch.float32)
