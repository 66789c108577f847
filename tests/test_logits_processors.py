"""logit_bias, allowed_token_ids and bad_words through the core's logits-processor seam,
checked against float64 references built from the model's raw logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fake_dists import install_fake_plugin
from server_process import running_server
from test_speculative import PROPOSERS

from hitchllm import LLM, SamplingParams
from hitchllm.engine.logits_processors import banned_next_tokens

try:
    import openai
except ImportError:  # the GPU machine has no server stack; the server tests skip there
    openai = None
needs_server_stack = pytest.mark.skipif(openai is None, reason="needs the openai client")

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, block_size=4, max_model_len=256)


def raw_steps(out, vocab_size: int) -> list[np.ndarray]:
    """Per output token, the model's raw logprobs over the whole vocabulary, in float64."""
    steps = []
    for entry in out.logprobs:
        row = np.full(vocab_size, -np.inf)
        for token_id, lp in entry.items():
            row[token_id] = lp.logprob
        steps.append(row)
    return steps


def assert_greedy_under(out, vocab_size: int, adjust) -> None:
    """Every greedy token is the argmax of ``adjust(step, raw logprobs)`` (ties allowed)."""
    for step, (token, raw) in enumerate(zip(out.token_ids, raw_steps(out, vocab_size))):
        adjusted = adjust(step, raw)
        assert adjusted[token] == adjusted.max(), f"step {step}: {token} is not the argmax"


def full_logprobs(vocab_size: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=vocab_size,
                          **kwargs)


def test_logit_bias_moves_the_greedy_argmax_exactly(llm):
    vocab = llm.engine.vocab_size
    plain = llm.generate([PROMPT], full_logprobs(vocab), use_tqdm=False)[0].outputs[0]
    # Ban the first greedy token and favour a few others by amounts comparable to the logits.
    bias = {plain.token_ids[0]: -100.0, 7: 3.0, 42: 2.5, 300: 1.5}
    out = llm.generate([PROMPT], full_logprobs(vocab, logit_bias=bias),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != plain.token_ids[0]
    delta = np.zeros(vocab)
    for t, b in bias.items():
        delta[t] = b
    assert_greedy_under(out, vocab, lambda _, raw: raw + delta)
    # Reported logprobs stay the model's own, unbiased distribution.
    assert math.isclose(sum(math.exp(v.logprob) for v in out.logprobs[0].values()), 1.0,
                        rel_tol=1e-4)


def test_logit_bias_sampling_frequency_matches_float64_reference(llm):
    vocab = llm.engine.vocab_size
    first = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=vocab),
                         use_tqdm=False)[0].outputs[0]
    raw = raw_steps(first, vocab)[0]
    ranked = np.argsort(-raw)
    banned, boosted, nudged = int(ranked[0]), int(ranked[vocab // 2]), int(ranked[vocab // 3])
    bias = {banned: -100.0, boosted: 6.0, nudged: 4.0}
    logits = raw.copy()
    for t, b in bias.items():
        logits[t] += b
    expected = np.exp(logits - logits.max())
    expected /= expected.sum()

    num = 300
    out = llm.generate([PROMPT], SamplingParams(n=num, temperature=1.0, max_tokens=1,
                                                logit_bias=bias), use_tqdm=False)[0]
    tokens = [seq.token_ids[0] for seq in out.outputs]
    for token in (boosted, nudged):
        freq = tokens.count(token) / num
        sigma = math.sqrt(expected[token] * (1 - expected[token]) / num)
        assert abs(freq - expected[token]) < 5 * sigma, (token, freq, expected[token])
    assert expected[banned] < 1e-9 and banned not in tokens


def test_allowed_token_ids_restrict_sampling_and_greedy(llm):
    vocab = llm.engine.vocab_size
    allowed = [11, 12, 13, 200, 201, 350]
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True,
                             allowed_token_ids=allowed) for s in range(8)]
    for out in llm.generate([PROMPT] * 8, params, use_tqdm=False):
        assert set(out.outputs[0].token_ids) <= set(allowed)
    out = llm.generate([PROMPT], full_logprobs(vocab, allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0]
    outside = np.ones(vocab, dtype=bool)
    outside[allowed] = False
    assert_greedy_under(out, vocab, lambda _, raw: np.where(outside, -np.inf, raw))


def reference_bad_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    return [tokenizer.encode(prefix + w.strip(), add_special_tokens=False)
            for w in words for prefix in ("", " ")]


def test_bad_words_never_complete_and_greedy_is_otherwise_unchanged(llm):
    tok = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    plain = llm.generate([PROMPT], full_logprobs(vocab), use_tqdm=False)[0].outputs[0]
    ids = plain.token_ids

    def occurs(seq: list[int]) -> bool:
        return any(ids[i:i + len(seq)] == seq for i in range(len(ids)))

    # A stretch of the plain output that tokenizes back to two or more of its tokens, and
    # the plain output's first token.
    stretches = [tok.decode(ids[i:i + k]) for k in (2, 3) for i in range(len(ids) - k + 1)]
    words = [w for w in stretches if w.strip() and any(
        len(s) > 1 and occurs(s) for s in reference_bad_sequences(tok, [w]))][:1]
    assert words, "the plain output has no multi-token word to ban"
    words.append(tok.decode(ids[:1]).strip() or "x")
    sequences = reference_bad_sequences(tok, words)
    out = llm.generate([PROMPT], full_logprobs(vocab, bad_words=words),
                       use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    for seq in sequences:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), seq

    def ban(step: int, raw: np.ndarray) -> np.ndarray:
        raw = raw.copy()
        before = ids[:step]
        for seq in sequences:
            if len(seq) == 1 or before[len(before) - len(seq) + 1:] == seq[:-1]:
                raw[seq[-1]] = -np.inf
        return raw

    assert_greedy_under(out, vocab, ban)
    assert out.token_ids != plain.token_ids


def test_banned_next_tokens_matches_a_naive_scan():
    rng = np.random.default_rng(0)
    for _ in range(300):
        sequences = [tuple(rng.integers(0, 4, rng.integers(1, 4)).tolist()) for _ in range(3)]
        output = rng.integers(0, 4, rng.integers(0, 6)).tolist()
        expected = {s[-1] for s in sequences
                    if len(output) >= len(s) - 1
                    and output[len(output) - (len(s) - 1):] == list(s[:-1])}
        assert set(banned_next_tokens(sequences, output)) == expected


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["ok", " "]}, "bad_words"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_rejected(llm):
    vocab = llm.engine.vocab_size
    for kwargs in ({"logit_bias": {vocab: 1.0}}, {"allowed_token_ids": [1, vocab + 5]}):
        field = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"{field}.*outside the model's vocabulary"):
            llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    assert len(llm.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_processors_apply_to_every_speculative_row(llama_path, tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-fake-specdec", "0.1",
                        "fake_specdec_plugin", PROPOSERS)
    llm = LLM(llama_path, block_size=4)
    tok = llm.get_tokenizer()
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16,
                                                  ignore_eos=True), use_tqdm=False)[0]
    word = tok.decode(plain.outputs[0].token_ids[1:3])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word],
                            logit_bias={plain.outputs[0].token_ids[5]: -100.0})
    expected = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    # "repeat" drafts the last token again: some drafts are accepted, some rejected.
    spec = LLM(llama_path, block_size=4, speculative_method="repeat", num_speculative_tokens=3)
    assert spec.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == expected


