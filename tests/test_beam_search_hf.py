"""Beam search equals Hugging Face transformers' ``generate(num_beams=k, do_sample=False)``:
the same sequences, best first, and the same ``sequences_scores``, for tiny random Llama and
Qwen3 checkpoints in fp32, under chunked prefill (8-token steps, 4-token blocks, so beams fork
inside partial blocks and copy-on-write runs) with the prefix cache on.

The checkpoints' EOS (token 0) gets the output row of a token the model does generate (plus
noise), so sequences really end with EOS."""

from __future__ import annotations

import collections
import random

import pytest
import torch
import transformers

from hitchllm import LLM, BeamSearchParams
from hitchllm.tiny_model import build_tiny_checkpoint

EOS = 0
MAX_NEW = 12
ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def _prompts(seed: int, lengths=(5, 11, 17)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


PROMPTS = _prompts(0)


def hf_beam_search(model, prompt: list[int], k: int, eos: int | None,
                   length_penalty: float = 1.0, early_stopping=False):
    """(sequences, scores) of ``generate``, best first; the generated tokens only. Width 1
    is Hugging Face's greedy search, scored here as beam search scores it."""
    cfg = transformers.GenerationConfig(
        num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=MAX_NEW,
        length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
        pad_token_id=EOS, bos_token_id=None, output_scores=True, output_logits=True,
        return_dict_in_generate=True)
    ids = torch.tensor([prompt])
    # generate() falls back to the checkpoint's EOS for an unset one: unset it there too.
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    finally:
        model.generation_config.eos_token_id = saved
    if k == 1:
        generated = out.sequences[0, len(prompt):].tolist()
        if eos in generated:
            generated = generated[: generated.index(eos) + 1]
        cum = sum(torch.log_softmax(step[0].float(), -1)[t].item()
                  for step, t in zip(out.logits, generated))
        return [generated], [cum / len(generated) ** length_penalty]
    lengths = (out.beam_indices >= 0).sum(1).tolist()
    seqs = [out.sequences[i, len(prompt): len(prompt) + n].tolist()
            for i, n in enumerate(lengths)]
    return seqs, out.sequences_scores.tolist()


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, tmp_path_factory):
    """(HF model, LLM) for a checkpoint whose EOS is a likely token."""
    arch = request.param
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("beam") / arch, arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = collections.Counter()
    for prompt in PROMPTS:
        for seq in hf_beam_search(model, prompt, 4, None)[0]:
            counts.update(seq[:4])
    likely = counts.most_common(1)[0][0]
    noise = torch.randn(model.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.lm_head.weight[likely] + 0.01 * noise
    model.save_pretrained(path)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True,
              max_num_seqs=16, num_kv_blocks=256)
    assert llm.engine.eos_token_ids == (EOS,)
    return model, llm


def _count_block_copies(llm: LLM) -> list[int]:
    """A list whose sum grows by the copy-on-write block copies of every later step."""
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    copies: list[int] = []

    def counting():
        plan = schedule()
        copies.append(len(plan.block_copies))
        return plan

    scheduler.schedule = counting
    return copies


def _assert_same(ours, hf_seqs, hf_scores):
    assert [s.output_token_ids for s in ours.sequences] == hf_seqs
    assert [s.score for s in ours.sequences] == pytest.approx(hf_scores, rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("with_eos", [True, False], ids=["eos", "ignore_eos"])
def test_matches_transformers(arch_setup, width, with_eos):
    model, llm = arch_setup
    copies = _count_block_copies(llm)
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_NEW, ignore_eos=not with_eos)
    # All prompts in one call: searches run side by side (2 at once at width 8).
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    ended_with_eos = 0
    for prompt, out in zip(PROMPTS, outs):
        seqs, scores = hf_beam_search(model, prompt, width, EOS if with_eos else None)
        _assert_same(out, seqs, scores)
        assert out.prompt_token_ids == prompt
        assert len(out.sequences) == width
        for s in out.sequences:
            assert s.tokens == prompt + s.output_token_ids
            assert s.score == pytest.approx(
                s.cum_logprob / len(s.output_token_ids) ** params.length_penalty)
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] == EOS and with_eos
                                       else "length")
        ended_with_eos += sum(s.output_token_ids[-1] == EOS for s in out.sequences)
    if with_eos:
        assert ended_with_eos > 0  # the EOS case is not vacuous
    if width > 1:
        assert sum(copies) > 0  # beams diverged inside shared blocks
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks  # every beam gave its blocks back


@pytest.mark.parametrize("length_penalty,early_stopping",
                         [(0.5, False), (2.0, True), (-1.0, "never"), (1.5, "never")])
def test_length_penalty_and_early_stopping_match_transformers(arch_setup, length_penalty,
                                                              early_stopping):
    model, llm = arch_setup
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        _assert_same(out, *hf_beam_search(model, prompt, 4, EOS, length_penalty,
                                          early_stopping))


def test_prefix_cache_hits_and_cache_off_give_the_same_beams(arch_setup, tmp_path):
    model, llm = arch_setup
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    first = llm.beam_search(prompts, params)
    hits = llm.engine.kv_cache.prefix_cache_hits
    again = llm.beam_search(prompts, params)
    assert llm.engine.kv_cache.prefix_cache_hits > hits  # the prompts' blocks were reused
    _assert_same_beams(again, first)
    uncached = LLM(model.name_or_path, block_size=4, max_num_batched_tokens=8,
                   enable_prefix_caching=False, max_num_seqs=16, num_kv_blocks=256)
    _assert_same_beams(uncached.beam_search(prompts, params), first)


def _assert_same_beams(outs, expected):
    """Same sequences; scores equal up to float noise (prefix hits change the chunking)."""
    for out, exp in zip(outs, expected, strict=True):
        assert [s.tokens for s in out.sequences] == [s.tokens for s in exp.sequences]
        assert [s.score for s in out.sequences] == pytest.approx(
            [s.score for s in exp.sequences], rel=1e-5, abs=1e-5)


def test_text_prompts_and_text_output(arch_setup):
    _, llm = arch_setup
    tok = llm.get_tokenizer()
    [out] = llm.beam_search("def add(a, b):", BeamSearchParams(beam_width=2, max_tokens=4))
    assert out.prompt == "def add(a, b):"
    assert out.prompt_token_ids == tok("def add(a, b):").input_ids
    for s in out.sequences:
        assert s.text == tok.decode(s.output_token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("backend", ["CPU_ATTN"])
def test_other_cpu_backend_matches_transformers(arch_setup, backend):
    model, _ = arch_setup
    llm = LLM(model.name_or_path, attention_backend=backend, block_size=4,
              max_num_batched_tokens=8, max_num_seqs=16, num_kv_blocks=256)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=4, max_tokens=MAX_NEW))
    for prompt, out in zip(PROMPTS, outs):
        _assert_same(out, *hf_beam_search(model, prompt, 4, EOS))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "TORCH"])
def test_cuda_float32_matches_transformers(arch_setup, backend):
    """On the GPU: the block copies run on the device, decode steps replay CUDA graphs."""
    model, _ = arch_setup
    llm = LLM(model.name_or_path, device="cuda", dtype="float32", attention_backend=backend,
              block_size=16, max_num_batched_tokens=8, max_num_seqs=16)
    copies = _count_block_copies(llm)
    for width in (2, 8):
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                               BeamSearchParams(beam_width=width, max_tokens=MAX_NEW))
        for prompt, out in zip(PROMPTS, outs):
            _assert_same(out, *hf_beam_search(model, prompt, width, EOS))
    assert sum(copies) > 0
