"""The ``ngram`` (prompt lookup) proposer of hitchllm-specdec: its matcher against a
brute-force reference, and the engine with it against the engine without speculation (the
bundled model on held-out standard-library code, where drafts are accepted)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hitchllm_specdec.ngram import NgramProposer, propose_ngram

from hitchllm import LLM, SamplingParams, default_model_path
from hitchllm.config import EngineConfig
from hitchllm.speculative import DraftRequest, ProposalBatch

HELD_OUT = sorted((Path(__file__).parent / "data/heldout_stdlib").glob("*.py"))
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 3}


def brute_force(context: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The definition, position by position: the longest n whose suffix recurs, its most
    recent earlier occurrence, the tokens after it."""
    length = len(context)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = context[length - n:]
        for start in range(length - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                return context[start + n:start + n + max_drafts]
    return []


def ngram(context: list[int], min_n: int = 1, max_n: int = 4, max_drafts: int = 3) -> list[int]:
    return propose_ngram(np.array(context, dtype=np.int32), min_n, max_n, max_drafts).tolist()


# ---- the matcher ----------------------------------------------------------------------


def random_contexts(seed: int, count: int) -> list[list[int]]:
    """Random sequences over small vocabularies (short n-grams recur often), and repetitive
    ones: a random motif repeated with a few tokens changed."""
    rng = random.Random(seed)
    contexts = []
    for _ in range(count):
        vocab = rng.choice([2, 3, 5, 50])
        if rng.random() < 0.5:
            contexts.append([rng.randrange(vocab) for _ in range(rng.randint(1, 60))])
        else:
            motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            seq = motif * rng.randint(1, 8)
            for _ in range(rng.randint(0, 3)):
                if seq:
                    seq[rng.randrange(len(seq))] = rng.randrange(vocab)
            contexts.append(seq + motif[: rng.randint(0, len(motif))])
    return contexts


@pytest.mark.parametrize(("min_n", "max_n", "max_drafts"),
                         [(1, 1, 1), (1, 4, 3), (2, 3, 5), (3, 6, 2), (4, 4, 8)])
def test_matcher_agrees_with_brute_force(min_n, max_n, max_drafts):
    proposed = 0
    for context in random_contexts(min_n * 100 + max_n, 1500):
        expected = brute_force(context, min_n, max_n, max_drafts)
        assert ngram(context, min_n, max_n, max_drafts) == expected, context
        proposed += bool(expected)
    assert proposed > 300  # the cases exercise matches, not only misses


def test_the_longest_recurring_suffix_wins_over_a_more_recent_shorter_one():
    # "2 3" recurs at the start (then 9); "3" alone recurs more recently (then 7).
    context = [1, 2, 3, 9, 9, 5, 3, 7, 2, 3]
    assert ngram(context, 1, 2) == [9, 9, 5]
    assert ngram(context, 1, 1) == [7, 2, 3]


def test_the_most_recent_occurrence_wins():
    assert ngram([1, 4, 1, 5, 1, 6, 1]) == [6, 1]
    assert ngram([8, 1, 2, 4, 8, 1, 2, 5, 8, 1, 2]) == [5, 8, 1]


def test_min_and_max_bound_the_ngram_size():
    context = [7, 1, 2, 3, 4, 5, 6, 0, 2, 3, 4]
    # Only the 3-gram "2 3 4" and shorter recur.
    assert ngram(context, 4, 5) == []
    assert ngram(context, 3, 5) == [5, 6, 0]
    assert ngram([1, 2, 3, 1], 2, 4) == []  # only a 1-gram recurs
    assert ngram([1, 2, 3, 1], 1, 4) == [2, 3, 1]


def test_drafts_are_capped_by_max_num_drafts_and_by_the_context():
    context = [1, 2, 3, 4, 5, 6, 1]
    assert ngram(context, max_drafts=2) == [2, 3]
    assert ngram(context, max_drafts=10) == [2, 3, 4, 5, 6, 1]
    assert ngram([5, 5, 5], max_drafts=3) == [5]  # the occurrence ends right before the end
    assert ngram([5]) == [] and ngram([]) == []


def test_proposer_keeps_up_with_growing_contexts_and_reused_request_ids(llama_path):
    """Through ``propose``: contexts that grow by a few tokens per step (the cached copy is
    extended) and a request id reused for another context (the copy is rebuilt) get exactly
    the matcher's drafts on the whole context."""
    config = EngineConfig(model=llama_path, speculative_method="ngram",
                          num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    proposer = NgramProposer(config)
    rng = random.Random(1)
    contexts = {"a": [rng.randrange(4) for _ in range(30)], "b": [3, 1, 3, 1, 3]}
    prompts = {"a": 30, "b": 5}
    for step in range(40):
        for tokens in contexts.values():
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        if step == 20:  # "b" ended; a new request with the same id and prompt length
            contexts["b"] = [2, 0, 2, 0, 2] + [rng.randrange(4) for _ in range(40)]
            prompts["b"] = 5
        if step == 30:  # longer than every cached buffer so far
            contexts["a"] += [rng.randrange(4) for _ in range(500)]
        batch = ProposalBatch([DraftRequest(rid, tokens, prompts[rid], 4)
                               for rid, tokens in contexts.items()])
        proposal = proposer.propose(batch)
        for rid, tokens in contexts.items():
            expected = brute_force(tokens, 2, 3, 4)
            got = proposal.drafts[rid].token_ids if rid in proposal.drafts else []
            assert got == expected, (step, rid)
            assert proposal.drafts.get(rid) is None or proposal.drafts[rid].probs is None


def test_ngram_is_registered_by_the_plugin():
    from hitchllm_specdec.plugin import hitchllm_speculative_proposers

    assert hitchllm_speculative_proposers()["ngram"] is NgramProposer


# ---- the engine: exactly the output without speculation -------------------------------


def code_prompts() -> list[str]:
    """Held-out standard-library code (its identifiers and idioms recur: drafts hit)."""
    texts = [p.read_text() for p in HELD_OUT]
    return [texts[0][:700], texts[1][2000:2600], texts[2][:500], texts[1][:450]]


def engine(**config) -> LLM:
    # float32: in bf16 the verify pass's other batch shape could flip near-tied argmaxes.
    return LLM(default_model_path(), dtype="float32", **config)


def generate(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def assert_drafts_accepted(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0, stats


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 40},  # chunked prefill: every prompt takes several steps
    {"num_kv_blocks": 36, "block_size": 16},  # preemption: 4 requests need ~64 blocks
], ids=["plain", "chunked_prefill", "preemption"])
def test_greedy_output_equals_no_speculation(config):
    prompts = code_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    baseline = generate(engine(**config), prompts, params)
    llm = engine(**config, **NGRAM)
    outs = generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in baseline]
    assert_drafts_accepted(llm)
    if "num_kv_blocks" in config:
        assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv_cache.usage == 0.0


