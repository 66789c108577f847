"""The ``eagle`` proposer: an EAGLE head's drafts never change what is generated.

The head is random, except that ``fc`` passes the target's hidden state through (plus noise):
it then mostly drafts the token the target just produced, which the tiny random target often
repeats, so every test sees drafts accepted and rejected.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams
from hitchllm.config import ModelConfig

ARCH = "LlamaForCausalLM"


def write_head(directory: Path, target_path: str, seed: int = 0, **config_changes) -> str:
    """A random EAGLE head checkpoint for the target at ``target_path``."""
    from hitchllm_specdec.eagle_head import EagleHead, head_config_json, read_head_config

    directory.mkdir(parents=True, exist_ok=True)
    config = head_config_json(ModelConfig.from_pretrained(target_path)) | config_changes
    (directory / "config.json").write_text(json.dumps(config))
    head = EagleHead(read_head_config(directory), embed=lambda ids: ids)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        h = config["hidden_size"]
        head.fc.weight[:, h:] += torch.eye(h)
    save_file(head.checkpoint_tensors(), directory / "model.safetensors")
    return str(directory)


@pytest.fixture(autouse=True)
def only_eagle(monkeypatch):
    """Import only the proposer under test from the plugin's registry."""
    from hitchllm_specdec import plugin

    monkeypatch.setattr(plugin, "PROPOSERS", {"eagle": plugin.PROPOSERS["eagle"]})


@pytest.fixture(scope="module")
def head_path(tiny_models, tmp_path_factory) -> str:
    return write_head(tmp_path_factory.mktemp("eagle") / "head", tiny_models[ARCH])


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[list[list[int]], torch.Tensor, dict]]:
    """(token ids per request, hidden states, drafts) of every ``propose`` call."""
    from hitchllm_specdec.eagle import EagleProposer

    calls = []
    propose = EagleProposer.propose

    def recording(self, batch):
        proposal = propose(self, batch)
        calls.append(([list(r.token_ids) for r in batch.requests], batch.hidden_states.clone(),
                      {rid: d for rid, d in proposal.drafts.items()}))
        return proposal

    monkeypatch.setattr(EagleProposer, "propose", recording)
    return calls


def acceptance(calls, outputs: dict[str, list[int]]) -> tuple[int, int]:
    """(accepted, rejected) drafts: a draft is accepted when the final sequence continues
    with it after everything before it was accepted."""
    accepted = rejected = 0
    for token_ids, _, drafts in calls:
        for ids, (rid, draft) in zip(token_ids, drafts.items(), strict=True):
            final = outputs[rid]
            for j, t in enumerate(draft.token_ids):
                if len(ids) + j < len(final) and final[len(ids) + j] == t:
                    accepted += 1
                else:
                    rejected += 1
                    break
    return accepted, rejected


def params_mix(texts: list[str]) -> list[SamplingParams]:
    """Greedy rows cut by max_tokens, a stop string and a stop token."""
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[texts[2][5:9]]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def workload(tiny_models):
    """Prompts (two sharing a 24-token prefix), per-request params and the non-speculative
    outputs (token ids, text, finish reason)."""
    shared = mixed_prompts(8, lengths=(24,))[0]
    prompts = [*mixed_prompts(7, lengths=(1, 7, 29, 45)), [*shared, 7, 8], [*shared, 9]]
    free = LLM(tiny_models[ARCH], block_size=4).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    params = params_mix([o.outputs[0].text for o in free])
    outs = LLM(tiny_models[ARCH], block_size=4).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, params, [_summary(o) for o in outs]


def _summary(o):
    c = o.outputs[0]
    return c.token_ids, c.text, c.finish_reason


SCENARIOS = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 17, "max_model_len": 68},
    "no_prefix_caching": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_output_equals_non_speculative(tiny_models, head_path, workload, recorded,
                                              scenario):
    prompts, params, expected = workload
    llm = LLM(tiny_models[ARCH], block_size=4, dtype="float32", speculative_method="eagle",
              num_speculative_tokens=3, speculative_model=head_path, **SCENARIOS[scenario])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [_summary(o) for o in outs] == expected
    finals = {o.request_id: list(o.prompt_token_ids) + o.outputs[0].token_ids for o in outs}
    accepted, rejected = acceptance(recorded, finals)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    # Greedy drafts come without probabilities.
    assert all(d.probs is None for _, _, drafts in recorded for d in drafts.values())
    stats = llm.engine.stats()
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "plain":
        assert stats.prefix_cache_hits > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_kv_blocks


