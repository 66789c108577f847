"""Structured outputs (the plugin hitchllm-structured-output): a random model sampled at
temperature 1 is the fuzzer; every finished output must parse and match its constraint."""

from __future__ import annotations

import json
import re

import pytest
from fake_dists import install_fake_plugin
from server_process import running_server
from test_speculative import PROPOSERS

from hitchllm import LLM, SamplingParams, StructuredOutputsParams

try:
    import openai
except ImportError:  # the GPU machine has no server stack; the server tests skip there
    openai = None
needs_server_stack = pytest.mark.skipif(openai is None, reason="needs the openai client")

try:
    from importlib.metadata import entry_points
except ImportError:  # pragma: no cover
    from importlib_metadata import entry_points  # type: ignore[no-redef]

HAS_PLUGIN = any(ep.name == "structured_output"
                 for ep in entry_points(group="hitchllm.plugins"))
needs_plugin = pytest.mark.skipif(
    not HAS_PLUGIN, reason="needs the plugin: pip install -e plugins/structured_output "
                           "(it brings llguidance)")

SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "admin": {"type": "boolean"}},
     "required": ["name", "age", "admin"], "additionalProperties": False},
    {"type": "object",
     "properties": {"color": {"enum": ["red", "green", "blue"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                             "minItems": 1, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object",
     "properties": {"point": {"type": "object",
                              "properties": {"x": {"type": "integer", "minimum": -9,
                                                   "maximum": 9},
                                             "y": {"type": "integer", "minimum": -9,
                                                   "maximum": 9}},
                              "required": ["x", "y"], "additionalProperties": False},
                    "label": {"anyOf": [{"type": "null"}, {"const": "origin"}]}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "object",
     "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "ok": {"type": "boolean"},
                    "note": {"type": "string", "maxLength": 5}},
     "required": ["id", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 4},
]
SEEDS = range(4)
PROMPT = "Answer in JSON:"


def validate(instance, schema) -> None:
    """jsonschema's verdict when it is installed, else a check of the keywords used here."""
    try:
        import jsonschema
    except ImportError:
        _check_by_hand(instance, schema)
    else:
        jsonschema.validate(instance, schema)


def _check_by_hand(value, schema) -> None:
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                _check_by_hand(value, option)
                return
            except AssertionError as exc:
                errors.append(exc)
        raise AssertionError(errors)
    assert "const" not in schema or value == schema["const"]
    assert "enum" not in schema or value in schema["enum"]
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind is not None:
        assert isinstance(value, types[kind]), (value, kind)
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value))
        assert "pattern" not in schema or re.search(schema["pattern"], value)
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
        for item in value:
            _check_by_hand(item, schema["items"])
    if kind == "object":
        assert set(schema.get("required", [])) <= set(value)
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props)
        for key, item in value.items():
            if key in props:
                _check_by_hand(item, props[key])


def test_hand_check_agrees_with_jsonschema_on_bad_instances():
    bad = [({"name": "x", "age": 200, "admin": True}, SCHEMAS[0]),
           ({"color": "pink", "tags": ["a"]}, SCHEMAS[1]),
           ({"id": "ab-123", "ok": True}, SCHEMAS[3]),
           ([1], SCHEMAS[4])]
    for instance, schema in bad:
        with pytest.raises(AssertionError):
            _check_by_hand(instance, schema)


@pytest.fixture(scope="module")
def llm(llama_path):
    if not HAS_PLUGIN:
        pytest.skip("needs the plugin: pip install -e plugins/structured_output")
    return LLM(llama_path, block_size=4, max_model_len=256)


def sample(llm, spec: StructuredOutputsParams, seeds=SEEDS, max_tokens: int = 96,
           temperatures=(1.0,)):
    params = [SamplingParams(temperature=t, seed=s, max_tokens=max_tokens,
                             structured_outputs=spec) for t in temperatures for s in seeds]
    return [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]


@needs_plugin
@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_json_schema_outputs_parse_and_validate(llm, schema):
    for as_text in (False, True):
        spec = StructuredOutputsParams(json=json.dumps(schema) if as_text else schema)
        for out in sample(llm, spec):
            assert out.finish_reason == "stop", out.text
            validate(json.loads(out.text), schema)


@needs_plugin
def test_json_object_outputs_are_objects(llm):
    # A random model rarely closes an object it is free to grow: the hotter and colder draws
    # finish some (an empty object, and one with a key).
    outs = sample(llm, StructuredOutputsParams(json_object=True), seeds=range(8), max_tokens=64,
                  temperatures=(0.5, 3.0))
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 2, "fewer than two outputs finished within 64 tokens"
    for out in finished:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:  # unfinished ones are cut off, never off-grammar: they start an object
        assert out.text.startswith("{")


@needs_plugin
@pytest.mark.parametrize(("spec", "pattern"), [
    (StructuredOutputsParams(regex=r"[a-c]{2,5}x"), r"[a-c]{2,5}x"),
    (StructuredOutputsParams(regex=r"(cat|dog)s? [0-9]{1,3}"), r"(cat|dog)s? [0-9]{1,3}"),
    (StructuredOutputsParams(choice=["yes", "no", 'say "maybe"']), r'yes|no|say "maybe"'),
    (StructuredOutputsParams(grammar='root ::= "(" [0-9] [0-9]? ")" | "none"'),
     r"\([0-9][0-9]?\)|none"),
    (StructuredOutputsParams(grammar='start: "v" NUM ("." NUM)?\nNUM: /[0-9]/'),
     r"v[0-9](\.[0-9])?"),
])
def test_regex_choice_and_grammar_outputs_match(llm, spec, pattern):
    outs = sample(llm, spec, seeds=range(10), max_tokens=32)
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    assert len({o.text for o in outs}) > 1, "random sampling should vary within the grammar"


