"""Speculative decoding through the proposer hook: drafts never change what is generated."""

from __future__ import annotations

import math

import pytest
import torch
from fake_dists import install_fake_plugin
from test_models_hf_parity import greedy, mixed_prompts, run

from hitchllm import LLM, SamplingParams

PROPOSERS = """
import torch

from hitchllm import hookimpl
from hitchllm.config import ModelConfig
from hitchllm.speculative import Draft, Proposal, Proposer

# Set by the test: request prompt (tuple) -> the full greedy continuation.
ORACLE = {}
STATS = {"proposed": 0}
# (token ids of each request, hidden states) per call of the recorder.
RECORDED = []
# [vocab_size] distribution FixedDistribution draws from (a one-element list, set by the test).
DRAFT_PROBS = []
# Request id -> the drafts FixedDistribution made for it last.
DRAFTED = {}


class Oracle(Proposer):
    '''Proposes the true greedy continuation: every draft should be accepted.'''

    def propose(self, batch):
        drafts = {}
        for r in batch.requests:
            full = ORACLE[tuple(r.token_ids[:r.num_prompt_tokens])]
            n = len(r.token_ids) - r.num_prompt_tokens
            drafts[r.request_id] = Draft(full[n:n + r.max_num_drafts])
            STATS["proposed"] += len(drafts[r.request_id].token_ids)
        return Proposal(drafts)


class Wrong(Proposer):
    '''Proposes tokens the model never picks first: every draft should be rejected.'''

    def propose(self, batch):
        k = self.engine_config.num_speculative_tokens
        return Proposal({r.request_id: Draft([(r.token_ids[-1] + 1 + i) % 500 for i in range(k)])
                         for r in batch.requests})


class Repeat(Proposer):
    '''n-gram style: repeat the last token; sometimes right, sometimes wrong.'''

    def propose(self, batch):
        k = self.engine_config.num_speculative_tokens
        return Proposal({r.request_id: Draft([r.token_ids[-1]] * k) for r in batch.requests})


class Sampled(Proposer):
    '''Drafts drawn from random distributions that it returns as probs (for every other
    request: the rest are verified as point masses in the same batch).'''

    def __init__(self, engine_config):
        super().__init__(engine_config)
        self.vocab_size = ModelConfig.from_pretrained(engine_config.model).vocab_size
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, batch):
        drafts = {}
        for r in batch.requests:
            k = r.max_num_drafts
            q = torch.rand(k, self.vocab_size, generator=self.gen) ** 8
            q = q / q.sum(-1, keepdim=True)
            ids = torch.multinomial(q, 1, generator=self.gen).squeeze(1).tolist() if k else []
            with_probs = int(r.request_id.rsplit("_", 1)[-1]) % 2 == 0
            drafts[r.request_id] = Draft(ids, q if with_probs else None)
        return Proposal(drafts)


class FixedDistribution(Proposer):
    '''One draft per step, sampled from DRAFT_PROBS (set by the test), given as probs.'''

    def __init__(self, engine_config):
        super().__init__(engine_config)
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, batch):
        q = DRAFT_PROBS[0]
        drafts = {}
        for r in batch.requests:
            k = r.max_num_drafts
            ids = torch.multinomial(q, k, replacement=True, generator=self.gen).tolist()
            drafts[r.request_id] = Draft(ids, q.expand(k, -1))
            DRAFTED[r.request_id] = ids
        return Proposal(drafts)


class Recorder(Proposer):
    '''A model-based proposer's view: records the hidden states it is given.'''

    needs_hidden_states = True

    def propose(self, batch):
        RECORDED.append(([list(r.token_ids) for r in batch.requests], batch.hidden_states))
        return Proposal({r.request_id: Draft([r.token_ids[-1]] * r.max_num_drafts)
                         for r in batch.requests})


@hookimpl
def hitchllm_speculative_proposers():
    return {"oracle": Oracle, "wrong": Wrong, "repeat": Repeat, "sampled": Sampled,
            "recorder": Recorder, "fixed": FixedDistribution}
"""


@pytest.fixture
def proposers(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-fake-specdec", "0.1",
                        "fake_specdec_plugin", PROPOSERS)
    import fake_specdec_plugin

    return fake_specdec_plugin


