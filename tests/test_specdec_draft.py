"""The draft_model proposer: a smaller model drafts on its own paged KV cache; the output is
exactly the target's (greedy: token for token; sampled: in distribution), and a model
drafting for itself has its drafts accepted."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch
from hitchllm_specdec.draft_checkpoint import write_truncated_checkpoint
from test_models_hf_parity import greedy, mixed_prompts, run
from test_speculative import greedy_steps

from hitchllm import LLM, SamplingParams
from hitchllm.bundled_model import default_model_path
from hitchllm.speculative import Proposal
from hitchllm.tiny_model import build_tiny_checkpoint


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> str:
    """A random Llama smaller than the tiny target (1 layer, width 32), same tokenizer."""
    return str(build_tiny_checkpoint(
        tmp_path_factory.mktemp("draft") / "small", "LlamaForCausalLM", seed=7,
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))


def speculative(target: str, draft: str, k: int = 3, **kwargs) -> LLM:
    return LLM(target, speculative_method="draft_model", speculative_model=draft,
               num_speculative_tokens=k, **kwargs)


def assert_no_draft_blocks_held(llm: LLM) -> None:
    cache = llm.engine.proposer.cache
    assert cache.states == {}
    assert cache.num_free_blocks == cache.num_blocks


def record_drafts(llm: LLM) -> dict[str, list[list[int]]]:
    """Every draft the proposer returns, per request id, in order."""
    proposer = llm.engine.proposer
    drafted: dict[str, list[list[int]]] = {}
    propose = proposer.propose

    def recording(batch) -> Proposal:
        proposal = propose(batch)
        for rid, draft in proposal.drafts.items():
            drafted.setdefault(rid, []).append(list(draft.token_ids))
            assert (draft.probs is None) == batch_params(batch, rid).greedy
        return proposal

    proposer.propose = recording
    return drafted


def batch_params(batch, request_id: str) -> SamplingParams:
    return next(r.sampling_params for r in batch.requests if r.request_id == request_id)


@pytest.mark.parametrize("feed_last_draft", [False, True])
def test_self_drafting_is_exact_and_accepted(llama_path, feed_last_draft):
    """The target drafting for itself: greedy output equals non-speculative decoding and
    (almost) every draft is accepted, so a step emits about K + 1 tokens. (With
    ``feed_last_draft``, as with CUDA graphs, the last draft is cached too.)"""
    prompts = mixed_prompts(2, lengths=(3, 17, 30, 9))
    baseline = run(LLM(llama_path, block_size=4), prompts)
    llm = speculative(llama_path, llama_path, k=3, block_size=4)
    llm.engine.proposer.feed_last_draft = feed_last_draft
    outputs, steps = greedy_steps(llm, prompts)
    assert outputs == baseline
    stats = llm.engine.proposer.cache.stats
    assert stats.num_drafts >= 3 * 3 * len(prompts)
    assert stats.acceptance_rate > 0.95, stats
    # 16 tokens: 1 from the prompt step, then up to 4 per step.
    assert steps <= 1 + 4 + 2
    assert_no_draft_blocks_held(llm)


def test_bundled_model_drafting_for_itself_is_accepted():
    """The bundled (trained) model drafting for itself, on code prompts."""
    path = default_model_path()
    prompts = ["def add(a, b):\n", "import os\nimport sys\n", "class Engine:\n    def step"]
    params = SamplingParams(temperature=0, max_tokens=24)
    baseline = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params,
                                                                     use_tqdm=False)]
    llm = speculative(path, path, k=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert llm.engine.proposer.cache.stats.acceptance_rate > 0.95


@pytest.mark.parametrize("feed_last_draft", [False, True])
def test_drafts_after_rejections_equal_drafts_from_a_fresh_cache(llama_path, small_draft,
                                                                 feed_last_draft):
    """Rolling back: whatever the target accepted, the next drafts are those of a draft cache
    computed from scratch for the same sequence (rejected drafts' K/V never leaks in), also
    when the last draft is cached too (``feed_last_draft``, as with CUDA graphs)."""
    from hitchllm_specdec.draft_model import DraftModelProposer

    from hitchllm.config import EngineConfig
    from hitchllm.speculative import DraftRequest, ProposalBatch

    config = EngineConfig(model=llama_path, speculative_method="draft_model",
                          speculative_model=small_draft, num_speculative_tokens=4, block_size=4)
    kept, fresh = DraftModelProposer(config), DraftModelProposer(config)
    kept.feed_last_draft = fresh.feed_last_draft = feed_last_draft
    logits: dict[DraftModelProposer, list[torch.Tensor]] = {kept: [], fresh: []}
    for proposer in (kept, fresh):
        forward = proposer.runner.forward
        proposer.runner.forward = lambda *a, _f=forward, _l=logits[proposer], **k: (
            _l.append(_f(*a, **k)) or _l[-1])
    rng = torch.Generator().manual_seed(0)
    sequences = {"a": [5, 17, 42], "b": list(range(100, 119))}
    for step in range(12):
        batch = ProposalBatch([DraftRequest(rid, list(seq), 3, 4, greedy())
                               for rid, seq in sequences.items()])
        fresh.remove_requests(list(sequences))
        drafts = kept.propose(batch).drafts
        assert drafts == fresh.propose(batch).drafts
        # Not only the argmax: the draft's distributions match at every draft step.
        assert len(logits[kept]) == len(logits[fresh]) == 4 + feed_last_draft
        for a, b in zip(logits[kept], logits[fresh]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        logits[kept].clear()
        logits[fresh].clear()
        for rid, seq in sequences.items():
            ids = drafts[rid].token_ids
            skips = rid == "b" and step % 3 == 0
            accepted = 1 if skips else int(torch.randint(0, len(ids) + 1, (), generator=rng))
            # Accepted drafts, then a token other than the next draft.
            seq += [*ids[:accepted], (ids[accepted] + 1) % 500 if accepted < len(ids) else 7]
            if skips:
                seq.append(9)  # a step in which the request was not asked for drafts
    stats = kept.cache.stats
    assert 0 < stats.num_accepted < stats.num_drafts


@pytest.mark.parametrize("case", ["chunked_prefill", "preemption", "prefix_caching"])
def test_other_draft_model_leaves_greedy_output_unchanged(llama_path, small_draft, case):
    """A different, smaller draft model (drafts often rejected): greedy tokens equal the
    non-speculative engine's under the same scheduling pressure, with max_tokens cut-offs."""
    shared = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    prompts = [*mixed_prompts(4, lengths=(3, 17, 30, 9, 44)), [*shared, 30], [*shared, 31, 32]]
    max_tokens = [16, 5, 11, 1, 16, 9, 14]
    options = {
        "chunked_prefill": dict(max_num_batched_tokens=16, max_num_seqs=8),
        "preemption": dict(num_kv_blocks=24),
        "prefix_caching": dict(enable_prefix_caching=True),
    }[case]

    def generate(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [greedy(m) for m in max_tokens], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    baseline = generate(LLM(llama_path, block_size=4, **options))
    llm = speculative(llama_path, small_draft, k=3, block_size=4, **options)
    assert generate(llm) == baseline
    assert [len(t) for t in baseline] == max_tokens
    if case == "preemption":
        assert llm.engine.stats().num_preemptions > 0
    if case == "prefix_caching":
        assert llm.engine.kv_cache.prefix_cache_hits > 0
    stats = llm.engine.proposer.cache.stats
    assert stats.num_drafts > 0 and stats.num_accepted < stats.num_drafts
    assert_no_draft_blocks_held(llm)


def test_stop_strings_end_speculative_output_where_they_end_plain_output(llama_path,
                                                                           small_draft):
    prompts = ["def add(a, b):", "The quick brown fox", "Once upon a time"]
    plain = LLM(llama_path).generate(prompts, SamplingParams(temperature=0, max_tokens=30),
                                     use_tqdm=False)
    # A stop string from the middle of each plain continuation.
    stops = [o.outputs[0].text[8:11] for o in plain]
    params = [SamplingParams(temperature=0, max_tokens=30, stop=[s]) for s in stops]
    baseline = LLM(llama_path).generate(prompts, params, use_tqdm=False)
    llm = speculative(llama_path, small_draft, k=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in baseline]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_no_draft_blocks_held(llm)


def test_draft_cache_shortage_costs_drafts_not_exactness(llama_path, small_draft,
                                                         monkeypatch):
    """A draft cache of 20 blocks (one 64-token request needs 16): requests not drafted for
    are evicted and some requests go without drafts; the output does not change."""
    from hitchllm_specdec import draft_model

    llm_args = dict(block_size=4, max_model_len=64)
    prompts = mixed_prompts(5, lengths=(30, 17, 25, 9, 12, 20))
    baseline = run(LLM(llama_path, **llm_args), prompts)
    # Bytes of one block of the small draft: K and V, 1 layer, 1 KV head of 16, 4 tokens.
    monkeypatch.setattr(draft_model, "DRAFT_KV_CACHE_CPU_BYTES", 20 * 2 * 16 * 4 * 4)
    llm = speculative(llama_path, small_draft, k=3, **llm_args)
    assert llm.engine.proposer.cache.num_blocks == 20
    assert run(llm, prompts) == baseline
    assert llm.engine.proposer.cache.stats.num_drafts > 0
    assert_no_draft_blocks_held(llm)


def test_draft_with_padded_vocabulary_is_accepted(llama_path, tmp_path):
    """Same tokenizer, embedding padded to 520 rows: allowed, logits cut to the target's."""
    draft = str(build_tiny_checkpoint(tmp_path / "padded", "LlamaForCausalLM", seed=3,
                                      vocab_size=520, num_hidden_layers=1))
    prompts = mixed_prompts(6, lengths=(5, 12))
    baseline = run(LLM(llama_path), prompts)
    llm = speculative(llama_path, draft, k=2)
    assert run(llm, prompts) == baseline
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=1)
    assert len(llm.generate(["x"], sampled, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.fixture(scope="module")
def bundled_half(tmp_path_factory) -> str:
    """The bundled model's first 4 of 8 layers: a smaller draft that often agrees with it."""
    return str(write_truncated_checkpoint(default_model_path(),
                                          tmp_path_factory.mktemp("draft") / "half", 4))


def test_truncated_draft_keeps_the_first_layers(bundled_half):
    from hitchllm.config import ModelConfig
    from hitchllm.models.loader import iterate_weights

    config = ModelConfig.from_pretrained(bundled_half)
    assert config.num_hidden_layers == 4 and config.vocab_size == 4096
    names = {name for name, _ in iterate_weights(Path(bundled_half))}
    assert "model.layers.3.mlp.down_proj.weight" in names
    assert not any(".layers.4." in n for n in names) and "model.norm.weight" in names


def test_sampled_output_follows_the_target_distribution(bundled_half):
    """Temperature 1, top-k 3: the first two emitted tokens (the second verified against
    the half-depth draft's sampled draft and its probs) follow transformers' float64 joint
    distribution within a chi-square bound, and the draft is accepted at the rate
    sum_x min(p(x), q(x)) computed from both models."""
    from reference import hf_model
    from test_rejection_sampler import assert_distribution

    target = default_model_path()
    temperature, top_k, n = 1.0, 3, 2000
    prompt = LLM(target).get_tokenizer()("    return ").input_ids
    target_hf, draft_hf = hf_model(target), hf_model(bundled_half)

    def dist(model, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double() / temperature
        kth = logits.topk(top_k).values[-1]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    p0 = dist(target_hf, prompt)
    firsts = p0.nonzero().flatten().tolist()
    seconds = {t: dist(target_hf, [*prompt, t]) for t in firsts}
    rate = sum(float(p0[t] * torch.minimum(seconds[t], dist(draft_hf, [*prompt, t])).sum())
               for t in firsts)
    assert 0.2 < rate < 0.8, rate  # the test sees both accepted and rejected drafts

    llm = speculative(target, bundled_half, k=2, max_num_seqs=512)
    drafted = record_drafts(llm)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    index = {t: i for i, t in enumerate(firsts)}
    counts = torch.zeros(len(firsts), p0.shape[0])
    accepted = 0
    for o in outs:
        t0, t1 = o.outputs[0].token_ids[:2]
        counts[index[t0], t1] += 1
        # max_tokens=3 leaves room for exactly one draft after the first token.
        [draft] = drafted[o.request_id][0]
        accepted += draft == t1
    joint = torch.stack([p0[t] * seconds[t] for t in firsts])
    assert_distribution(counts, joint)
    assert abs(accepted / n - rate) < 5 * math.sqrt(rate * (1 - rate) / n)
    assert_no_draft_blocks_held(llm)


def test_self_drafting_sampled_drafts_with_probs_are_accepted(llama_path):
    """q = p when the target drafts for itself: with the probs given, acceptance is
    sum_x min(p, q) = 1; as point masses it would be sum_x p(x)^2 (far lower here)."""
    llm = speculative(llama_path, llama_path, k=3)
    drafted = record_drafts(llm)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=4)
    outs = llm.generate(["a", "hello world", "def f(x):"], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert drafted
    stats = llm.engine.proposer.cache.stats
    assert stats.num_drafts >= 20 and stats.acceptance_rate > 0.9, stats
    # Seeded: the drafts, hence the output, repeat.
    again = llm.generate(["a", "hello world", "def f(x):"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_greedy_and_sampled_requests_mix_in_one_batch(llama_path, small_draft):
    """Greedy requests next to sampled ones (top-k, top-p, min-p, seeds): the greedy ones
    keep their non-speculative tokens; only the sampled ones get draft probs."""
    prompts = mixed_prompts(7, lengths=(4, 19, 11))
    baseline = run(LLM(llama_path), prompts)
    llm = speculative(llama_path, small_draft, k=3)
    drafted = record_drafts(llm)
    sampled = [SamplingParams(temperature=0.9, top_k=40, max_tokens=16, seed=1),
               SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, max_tokens=16),
               SamplingParams(temperature=0.7, max_tokens=16, seed=2)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(requests * 2, [greedy()] * len(prompts) + sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[: len(prompts)]] == baseline
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs[len(prompts):])
    assert len(drafted) == 2 * len(prompts)
    assert_no_draft_blocks_held(llm)


def test_vocabulary_mismatch_is_refused_at_start_up(llama_path, tmp_path):
    bundled = default_model_path()
    with pytest.raises(ValueError, match=r"different vocabulary.*4096.*512|512.*4096"):
        speculative(bundled, llama_path)
    # Same size, but two tokens swap ids.
    draft = build_tiny_checkpoint(tmp_path / "swapped", "LlamaForCausalLM", num_hidden_layers=1)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "Ġthe", "Ġa"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"swapped.*2 of the target's tokens have another id"):
        speculative(llama_path, str(draft))
    # No tokenizer: the config vocab sizes decide.
    bare = build_tiny_checkpoint(tmp_path / "bare", "LlamaForCausalLM", vocab_size=600,
                                 num_hidden_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="vocab_size 600 but the target .* has 512"):
        speculative(llama_path, str(bare))


def test_bad_draft_model_settings_are_explained(llama_path, tmp_path):
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM(llama_path, speculative_method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        speculative(llama_path, str(tmp_path))
    short = build_tiny_checkpoint(tmp_path / "short", "LlamaForCausalLM",
                                  max_position_embeddings=64, num_hidden_layers=1)
    with pytest.raises(ValueError, match="lower max_model_len to at most 64"):
        speculative(llama_path, str(short))


def test_no_draft_blocks_leak_after_finish_or_abort(llama_path, small_draft):
    """Finished requests free their draft blocks as they finish; aborted ones too, also
    mid-generation; a reused request id starts from a clean draft cache."""
    llm = speculative(llama_path, small_draft, k=3, block_size=4)
    engine = llm.engine
    prompts = mixed_prompts(8, lengths=(20, 7, 33, 12))
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, greedy(12), request_id=f"r{i}")
    for _ in range(3):
        engine.step()
    cache = engine.proposer.cache
    assert cache.num_free_blocks < cache.num_blocks
    engine.abort_request(["r0", "r2"])
    assert {"r0", "r2"}.isdisjoint(cache.states)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_draft_blocks_held(llm)
    # The id r1 again, with another prompt: its output is that prompt's.
    baseline = run(LLM(llama_path, block_size=4), [prompts[3]], max_tokens=12)
    engine.add_request({"prompt_token_ids": prompts[3]}, greedy(12), request_id="r1")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert_no_draft_blocks_held(llm)


@pytest.mark.gpu
def test_gpu_draft_steps_replay_cuda_graphs(bundled_half):
    """On CUDA (TRITON_ATTN, bfloat16) the draft steps replay captured graphs; the bundled
    model drafting for itself or with its half-depth draft generates what it generates
    without speculation, and self-drafting is accepted.

    In bfloat16 a verification step (several query tokens per request) and a decode step run
    different kernels, so a near-tie between the target's two best tokens may break either
    way: the outputs must agree up to a first difference, and there the two tokens must be
    a near-tie of the non-speculative run (log-probabilities within 0.05)."""
    path = default_model_path()
    gpu = dict(device="cuda", attention_backend="TRITON_ATTN", gpu_memory_utilization=0.3)
    prompts = ["def add(a, b):\n", "import os\nimport sys\n", "class Engine:\n    def step",
               "for i in range(10):\n"]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)

    def generate(llm: LLM) -> list:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    base = generate(LLM(path, **gpu))
    for draft in (path, bundled_half):
        llm = speculative(path, draft, k=4, **gpu)
        assert llm.engine.proposer.runner.graphs.captured
        for want, got in zip(base, generate(llm), strict=True):
            same = [a == b for a, b in zip(want.token_ids, got.token_ids, strict=True)]
            if all(same):
                continue
            i = same.index(False)
            top = want.logprobs[i]
            assert got.token_ids[i] in top, (i, want.token_ids, got.token_ids)
            gap = top[want.token_ids[i]].logprob - top[got.token_ids[i]].logprob
            assert gap < 0.05, (i, gap, want.token_ids, got.token_ids)
        if draft == path:
            assert llm.engine.proposer.cache.stats.acceptance_rate > 0.9
        assert_no_draft_blocks_held(llm)


@pytest.mark.gpu
def test_gpu_draft_chain_equals_step_by_step_drafting():
    """A greedy proposal runs as one graph (the draft chain); its drafts are the ones the
    step-by-step draft forwards make (same kernels, so the same bits), and the output is
    the non-speculative one."""
    path = default_model_path()
    gpu = dict(device="cuda", attention_backend="TRITON_ATTN", gpu_memory_utilization=0.3)
    prompts = ["def add(a, b):\n", "import os\nimport sys\n", "class Engine:\n    def step"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def drafts_and_output(chain: bool) -> tuple[list, list]:
        gc.collect()  # engines of earlier tests hold GPU memory until collected
        torch.cuda.empty_cache()
        llm = speculative(path, path, k=4, **gpu)
        proposer = llm.engine.proposer
        assert proposer.runner.chains.captured
        chains = []
        if chain:
            run_chain = proposer.runner.run_chain
            proposer.runner.run_chain = lambda *a: chains.append(a[0]) or run_chain(*a)
        else:
            proposer.runner.chain_size = lambda n: None
        proposals = []
        propose = proposer.propose
        proposer.propose = lambda batch: proposals.append(propose(batch)) or proposals[-1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert bool(chains) == chain
        assert_no_draft_blocks_held(llm)
        return ([{rid: d.token_ids for rid, d in p.drafts.items()} for p in proposals],
                [o.outputs[0].token_ids for o in outs])

    chained, out_chained = drafts_and_output(True)
    stepped, out_stepped = drafts_and_output(False)
    assert chained == stepped
    assert out_chained == out_stepped


@pytest.mark.gpu
def test_gpu_verification_steps_replay_graphs_exactly(bundled_half):
    """Verification steps (every request its newest token plus K drafts) replay graphs
    captured per query length; the output equals the same engine's without graphs."""
    path = default_model_path()
    gpu = dict(device="cuda", attention_backend="TRITON_ATTN", gpu_memory_utilization=0.3)
    prompts = ["def add(a, b):\n", "import os\nimport sys\n", "class Engine:\n    def step",
               "for i in range(10):\n", "x = [", "return"]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True,
                                seed=7 if temperature else None)
        outs = []
        for eager in (True, False):
            llm = speculative(path, bundled_half, k=3, enforce_eager=eager, **gpu)
            replays = []
            graphs = llm.engine.executor.runner.graphs
            replay = graphs.replay
            graphs.replay = (lambda size, q=1, seen=replays, replay=replay:
                             seen.append(q) or replay(size, q))
            outs.append([o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)])
            assert (4 in replays) != eager
        assert outs[0] == outs[1]


def test_deepened_checkpoint_computes_the_same_function(tmp_path):
    """The benchmark's costlier twin of the bundled model (added layers with zero output and
    down projections) generates exactly what the bundled model generates, and a speculative
    engine drafting for it with the bundled model accepts every greedy draft."""
    from hitchllm_specdec.draft_checkpoint import write_deepened_checkpoint

    path = default_model_path()
    deep = write_deepened_checkpoint(path, tmp_path / "deep", 11)
    assert json.loads((deep / "config.json").read_text())["num_hidden_layers"] == 11
    prompts = ["def add(a, b):\n", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    llm = speculative(str(deep), path, k=3)
    assert [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)] == base
    assert llm.engine.proposer.cache.stats.acceptance_rate == 1.0
    with pytest.raises(ValueError, match="below the checkpoint's 8 layers"):
        write_deepened_checkpoint(path, tmp_path / "shallow", 4)