@needs_plugin
def test_greedy_structured_output_is_unchanged_by_drafts(llama_path, tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-fake-specdec", "0.1",
                        "fake_specdec_plugin", PROPOSERS)
    spec = StructuredOutputsParams(json=SCHEMAS[1])
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec)
    plain = LLM(llama_path, block_size=4).generate([PROMPT], params, use_tqdm=False)[0]
    # "repeat" drafts the last token again: inside a grammar most drafts are rejected by the
    # mask, some (repeated letters) accepted.
    spec_llm = LLM(llama_path, block_size=4, speculative_method="repeat",
                   num_speculative_tokens=3)
    drafted = spec_llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids
    validate(json.loads(drafted.outputs[0].text), SCHEMAS[1])


@needs_plugin
def test_preempted_requests_keep_their_grammar_state(llama_path):
    # 40 blocks of 4 tokens cannot hold 8 growing requests: some are preempted and recomputed.
    llm = LLM(llama_path, block_size=4, num_kv_blocks=40, max_model_len=80)
    spec = StructuredOutputsParams(json=SCHEMAS[0])
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=70, structured_outputs=spec)
              for s in range(8)]
    outs = llm.generate([PROMPT + " x" * 10] * 8, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        validate(json.loads(out.outputs[0].text), SCHEMAS[0])


@needs_plugin
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"structured_outputs": StructuredOutputsParams(regex="a(b")}, "regex is invalid"),
    ({"structured_outputs": StructuredOutputsParams(json="{not json")}, "not valid JSON"),
    ({"structured_outputs": StructuredOutputsParams(choice=["a"]), "ignore_eos": True},
     "ignore_eos"),
])
def test_bad_constraints_are_rejected_by_name(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    ok = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["a"]))
    assert llm.generate([PROMPT], ok, use_tqdm=False)[0].outputs[0].text == "a"


def test_structured_outputs_params_needs_exactly_one_field():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_without_the_plugin_the_error_says_what_to_install(llama_path, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "no_such_plugin")
    llm = LLM(llama_path, block_size=4, max_model_len=64)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="pip install hitchllm-structured-output"):
        llm.generate(["x"], params, use_tqdm=False)


def test_a_plugin_that_failed_to_load_is_named(llama_path, tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-structured-output", "0.0",
                        "broken_structured_output", "import no_such_grammar_library\n",
                        entry_point="structured_output_broken")
    monkeypatch.setenv("HITCHLLM_PLUGINS", "structured_output_broken")  # not the real one
    llm = LLM(llama_path, block_size=4, max_model_len=64)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="installed but failed to load"):
        llm.generate(["x"], params, use_tqdm=False)


# ---- the server, through the official openai client ----------------------------------------

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(llama_path):
    if openai is None:
        pytest.skip("needs the openai client")
    if not HAS_PLUGIN:
        pytest.skip("needs the plugin: pip install -e plugins/structured_output")
    args = ["--model", llama_path, "--served-model-name", MODEL, "--block-size", "4",
            "--max-model-len", "256"]
    with running_server(args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@needs_plugin
def test_chat_response_format_json_schema(client):
    schema = SCHEMAS[0]
    messages = [{"role": "user", "content": "Describe a user."}]
    for seed in range(3):
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=seed, max_tokens=96,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "user", "schema": schema}})
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"
        validate(json.loads(choice.message.content), schema)
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.0, seed=7, max_tokens=96, stream=True,
        response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")


@needs_plugin
def test_completions_extra_body_constraints(client):
    cases = [
        ({"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"guided_regex": r"[0-9]{3}"}, r"[0-9]{3}"),
        ({"structured_outputs": {"regex": r"id-[a-z]{2}"}}, r"id-[a-z]{2}"),
        ({"guided_grammar": 'root ::= "on" | "off"'}, r"on|off"),
    ]
    for extra, pattern in cases:
        resp = client.completions.create(model=MODEL, prompt="x", max_tokens=16, seed=1,
                                         temperature=1.0, extra_body=extra)
        assert re.fullmatch(pattern, resp.choices[0].text), (extra, resp.choices[0].text)
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=96, seed=2,
                                     extra_body={"guided_json": SCHEMAS[1]})
    validate(json.loads(resp.choices[0].text), SCHEMAS[1])


@needs_plugin
def test_server_rejects_malformed_constraints_with_400(client):
    cases = [
        {"guided_regex": "a(b"},
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"structured_outputs": {"structural_tag": "x"}},
        {"guided_choice": ["a"], "guided_regex": "a"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "yaml"}},
    ]
    for extra in cases:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)


@needs_server_stack
def test_server_without_the_plugin_answers_400_naming_it(llama_path, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "no_such_plugin")
    args = ["--model", llama_path, "--served-model-name", MODEL, "--block-size", "4",
            "--max-model-len", "64"]
    with running_server(args) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="pip install hitchllm-structured"):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                response_format={"type": "json_object"})
