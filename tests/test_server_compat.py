"""vLLM-compatible extras of the server, as lm-eval and vLLM clients use them: ``echo`` with
logprobs, ``prompt_logprobs``, ``truncate_prompt_tokens``, ``GET /v1/models/{id}``,
``/tokenize`` and ``/detokenize``; and lm-evaluation-harness's ``local-completions`` model run
against the bundled model. Reference: the offline ``LLM`` on the same checkpoint."""

from __future__ import annotations

import importlib.util
import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from server_process import running_server

from hitchllm import LLM, SamplingParams, default_model_path

MODEL = "bundled"
MAX_MODEL_LEN = 256
# Module-scoped engines start before conftest's per-test forcing of the reference backend.
BACKEND = "TORCH"


@pytest.fixture(scope="module")
def server():
    args = ["--model", default_model_path(), "--served-model-name", MODEL,
            "--max-model-len", str(MAX_MODEL_LEN), "--attention-backend", BACKEND]
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(default_model_path(), max_model_len=MAX_MODEL_LEN, attention_backend=BACKEND)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST JSON; the status and the decoded JSON body, errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def prompt_logprob_values(out) -> list[float | None]:
    """The logprob of each prompt token itself (None for the first) from an offline output."""
    return [None if e is None else e[t].logprob
            for t, e in zip(out.prompt_token_ids, out.prompt_logprobs)]


def approx_with_none(values: list[float | None]) -> list[Any]:
    return [v if v is None else pytest.approx(v, abs=1e-5) for v in values]


# ---- echo --------------------------------------------------------------------------------

def test_echo_without_generation_returns_the_scored_prompt(client, offline):
    prompt = "def add(a, b):\n    return a + b"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0)
    ref = offline.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.text == prompt
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    tokenizer = offline.get_tokenizer()
    assert lp.tokens == [tokenizer.decode([t]) for t in ref.prompt_token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs == approx_with_none(prompt_logprob_values(ref))
    for top, entry in zip(lp.top_logprobs[1:], ref.prompt_logprobs[1:]):
        assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in entry.values()},
                                    abs=1e-5)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 0


def test_echo_with_generation_puts_the_prompt_first(client, offline):
    prompt = "class Stack:\n    def push(self, x):"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True,
                                     logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    ref = offline.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                  logprobs=2, prompt_logprobs=2),
                           use_tqdm=False)[0]
    seq = ref.outputs[0]
    choice = resp.choices[0]
    assert choice.text == prompt + seq.text
    expected = prompt_logprob_values(ref) + [e[t].logprob for t, e in
                                             zip(seq.token_ids, seq.logprobs)]
    assert choice.logprobs.token_logprobs == approx_with_none(expected)
    assert resp.usage.completion_tokens == 5

    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=2, temperature=0,
        stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == approx_with_none(expected)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo_of_token_id_prompts_batch_and_stream(client, offline):
    tokenizer = offline.get_tokenizer()
    prompts = [tokenizer("x = [1, 2, 3]").input_ids, tokenizer("import os").input_ids]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True,
                                     logprobs=0)
    refs = offline.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    by_index = sorted(resp.choices, key=lambda c: c.index)
    for choice, ids, ref in zip(by_index, prompts, refs):
        assert choice.text == tokenizer.decode(ids)
        assert choice.logprobs.token_logprobs == approx_with_none(prompt_logprob_values(ref))
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, echo=True, stream=True,
        stream_options={"include_usage": True}))
    texts = {c.choices[0].index: c.choices[0].text for c in chunks if c.choices}
    assert texts == {c.index: c.text for c in resp.choices}
    assert chunks[-1].usage.prompt_tokens == sum(map(len, prompts))
    assert chunks[-1].usage.completion_tokens == 0