def test_prefix_cached_prompts_give_the_same_output():
    prompts = code_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32)
    baseline = [o.outputs[0].token_ids for o in generate(engine(), prompts, params)]
    llm = engine(**NGRAM)
    first = generate(llm, prompts, params)
    hits = llm.engine.stats().prefix_cache_hits
    # Again, plus prompts that share a cached prefix and then go their own way.
    extended = [p + "\n    def " for p in prompts]
    again = generate(llm, prompts + extended, params)
    assert llm.engine.stats().prefix_cache_hits > hits
    assert [o.outputs[0].token_ids for o in first] == baseline
    assert [o.outputs[0].token_ids for o in again[: len(prompts)]] == baseline
    expected = [o.outputs[0].token_ids for o in generate(engine(), extended, params)]
    assert [o.outputs[0].token_ids for o in again[len(prompts):]] == expected
    assert_drafts_accepted(llm)


def test_stop_strings_and_max_tokens_cut_where_they_do_without_speculation():
    prompts = code_prompts()
    free = generate(engine(), prompts, SamplingParams(temperature=0.0, max_tokens=40))
    # A stop string from the middle of each free-running output; max_tokens that end inside
    # a step's accepted drafts (1 and 2 take fewer tokens than one verified step yields).
    stops = [o.outputs[0].text[15:19] for o in free]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]) for stop in stops]
    params += [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
               for n in (1, 2, 5, 11)]
    requests = prompts + prompts
    baseline = generate(engine(), requests, params)
    llm = engine(**NGRAM)
    outs = generate(llm, requests, params)
    for got, want in zip(outs, baseline, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:4])
    assert [len(o.outputs[0].token_ids) for o in outs[4:]] == [1, 2, 5, 11]
    assert_drafts_accepted(llm)


def test_batch_mixing_penalties_and_logprobs_matches_and_logprobs_equal():
    prompts = code_prompts()
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.8,
                       frequency_penalty=0.4, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=40),
    ]
    baseline = generate(engine(), prompts, kinds)
    llm = engine(**NGRAM)
    outs = generate(llm, prompts, kinds)
    for got, want in zip(outs, baseline, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for i in (0, 2):
        got, want = outs[i].outputs[0].logprobs, baseline[i].outputs[0].logprobs
        assert len(got) == len(want) == len(outs[i].outputs[0].token_ids)
        for got_step, want_step in zip(got, want, strict=True):
            assert got_step.keys() == want_step.keys()
            for token in want_step:
                assert got_step[token].logprob == pytest.approx(want_step[token].logprob,
                                                                abs=1e-4)
                assert got_step[token].rank == want_step[token].rank
    assert_drafts_accepted(llm)


def test_sampled_tokens_follow_the_target_distribution():
    """Temperature 1 with top-k 3 on a repetitive prompt: ngram drafts the second token
    (verified as a point mass, accepted or rejected); the first two tokens must follow
    transformers' float64 distribution within a chi-square bound."""
    from reference import hf_model, hf_sampling_probs
    from test_rejection_sampler import assert_distribution

    path = default_model_path()
    llm = engine(**NGRAM, max_num_seqs=512)
    # The likely first tokens occur in the prompt, so each gets a draft, and the drafts'
    # target probabilities lie between 0.15 and 0.85: a wrong acceptance rule shows.
    text = "if x is None:\n    return None\nif y is None:\n    return"
    prompt = llm.get_tokenizer()(text).input_ids
    temperature, top_k, n = 1.0, 3, 2000
    hf = hf_model(path, torch.float64)

    def target(ids: list[int]) -> torch.Tensor:
        return hf_sampling_probs(hf, ids, temperature, top_k)

    p0 = target(prompt)
    firsts = p0.nonzero().flatten().tolist()
    joint = torch.stack([p0[t] * target([*prompt, t]) for t in firsts])
    # max_tokens 3: one draft after the first token (the one after it is never drafted).
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3,
                            ignore_eos=True)
    outs = generate(llm, [{"prompt_token_ids": prompt}] * n, params)
    index = {t: i for i, t in enumerate(firsts)}
    counts = torch.zeros_like(joint)
    for o in outs:
        t0, t1 = o.outputs[0].token_ids[:2]
        counts[index[t0], t1] += 1
    assert_distribution(counts, joint)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0.95 * n
    assert n / 10 < stats.spec_decode_num_accepted_tokens < n / 2