def test_proposer_gets_target_hidden_states_under_chunking_and_preemption(
        tiny_models, head_path, recorded):
    """The hidden state handed to the head is transformers' final hidden state at the
    position before the newest token, also after chunked prefill and recomputation."""
    from reference import hf_model

    prompts = mixed_prompts(5, lengths=(30, 45, 12))
    llm = LLM(tiny_models[ARCH], block_size=4, dtype="float32", speculative_method="eagle",
              num_speculative_tokens=2, speculative_model=head_path, num_kv_blocks=20,
              max_model_len=80, max_num_batched_tokens=8)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    hf = hf_model(tiny_models[ARCH])
    checked = 0
    for token_ids, hidden, _ in recorded[::3]:
        for ids, row in zip(token_ids, hidden, strict=True):
            with torch.no_grad():
                ref = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0, -1]
            torch.testing.assert_close(row.float(), ref, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 10


def test_sampled_tokens_follow_the_target(tiny_models, head_path, recorded):
    """Temperature > 0: the head samples its drafts and returns their probabilities; the first
    two emitted tokens (the second verified against a draft) follow transformers' float64
    distribution within a chi-square bound."""
    from reference import hf_model, hf_sampling_probs
    from test_rejection_sampler import assert_distribution

    path = tiny_models[ARCH]
    prompt, temperature, top_k, n = [5, 17, 42], 0.8, 3, 3000
    hf = hf_model(path)

    def target(ids: list[int]) -> torch.Tensor:
        return hf_sampling_probs(hf, ids, temperature, top_k)

    p0 = target(prompt)
    firsts = p0.nonzero().flatten().tolist()
    seconds = {t: target([*prompt, t]) for t in firsts}
    llm = LLM(path, dtype="float32", speculative_method="eagle", num_speculative_tokens=2,
              speculative_model=head_path, max_num_seqs=512)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    index = {t: i for i, t in enumerate(firsts)}
    counts = torch.zeros(len(firsts), p0.shape[0])
    for o in outs:
        t0, t1 = o.outputs[0].token_ids[:2]
        counts[index[t0], t1] += 1
    assert_distribution(counts, torch.stack([p0[t] * seconds[t] for t in firsts]))
    # Every draft came with the distribution it was drawn from, and some were accepted.
    drafted = {rid: d for _, _, drafts in recorded for rid, d in drafts.items()}
    assert all(d.probs is not None and d.probs.shape == (1, p0.shape[0]) for d in drafted.values())
    sums = torch.stack([d.probs.sum(-1) for d in drafted.values()])
    torch.testing.assert_close(sums, torch.ones_like(sums))
    # The probs reached the sampler: the acceptance rate is the mean of sum min(p, q).
    accepted = sum(drafted[o.request_id].token_ids == o.outputs[0].token_ids[1:2] for o in outs)
    rate = sum(float(torch.minimum(seconds[o.outputs[0].token_ids[0]],
                                   drafted[o.request_id].probs[0].double()).sum())
               for o in outs) / n
    assert accepted > 0
    assert abs(accepted / n - rate) < 5 * math.sqrt(rate * (1 - rate) / n), (accepted, rate)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size"])
def test_head_for_another_model_is_refused(tiny_models, tmp_path, field):
    path = tiny_models[ARCH]
    size = ModelConfig.from_pretrained(path).hf_config[field]
    head = write_head(tmp_path / "head", path, **{field: size * 2})
    with pytest.raises(ValueError, match=f"{field} {size * 2}, the target model {size}"):
        LLM(path, speculative_method="eagle", num_speculative_tokens=2, speculative_model=head)


def test_eagle_needs_a_head_checkpoint(tiny_models, tmp_path):
    path = tiny_models[ARCH]
    with pytest.raises(ValueError, match="needs speculative_model=PATH"):
        LLM(path, speculative_method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="not an EAGLE head checkpoint"):
        LLM(path, speculative_method="eagle", num_speculative_tokens=2,
            speculative_model=str(tmp_path))
    # A target model directory is not a head.
    with pytest.raises(ValueError, match="does not describe an EAGLE head"):
        LLM(path, speculative_method="eagle", num_speculative_tokens=2, speculative_model=path)


@pytest.mark.gpu
def test_greedy_output_equals_non_speculative_on_cuda(tiny_models, head_path, workload,
                                                      recorded):
    """The head runs on the engine's device (drafts verified by the CUDA graphs' runner)."""
    prompts, params, _ = workload
    kwargs = dict(device="cuda", dtype="float32", block_size=16)
    base = LLM(tiny_models[ARCH], **kwargs).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(tiny_models[ARCH], speculative_method="eagle", num_speculative_tokens=3,
              speculative_model=head_path, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [_summary(o) for o in outs] == [_summary(o) for o in base]
    assert recorded and all(h.device.type == "cuda" for _, h, _ in recorded)


def test_head_cache_rolls_back_rejected_drafts():
    """Entries whose input token was a rejected draft go, and so does the entry at the
    position whose target hidden state has just arrived; a reused request id starts over."""
    from hitchllm_specdec.eagle import HeadCache

    kv = torch.arange(5.0).view(5, 1, 1)
    # Newest token 11 at index 3 (its hidden state from position 2), drafts 12, 13, 14: the
    # entries at positions 2..5 were fed 11, 12, 13, 14.
    cache = HeadCache([0, 1, 2, 3, 4], [1, 10, 11, 12, 13], kv, kv.clone(), num_checked=2)
    # 12 accepted, 99 sampled instead of 13: keep positions 0..3, recompute from 4.
    cache.roll_back([0, 1, 10, 11, 12, 99], first_recomputed=4)
    assert cache.positions == [0, 1, 2, 3] and cache.tokens == [1, 10, 11, 12]
    assert cache.keys.flatten().tolist() == [0, 1, 2, 3] and cache.num_checked == 4
    cache.roll_back([0, 1, 10, 11, 12, 99, 5], first_recomputed=5)
    assert cache.positions == [0, 1, 2, 3]
    cache.roll_back([7, 8, 9, 10, 11, 12, 13], first_recomputed=5)
    assert cache.positions == [] and len(cache.keys) == 0


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cached_rows_attention_matches_float64(dtype, tol):
    """A draft step's attention (each row's cached keys, padded to the longest row, plus its
    new token) against float64 attention per row and head, over two steps (the second sees
    the first's key), with grouped query heads; in bf16 with scores large enough (queries and
    keys scaled by 4) that rounding them to bf16 before the softmax would miss the tolerance."""
    from hitchllm_specdec.eagle_head import CachedRows

    gen = torch.Generator().manual_seed(0)
    rows, length, heads, kv_heads, d = 3, 6, 8, 2, 16
    scale = 1.0 if dtype == torch.float32 else 4.0
    keys = (torch.randn(rows, length, kv_heads, d, generator=gen) * scale).to(dtype)
    values = torch.randn(rows, length, kv_heads, d, generator=gen).to(dtype)
    valid = torch.arange(length)[None, :] < torch.tensor([6, 3, 1])[:, None]
    context = CachedRows(keys, values, valid)
    seen_k = [[keys[i, valid[i]]] for i in range(rows)]
    seen_v = [[values[i, valid[i]]] for i in range(rows)]
    for _ in range(2):
        q = (torch.randn(rows, heads, d, generator=gen) * scale).to(dtype)
        k = (torch.randn(rows, kv_heads, d, generator=gen) * scale).to(dtype)
        v = torch.randn(rows, kv_heads, d, generator=gen).to(dtype)
        out = context.attend(q, k, v)
        expected = torch.empty(rows, heads, d, dtype=torch.float64)
        for i in range(rows):
            seen_k[i].append(k[i][None])
            seen_v[i].append(v[i][None])
            row_k, row_v = torch.cat(seen_k[i]).double(), torch.cat(seen_v[i]).double()
            for h in range(heads):
                g = h // (heads // kv_heads)
                probs = (row_k[:, g] @ q[i, h].double() / d**0.5).softmax(0)
                expected[i, h] = probs @ row_v[:, g]
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
