"""Review findings on the speculative-decoding plugin, each pinned by a test that failed
before its fix."""

from __future__ import annotations

import pytest
from hitchllm_specdec.draft_model import DraftModelProposer
from test_models_hf_parity import greedy
from test_specdec_draft import small_draft  # noqa: F401 (fixture)

from hitchllm.config import EngineConfig
from hitchllm.speculative import DraftRequest, ProposalBatch


@pytest.mark.parametrize("feed_last_draft", [False, True])
def test_draft_model_drafts_when_the_new_token_equals_an_unverified_draft(
        llama_path, small_draft, feed_last_draft):  # noqa: F811
    """The scheduler drops trailing drafts that do not fit a step's budget, and a preempted
    request loses its drafts; its next token may still equal the next (unverified) draft,
    whose K/V the draft cache already holds. The draft model must still compute the logits at
    the newest token: the drafts equal those of a fresh cache."""
    config = EngineConfig(model=llama_path, speculative_method="draft_model",
                          speculative_model=small_draft, num_speculative_tokens=4, block_size=4)
    kept, fresh = DraftModelProposer(config), DraftModelProposer(config)
    kept.feed_last_draft = fresh.feed_last_draft = feed_last_draft
    sequences = {"a": [5, 17, 42], "b": list(range(100, 119))}
    for step in range(6):
        batch = ProposalBatch([DraftRequest(rid, list(seq), 3, 4, greedy())
                               for rid, seq in sequences.items()])
        fresh.remove_requests(list(sequences))
        drafts = kept.propose(batch).drafts
        assert drafts == fresh.propose(batch).drafts
        for rid, seq in sequences.items():
            ids = drafts[rid].token_ids
            # Only the first `verified` drafts were scheduled (all accepted), and the token
            # the target sampled after them happens to be the next draft.
            verified = (step + (rid == "b")) % 3
            seq += ids[: verified + 1]
