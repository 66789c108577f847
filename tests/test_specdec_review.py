"""Review findings on the speculative-decoding plugin, each pinned by a test that failed
before its fix."""

from __future__ import annotations

import pytest
import torch
from hitchllm_specdec.draft_model import DraftModelProposer
from test_models_hf_parity import greedy
from test_specdec_draft import small_draft  # noqa: F401 (fixture)

from hitchllm import LLM, SamplingParams
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



def test_draft_model_with_drafts_cut_by_the_step_budget_keeps_greedy_output(llama_path):
    """End to end: a budget of 2 tokens per step verifies one draft of 3; the target's next
    token is the second draft (the model drafts for itself), whose K/V the draft cache holds.
    The draft model's catch-up raised (AssertionError) there and the request ended after 3 of
    its 24 tokens."""
    prompt = {"prompt_token_ids": [5, 17, 42, 3]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=2)
    baseline = LLM(llama_path, **options).generate(prompt, params, use_tqdm=False)
    llm = LLM(llama_path, speculative_method="draft_model", speculative_model=llama_path,
              num_speculative_tokens=3, **options)
    outs = llm.generate(prompt, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == baseline[0].outputs[0].token_ids
    assert llm.engine.proposer.cache.stats.num_accepted > 0

def test_draft_model_noise_of_a_seeded_request_is_not_the_target_samplers(llama_path,
                                                                          small_draft):  # noqa: F811
    """The rejection sampler draws a seeded row's noise (acceptance ``u = exp(-E[d_j])`` and
    the residual race) from ``Generator().manual_seed(seed)``, one ``[V]`` vector per row.
    Had the draft drawn its tokens from the same stream, the noise that verifies draft ``j``
    would be the noise that chose a later draft, so accepting ``d_j`` would make that draft
    less likely to be ``d_j`` than ``q`` says, biasing the output. The draft's stream for a
    seeded request must be another one (still a function of the seed alone)."""
    config = EngineConfig(model=llama_path, speculative_method="draft_model",
                          speculative_model=small_draft, num_speculative_tokens=4, block_size=4)
    proposer = DraftModelProposer(config)
    vocab = proposer.vocab_size
    for seed in (0, 123, -(2**63), 2**64 - 1):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=20)
        rid = f"r{seed}"
        proposal = proposer.propose(ProposalBatch([DraftRequest(rid, [5, 17, 42], 3, 4, params)]))
        assert len(proposal.drafts[rid].token_ids) == 4
        target = torch.Generator().manual_seed(seed)
        target_stream = [torch.empty(vocab).exponential_(generator=target) for _ in range(12)]
        following = torch.empty(vocab).exponential_(
            generator=proposer.cache.states[rid].generator)
        assert not any(torch.equal(following, t) for t in target_stream)
    # Unseeded requests: the draft's shared generator is not the target sampler's either.
    params = SamplingParams(temperature=1.0, max_tokens=20)
    proposer.propose(ProposalBatch([DraftRequest("u", [5, 17, 42], 3, 4, params)]))
    target = torch.Generator().manual_seed(config.seed)
    target_stream = [torch.empty(vocab).exponential_(generator=target) for _ in range(12)]
    following = torch.empty(vocab).exponential_(generator=proposer.generator)
    assert not any(torch.equal(following, t) for t in target_stream)


def test_eagle_frees_head_caches_of_finished_requests(llama_path, tmp_path):
    """A finished (or aborted) request's head cache is freed when the engine says it
    finished, not kept until 2 * max_num_seqs other requests evict it (device memory of up to
    ``max_model_len`` entries each, and stale state for a reused id)."""
    from test_specdec_eagle import write_head

    head = write_head(tmp_path / "head", llama_path)
    llm = LLM(llama_path, block_size=4, dtype="float32", speculative_method="eagle",
              num_speculative_tokens=3, speculative_model=head)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 17, 42, i]} for i in range(3)], params,
                 use_tqdm=False)
    assert llm.engine.proposer.caches == {}
    llm.engine.add_request({"prompt_token_ids": [5, 17, 42]}, params, request_id="x")
    for _ in range(3):
        llm.engine.step()
    assert "x" in llm.engine.proposer.caches
    llm.engine.abort_request(["x"])
    assert llm.engine.proposer.caches == {}