def greedy_steps(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy outputs of ``prompts`` (in order) stepped through ``llm``'s engine by hand, and
    how many engine steps that took."""
    for p in prompts:
        llm.engine.add_request({"prompt_token_ids": p}, greedy())
    outs, steps = {}, 0
    while llm.engine.has_unfinished_requests():
        steps += 1
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return [outs[k] for k in sorted(outs, key=int)], steps


@pytest.mark.parametrize("method", ["oracle", "wrong", "repeat"])
def test_greedy_output_is_unchanged_by_drafts(tiny_models, proposers, method):
    path = tiny_models["LlamaForCausalLM"]
    prompts = mixed_prompts(11, lengths=(3, 17, 30))
    baseline = run(LLM(path, block_size=4), prompts)
    proposers.ORACLE.update({tuple(p): out for p, out in zip(prompts, baseline)})
    llm = LLM(path, block_size=4, speculative_method=method, num_speculative_tokens=3)
    outputs, steps = greedy_steps(llm, prompts)
    assert outputs == baseline
    if method == "oracle":
        # 16 tokens: one from prefill, then 4 per step (3 accepted drafts + 1 bonus).
        assert steps <= 1 + 4 + 1
    assert llm.engine.kv_cache.usage == 0.0


def test_seeded_sampling_with_drafts_is_reproducible(tiny_models, proposers):
    path = tiny_models["LlamaForCausalLM"]
    llm = LLM(path, block_size=4, speculative_method="repeat", num_speculative_tokens=2)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=1)
    a = llm.generate(["spec"], params, use_tqdm=False)[0].outputs[0]
    b = llm.generate(["spec"], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert len(a.logprobs) == 12 and all(t in e for t, e in zip(a.token_ids, a.logprobs))


def test_drafts_respect_stop_tokens(tiny_models, proposers):
    path = tiny_models["LlamaForCausalLM"]
    base = LLM(path).generate(["q"], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    stop = base[5]
    proposers.ORACLE[tuple(LLM(path).get_tokenizer()("q").input_ids)] = base
    llm = LLM(path, speculative_method="oracle", num_speculative_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop])
    out = llm.generate(["q"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: base.index(stop) + 1]


def test_unknown_speculative_method_is_explained(llama_path):
    with pytest.raises(ValueError, match="'medusa'.*hitchllm_speculative_proposers"):
        LLM(llama_path, speculative_method="medusa", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(llama_path, speculative_method="ngram")


def test_sampled_drafts_with_probs_leave_greedy_outputs_unchanged(tiny_models, proposers):
    """Random drafts with random draft distributions, in batches that mix greedy and random
    requests: the greedy ones still produce exactly their tokens without speculation."""
    path = tiny_models["LlamaForCausalLM"]
    prompts = mixed_prompts(5, lengths=(3, 17, 30, 9))
    # float32 everywhere: in bf16 (CUDA's default) the verify pass's other batch shape can flip
    # near-tied argmaxes of a random model, which says nothing about the sampler.
    baseline = run(LLM(path, block_size=4, dtype="float32"), prompts)
    llm = LLM(path, block_size=4, dtype="float32", speculative_method="sampled",
              num_speculative_tokens=3)
    sampled = SamplingParams(temperature=1.0, top_k=20, max_tokens=16, min_tokens=16, seed=3)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(requests + requests, [greedy()] * len(prompts) + [sampled] * len(prompts),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[: len(prompts)]] == baseline
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs[len(prompts):])
    assert llm.engine.kv_cache.usage == 0.0


def test_model_based_proposer_gets_the_targets_final_hidden_states(tiny_models, proposers):
    """Row i of ``hidden_states`` is the target's final hidden state (the LM head's input) at
    the position that produced request i's newest token, also after drafts were accepted
    or rejected; checked against transformers' last hidden state for that prefix."""
    from reference import hf_model

    path = tiny_models["LlamaForCausalLM"]
    llm = LLM(path, block_size=4, dtype="float32", speculative_method="recorder",
              num_speculative_tokens=2)
    prompts = mixed_prompts(7, lengths=(5, 12))
    run(llm, prompts, max_tokens=8)
    hf = hf_model(path)
    checked = 0
    for token_ids, hidden in proposers.RECORDED:
        assert hidden.shape == (len(token_ids), hf.config.hidden_size)
        for ids, row in zip(token_ids, hidden):
            with torch.no_grad():
                ref = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0, -1]
            torch.testing.assert_close(row.float().cpu(), ref, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 2 * 6


def test_proposer_from_before_the_protocol_is_refused(llama_path, monkeypatch):
    class OldStyle:
        def __init__(self, engine_config):
            pass

        def propose(self, requests):
            return {}

    from hitchllm.plugins import get_plugin_registry

    registry = get_plugin_registry()
    monkeypatch.setattr(registry.hook, "hitchllm_speculative_proposers",
                        lambda: [{"old": OldStyle}])
    with pytest.raises(TypeError, match="hitchllm.speculative.Proposer"):
        LLM(llama_path, speculative_method="old", num_speculative_tokens=2)


def test_sampled_tokens_follow_the_target_with_draft_probs(tiny_models, proposers):
    """Through the engine: the second token is verified against a draft drawn from a fixed q
    unlike the target; the first two tokens must follow transformers' float64 distribution
    (temperature, top-k) within a chi-square bound."""
    from reference import hf_model, hf_sampling_probs
    from test_rejection_sampler import assert_distribution

    path = tiny_models["LlamaForCausalLM"]
    prompt, temperature, top_k, n = [5, 17, 42], 0.8, 3, 3000
    hf = hf_model(path)

    def target(ids: list[int]) -> torch.Tensor:
        return hf_sampling_probs(hf, ids, temperature, top_k)

    p0 = target(prompt)
    firsts = p0.nonzero().flatten().tolist()
    seconds = {t: target([*prompt, t]) for t in firsts}
    # Draft mass on the second position's candidates (unevenly) and on tokens it never takes.
    support = sorted({int(t) for p in seconds.values() for t in p.nonzero()} | {7, 300})
    q = torch.zeros(p0.shape[0])
    q[support] = torch.rand(len(support), generator=torch.Generator().manual_seed(9)) + 0.2
    proposers.DRAFT_PROBS[:] = [q / q.sum()]

    llm = LLM(path, speculative_method="fixed", num_speculative_tokens=1, max_num_seqs=512)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    index = {t: i for i, t in enumerate(firsts)}
    counts = torch.zeros(len(firsts), p0.shape[0])
    accepted = 0
    for o in outs:
        t0, t1 = o.outputs[0].token_ids[:2]
        counts[index[t0], t1] += 1
        accepted += proposers.DRAFTED[o.request_id] == [t1]
    joint = torch.stack([p0[t] * seconds[t] for t in firsts])
    assert_distribution(counts, joint)
    # The draft probs reached the sampler: acceptance is sum min(p, q), not sum p * q.
    rate = sum(p0[t] * torch.minimum(seconds[t], q.double() / q.sum()).sum() for t in firsts)
    assert abs(accepted / n - rate) < 5 * math.sqrt(rate * (1 - rate) / n)