def test_max_tokens_zero_without_echo_is_400(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


# ---- prompt_logprobs ---------------------------------------------------------------------

def check_vllm_prompt_logprobs(got: list[Any], ref) -> None:
    """vLLM's shape: None, then per prompt token ``{id: {logprob, rank, decoded_token}}``."""
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for entry, ref_entry in zip(got[1:], ref.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(ref_entry)
        for t, lp in entry.items():
            want = ref_entry[int(t)]
            assert lp["logprob"] == pytest.approx(want.logprob, abs=1e-5)
            assert lp["rank"] == want.rank and lp["decoded_token"] == want.decoded_token


def test_prompt_logprobs_on_completions(server, offline):
    prompt = "for i in range(10):"
    status, body = post(f"{server}/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3})
    assert status == 200
    ref = offline.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3),
                           use_tqdm=False)[0]
    check_vllm_prompt_logprobs(body["choices"][0]["prompt_logprobs"], ref)
    assert body["choices"][0]["logprobs"] is None


def test_prompt_logprobs_on_chat(server, offline):
    messages = [{"role": "user", "content": "Write a sort."}]
    status, body = post(f"{server}/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1})
    assert status == 200
    ref = offline.chat(messages, SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    check_vllm_prompt_logprobs(body["prompt_logprobs"], ref)


@pytest.mark.parametrize("route, extra", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_streamed_prompt_logprobs_are_400(server, route, extra):
    status, body = post(f"{server}{route}", {"model": MODEL, "stream": True,
                                             "prompt_logprobs": 1, **extra})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


# ---- truncate_prompt_tokens --------------------------------------------------------------

def test_truncate_prompt_tokens_on_the_server(client, offline):
    ids = offline.get_tokenizer()("def main():\n    print('hello world')").input_ids
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 5,
                                                 "ignore_eos": True})
    tail = client.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 5
    assert resp.choices[0].text == tail.choices[0].text
    for k, match in ((0, "truncate_prompt_tokens"), (MAX_MODEL_LEN + 1, "max_model_len")):
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": k})


# ---- models, tokenize, detokenize --------------------------------------------------------

def test_model_by_id(client, server):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError, match="org/missing"):
        client.models.retrieve("org/missing")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{server}/v1/models/nope", timeout=10)
    assert err.value.code == 404
    assert json.loads(err.value.read())["error"]["param"] == "model"


def test_tokenize_matches_the_tokenizer_and_the_chat_endpoint(server, client, offline):
    tokenizer = offline.get_tokenizer()
    text = "def f(x):\n    return x * 2"
    status, body = post(f"{server}/tokenize", {"model": MODEL, "prompt": text,
                                               "return_token_strs": True})
    ids = tokenizer(text).input_ids
    assert status == 200
    assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    status, body = post(f"{server}/tokenize", {"prompt": text, "add_special_tokens": False})
    assert body["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert body["token_strs"] is None

    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    status, body = post(f"{server}/tokenize", {"model": MODEL, "messages": messages})
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert status == 200
    assert body["tokens"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert body["count"] == chat.usage.prompt_tokens


def test_detokenize_round_trip_and_errors(server, offline):
    tokenizer = offline.get_tokenizer()
    ids = tokenizer("while True:\n    pass", add_special_tokens=False).input_ids
    assert post(f"{server}/detokenize", {"model": MODEL, "tokens": ids}) == (
        200, {"prompt": "while True:\n    pass"})
    for bad in ([len(tokenizer)], [-1]):
        status, body = post(f"{server}/detokenize", {"tokens": [5, *bad]})
        assert status == 400 and "outside the tokenizer's vocabulary" in body["error"]["message"]
    status, body = post(f"{server}/detokenize", {"model": "nope", "tokens": [5]})
    assert status == 404
    status, body = post(f"{server}/tokenize", {"model": MODEL})
    assert status == 400 and body["error"]["param"] == "prompt"


# ---- lm-evaluation-harness ---------------------------------------------------------------

# Multiple-choice questions about Python that the bundled code model can score. Each context
# ends where this tokenizer splits it the same way with every choice appended (lm-eval scores
# the choice's tokens of context + choice past the context's own tokens). The last two golds
# are deliberately not the model's pick, so the accuracy is neither 0 nor 1.
MC_DOCS = [
    ("for i in range(10", ["):", "]:", "}:"], 0),
    ("if __name__ == '__main__", ["':", "\":", "'"], 0),
    ("class Stack:\n    def __init__(self", ["):", ", x):", ")"], 0),
    ("print(\"hello", ["\")", "')", ")"], 0),
    ("x = [1, 2, 3", ["]", ")", "}"], 0),
    ("d = {'a': 1", ["}", "]", ")"], 0),
    ("def pop(self):\n        return self.items[-1", ["]", ")", "}"], 0),
    ("try:\n    import numpy as np\nexcept ImportError", [":", ";", ")"], 0),
    ("def area(r):\n    return 3.14 * r * r", ["\n", ")", "]"], 0),
    ("with open(path) as f", [":", ";", "]"], 0),
    ("lambda x", [":", ";", ")"], 1),
    ("if x == 1", [":", ";", "]"], 2),
]

TASK_YAML = """\
task: hitch_python_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def offline_loglikelihoods(offline: LLM, context: str,
                           choices: list[str]) -> list[tuple[float, bool]]:
    """lm-eval's ``(loglikelihood, is_greedy)`` of each choice, with the tokens as it defines
    them (no special tokens): the context's own tokens, then those of context + choice past
    the context's length; the score is the sum of the latter's logprobs, greedy when each of
    them is the most likely token."""
    tokenizer = offline.get_tokenizer()
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    conts = [tokenizer(context + c, add_special_tokens=False).input_ids[len(ctx):]
             for c in choices]
    outs = offline.generate([{"prompt_token_ids": ctx + c} for c in conts],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    scores = []
    for out in outs:
        scored = [e[t] for t, e in zip(out.prompt_token_ids[len(ctx):],
                                       out.prompt_logprobs[len(ctx):])]
        scores.append((sum(lp.logprob for lp in scored), all(lp.rank == 1 for lp in scored)))
    return scores


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                    reason="lm-evaluation-harness is not installed (pip install lm-eval)")
def test_lm_eval_local_completions_accuracy_matches_offline(server, offline, tmp_path,
                                                            monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": ch, "label": y}) + "\n"
                            for c, ch, y in MC_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "hitch_python_mc.yaml").write_text(
        TASK_YAML.format(data=data, cache=tmp_path / "hf-datasets"))

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{server}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": default_model_path(),
                    "tokenized_requests": True, "batch_size": 4, "max_length": MAX_MODEL_LEN,
                    "max_retries": 1},
        tasks=["hitch_python_mc"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
    )
    samples = sorted(results["samples"]["hitch_python_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_DOCS)
    correct = 0
    for sample, (context, choices, label) in zip(samples, MC_DOCS):
        expected = offline_loglikelihoods(offline, context, choices)
        got = sample["filtered_resps"]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=1e-4)
        assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
        correct += max(range(len(choices)), key=lambda c: expected[c][0]) == label
    accuracy = results["results"]["hitch_python_mc"]["acc,none"]
    assert accuracy == correct / len(MC_DOCS)
    assert 0 < accuracy < 1