def test_eagle_draft_noise_is_not_the_target_samplers_stream(llama_path, tmp_path):
    """The eagle head samples drafts from a generator of its own; seeded with the engine's
    seed it would replay the stream the target's sampler draws its (acceptance) noise from."""
    from test_specdec_eagle import write_head

    head = write_head(tmp_path / "head", llama_path)
    llm = LLM(llama_path, block_size=4, dtype="float32", speculative_method="eagle",
              num_speculative_tokens=3, speculative_model=head, seed=5)
    target = torch.Generator().manual_seed(5)
    assert not torch.equal(torch.rand(16, generator=llm.engine.proposer.generator),
                           torch.rand(16, generator=target))


def test_draft_model_eviction_keeps_a_seeded_requests_noise_stream(llama_path,
                                                                   small_draft):  # noqa: F811
    """A request evicted from the draft cache (idle while the pool ran short) recomputes its
    K/V but must go on drawing fresh draft noise: restarting its seeded generator would draw
    the noise of its earlier drafts again, which the context already depends on (drafts then
    do not follow ``q``). Evicted or not, its drafts are the same."""
    config = EngineConfig(model=llama_path, speculative_method="draft_model",
                          speculative_model=small_draft, num_speculative_tokens=4, block_size=4)
    kept, evicted = DraftModelProposer(config), DraftModelProposer(config)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=50)
    seq = [5, 17, 42]
    for step in range(3):
        batch = ProposalBatch([DraftRequest("s", list(seq), 3, 4, params)])
        drafts = kept.propose(batch).drafts
        assert drafts["s"].token_ids == evicted.propose(batch).drafts["s"].token_ids
        # Another request takes every block: "s" (idle) is evicted.
        cache = evicted.cache
        other = cache.catch_up("other", [1])
        assert cache.allocate(other, cache.num_blocks * cache.block_size, {"other"})
        cache.free("other")
        assert cache.num_free_blocks == cache.num_blocks
        seq += [*drafts["s"].token_ids[:step], 3]


def test_draft_model_request_without_room_keeps_its_noise_stream(
        llama_path, monkeypatch, small_draft):  # noqa: F811
    """A seeded request that goes without drafts for a step because the draft cache is full
    (every block held by requests drafted for) keeps its generator, like an evicted one: its
    next drafts are those of a proposer where that step never happened."""
    from hitchllm_specdec import draft_model

    # 16 blocks of the small draft (K and V, 1 layer, 1 KV head of 16, 4 tokens, float32).
    monkeypatch.setattr(draft_model, "DRAFT_KV_CACHE_CPU_BYTES", 16 * 2 * 16 * 4 * 4)
    config = EngineConfig(model=llama_path, speculative_method="draft_model",
                          speculative_model=small_draft, num_speculative_tokens=4, block_size=4,
                          max_model_len=64)
    short, reference = DraftModelProposer(config), DraftModelProposer(config)
    assert short.cache.num_blocks == 16
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=50)
    b = DraftRequest("b", [5, 17, 42], 3, 4, params)
    for proposer in (short, reference):
        proposer.propose(ProposalBatch([b]))
    # A long request takes 14 blocks first; "b" holds 2 and needs a third: no drafts.
    a = DraftRequest("a", list(range(100, 153)), 53, 4, greedy())
    b = DraftRequest("b", [5, 17, 42, 8, 9, 10, 11], 3, 4, params)
    assert set(short.propose(ProposalBatch([a, b])).drafts) == {"a"}
    short.remove_requests(["a"])
    drafts = [p.propose(ProposalBatch([b])).drafts["b"].token_ids for p in (short, reference)]
    assert drafts[0] == drafts[1]