@needs_server_stack
def test_server_takes_openai_logit_bias_and_vllm_extra_fields(llama_path, llm):
    args = ["--model", llama_path, "--served-model-name", "tiny", "--block-size", "4",
            "--max-model-len", "256"]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    allowed = [11, 12, 13]
    with running_server(args) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def complete(**kwargs):
            return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                             temperature=0, **kwargs).choices[0]

        # OpenAI sends logit_bias keys as strings.
        biased = complete(logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
        expected = llm.generate([PROMPT], SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logit_bias={first: -100}),
            use_tqdm=False)[0].outputs[0]
        assert biased.text == expected.text
        restricted = complete(extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                          "bad_words": ["def"]})
        assert set(llm.get_tokenizer().encode(restricted.text)) <= set(allowed)
        for body in ({"logit_bias": {"x": 1}}, {"logit_bias": {"5": 300}},
                     {"extra_body": {"allowed_token_ids": [10**9]}}):
            with pytest.raises(openai.BadRequestError):
                complete(**body)


RECORDER = """
import torch
from hitchllm import hookimpl
from hitchllm.logits_processor import LogitsProcessor, host_to_device


TRIGGER_SEED = 12345
CALLS = []      # (request_id, row index, output so far, num_draft_tokens) per prepared row
REMOVED = []


class Recorder(LogitsProcessor):
    '''Used by requests with seed TRIGGER_SEED; forbids token 7 and records what it saw.'''

    def is_used_by(self, params):
        return params.seed == TRIGGER_SEED

    def remove_requests(self, request_ids):
        REMOVED.extend(request_ids)

    def prepare(self, rows, vocab_size, device):
        CALLS.extend((r.request_id, r.index, list(r.output_token_ids), r.num_draft_tokens)
                     for r in rows)
        index = host_to_device(torch.tensor([r.index for r in rows]), device)
        return lambda logits: logits.index_fill(0, index, 0.0).index_put(
            (index, torch.full_like(index, 7)), torch.tensor(float("-inf")))


@hookimpl
def hitchllm_logits_processors():
    return [Recorder()]
"""


def test_a_plugin_processor_sees_exactly_its_rows(llama_path, tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-fake-recorder", "0.1",
                        "fake_recorder_plugin", RECORDER)
    import fake_recorder_plugin as rec

    llm = LLM(llama_path, block_size=4)
    plain = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    llm.generate([PROMPT] * 3, plain, use_tqdm=False)
    assert rec.CALLS == [], "a processor no request uses must not be called"

    used = SamplingParams(temperature=1.0, seed=rec.TRIGGER_SEED, max_tokens=8,
                          ignore_eos=True)
    outs = llm.generate([PROMPT, "x"], [plain, used], use_tqdm=False)
    mine = outs[1]
    # The edit zeroes the row's logits and forbids token 7: a uniform draw over the rest.
    assert 7 not in mine.outputs[0].token_ids
    assert {c[0] for c in rec.CALLS} == {mine.request_id}
    seen = [c[2] for c in rec.CALLS]
    assert seen == [mine.outputs[0].token_ids[:i] for i in range(8)]
    assert all(c[3] == 0 for c in rec.CALLS)
    assert {c[1] for c in rec.CALLS} == {1}, "row 1: the second request of each step"
    llm.generate([PROMPT], plain, use_tqdm=False)  # the next step releases finished requests
    assert mine.request_id in rec.REMOVED
