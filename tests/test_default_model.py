"""The bundled default model: a Hugging Face checkpoint within its size budget, the same greedy
tokens in transformers and hitchllm, used by ``LLM()`` and the CLI when no model is named,
writes Python, and reproduces the held-out loss its model card records."""

from __future__ import annotations

import ast
import codeop
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from reference import hf_greedy
from safetensors import safe_open
from test_bench_perplexity import hf_loss
from test_models_hf_parity import run
from transformers import AutoTokenizer

from hitchllm import LLM, EngineConfig, SamplingParams, default_model_path
from hitchllm.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[1]
MODEL = Path(default_model_path())
PROMPTS = [
    "import os\n\ndef ",
    "class Stack:\n    def __init__(self):\n        self.",
    "    for i in range(len(",
    '"""Read a configuration file."""\n\nimport',
]
SIZE_BUDGET = 8_000_000  # bytes of model.safetensors


def test_checkpoint_is_a_small_tied_bfloat16_llama():
    assert (MODEL / "model.safetensors").stat().st_size <= SIZE_BUDGET
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    with safe_open(MODEL / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert "lm_head.weight" not in names
    for name in ("tokenizer.json", "generation_config.json", "README.md"):
        assert (MODEL / name).is_file()


def test_tokenizer_adds_bos_and_carries_a_chat_template():
    assert "chat_template" in json.loads((MODEL / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(MODEL)
    assert tok("import os").input_ids[0] == tok.bos_token_id
    eos = json.loads((MODEL / "generation_config.json").read_text())["eos_token_id"]
    assert tok.eos_token_id in eos and tok.convert_tokens_to_ids("<|im_end|>") in eos


def test_greedy_tokens_match_transformers():
    tok = AutoTokenizer.from_pretrained(MODEL)
    prompts = [tok(p).input_ids for p in PROMPTS]
    llm = LLM()
    assert llm.engine.dtype == torch.float32  # bfloat16 weights, upcast on the CPU
    assert run(llm, prompts, 24) == hf_greedy(str(MODEL), prompts, 24)


def test_engine_config_and_cli_default_to_the_bundled_model(capsys):
    assert EngineConfig().model == default_model_path()
    assert main(["generate", "--prompt", "def add(a, b):", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def add(a, b):")


def test_chat_applies_the_template():
    out = LLM().chat([{"role": "user", "content": "Write a function that adds two numbers."}],
                     SamplingParams(max_tokens=8), use_tqdm=False)[0]
    tok = AutoTokenizer.from_pretrained(MODEL)
    assert out.prompt_token_ids[0] == tok.bos_token_id
    generation_prompt = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert out.prompt_token_ids[-len(generation_prompt):] == generation_prompt
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_greedy_completion_of_a_function_is_python():
    prompt = "import os\n\ndef "
    out = LLM().generate(prompt, SamplingParams(temperature=0.0, max_tokens=64),
                         use_tqdm=False)[0]
    text = prompt + out.outputs[0].text
    lines = text.split("\n")[:-1]  # the last line may be cut off mid-statement
    # A valid signature, then at least two more lines that Python accepts as a program so
    # far: complete, or unfinished the way its interactive prompt would wait for more (an
    # open docstring or bracket), but never a syntax error.
    ast.parse(lines[2] + "\n    pass")
    assert len([line for line in lines[3:] if line.strip()]) >= 2, text
    try:
        codeop.compile_command("\n".join(lines) + "\n", symbol="exec")
    except SyntaxError as exc:
        raise AssertionError(f"{exc} in:\n{text}") from exc


def test_model_card_loss_is_reproduced_by_bench_perplexity(capsys):
    card = (MODEL / "README.md").read_text()
    command = re.search(r"^(hitchllm bench perplexity .*)$", card, re.MULTILINE).group(1)
    recorded = float(re.search(r"^loss=(\d+\.\d+)$", card, re.MULTILINE).group(1))
    argv = []
    for word in shlex.split(command)[1:]:
        argv += sorted(map(str, REPO.glob(word))) if "*" in word else [word]
    assert main(argv) == 0
    loss = float(re.search(r"^loss=(\d+\.\d+)$", capsys.readouterr().out, re.MULTILINE).group(1))
    # The card's number comes from the training script's own model code.
    assert loss == pytest.approx(recorded, abs=2e-3)
    files = [Path(w) for w in argv if w.endswith(".py")]
    assert len(files) >= 3
    texts = [f.read_text() for f in files]
    window = int(argv[argv.index("--max-len") + 1])
    assert loss == pytest.approx(hf_loss(str(MODEL), texts, window)[0], abs=2e-4)
