"""Start-up of the CPU engine (issue 22, point 6): the tokenizer loads without the model's
transformers configuration and is the one ``AutoTokenizer`` gives; the start-up path imports
none of the heavy modules it used to, and runs no full garbage collection; ``main`` called in
a process gives that process its collector back."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hitchllm.bundled_model import default_model_path
from hitchllm.engine.model_runner import zeroed_kv_cache
from hitchllm.entrypoints.cli import main
from hitchllm.tiny_model import build_tiny_checkpoint
from hitchllm.tokenizer import (
    GENERIC_TOKENIZER_CLASSES,
    GENERIC_TOKENIZER_MODEL_TYPES,
    load_tokenizer,
    loads_generic_tokenizer,
)

TEXTS = ["Hello world", "def f(x):\n    return x + 1\n", "<|im_start|>user\nhi<|im_end|>\n"
         "<|endoftext|> 0 1 2 100"]
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "def add(a, b):"}]
# Modules the bundled model's start-up used to import and no longer needs: transformers'
# model configurations (and AutoTokenizer's module, which loads them), the distributed
# tensors and sympy they pull in, and Triton (LoRA's kernels, CUDA only).
HEAVY_MODULES = ("transformers.models.llama.configuration_llama",
                 "transformers.models.auto.tokenization_auto", "torch.distributed.tensor",
                 "sympy", "triton", "hitchllm_lora.kernels")


@pytest.mark.parametrize("model", ["bundled", "LlamaForCausalLM", "MistralForCausalLM",
                                   "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_load_tokenizer_matches_auto_tokenizer(model, tiny_models):
    path = default_model_path() if model == "bundled" else tiny_models[model]
    ours, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(reference)
    assert ours.init_kwargs == reference.init_kwargs
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == reference(text)["input_ids"]
        assert ours.decode(ids) == reference.decode(ids)
    assert (ours.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(CONVERSATION, tokenize=False,
                                             add_generation_prompt=True))


def test_generic_tokenizer_path_is_taken_only_where_autotokenizer_agrees(tiny_models):
    # Llama, Mistral and Qwen3 checkpoints with a tokenizers-library tokenizer skip
    # AutoTokenizer; for Qwen2 it applies Qwen2's own class, so they go through it.
    assert loads_generic_tokenizer(Path(default_model_path()))
    taken = {arch: loads_generic_tokenizer(Path(p)) for arch, p in tiny_models.items()}
    assert taken == {"LlamaForCausalLM": True, "MistralForCausalLM": True,
                     "Qwen2ForCausalLM": False, "Qwen3ForCausalLM": True}


def test_qwen3_moe_takes_the_generic_path_autotokenizer_takes(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "moe", "Qwen3MoeForCausalLM")
    assert loads_generic_tokenizer(path)
    ours, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(reference) and ours.init_kwargs == reference.init_kwargs
    ids = ours(TEXTS[2])["input_ids"]
    assert ids == reference(TEXTS[2])["input_ids"] and ours.decode(ids) == reference.decode(ids)


def test_a_configuration_naming_its_model_goes_through_autotokenizer(tiny_models, tmp_path):
    """AutoTokenizer checks a configuration's ``model_name`` against its list of wrong Hub
    classes too; such a checkpoint is left to it."""
    source = Path(tiny_models["Qwen3ForCausalLM"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((source / name).read_text())
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_name": "qwen2"}))
    assert not loads_generic_tokenizer(tmp_path)
    assert type(load_tokenizer(tmp_path)) is type(AutoTokenizer.from_pretrained(tmp_path))


def test_autotokenizer_keeps_a_generic_class_for_these_model_types():
    """The fast path's premise, against the installed transformers' own tables: these model
    types map to no tokenizer class (or the generic one), or to a class of their own that
    AutoTokenizer puts in place of a checkpoint's generic class only for the types it lists
    as naming a wrong class on the Hub, which these are not. (Mistral's own backend, where
    mistral-common registers it, applies only to checkpoints with ``tekken.json``, which the
    fast path leaves to AutoTokenizer.)"""
    from transformers.models.auto import tokenization_auto

    for model_type in sorted(GENERIC_TOKENIZER_MODEL_TYPES):
        registered = tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type)
        if registered is not None and registered not in GENERIC_TOKENIZER_CLASSES:
            assert model_type not in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


def test_load_tokenizer_falls_back_for_a_checkpoint_naming_remote_code(tmp_path):
    bundled = Path(default_model_path())
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_text((bundled / name).read_text())
    config = json.loads((bundled / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}))
    assert not loads_generic_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert loads_generic_tokenizer(tmp_path)
    # With mistral-common installed, AutoTokenizer loads such a checkpoint as Mistral's own.
    (tmp_path / "tekken.json").write_text("{}")
    assert not loads_generic_tokenizer(tmp_path)
    (tmp_path / "tekken.json").unlink()
    (tmp_path / "config.json").write_text("{not json")
    assert not loads_generic_tokenizer(tmp_path)  # AutoTokenizer reports the broken file


STARTUP_PROBE = """
import gc, json, sys
# Full collections inside main before start-up's objects are frozen (afterwards they are
# cheap: the frozen objects are not walked).
full, in_main = [], []
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2
                    and in_main and gc.get_freeze_count() == 0 and full.append(1))
sys.argv = ["hitchllm", "generate", "--prompt", "def f", "--max-tokens", "2"]
from hitchllm.entrypoints.cli import main
in_main.append(True)
rc = main()
print(json.dumps({"rc": rc, "heavy": [m for m in HEAVY if m in sys.modules],
                  "full_collections": len(full), "frozen": gc.get_freeze_count(),
                  "collector_on": gc.isenabled()}))
"""


def test_bundled_model_start_up_skips_heavy_imports_and_full_collections():
    """A fresh ``hitchllm generate`` on the bundled model on the CPU, as a user runs it (auto
    backend, every plugin installed): none of ``HEAVY_MODULES`` is imported, the collector
    ran no full collection while the engine was built, and what start-up built is frozen
    afterwards."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HITCHLLM_ATTENTION_BACKEND", "TRITON_INTERPRET")}
    env.update(HITCHLLM_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")  # the CPU start-up, on any host
    code = f"HEAVY = {HEAVY_MODULES!r}\n{STARTUP_PROBE}"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0
    assert report["heavy"] == []
    assert report["full_collections"] == 0
    assert report["frozen"] > 100_000 and report["collector_on"]


def test_main_in_process_gives_the_collector_back(llama_path, capsys):
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert main(["generate", "--model", llama_path, "--prompt", "def f", "--max-tokens",
                 "2"]) == 0
    assert "def f" in capsys.readouterr().out
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        assert main(["generate", "--model", llama_path, "--prompt", "x", "--top-p", "0"]) == 2
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_blocks", [3, 4096])  # a few KiB, and 8-32 MiB (fresh pages)
def test_cpu_kv_cache_is_zeroed_aligned_and_writable(dtype, num_blocks):
    shape = (2, num_blocks, 16, 2, 32)
    cache = zeroed_kv_cache(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0
    raw = cache.view(torch.uint8)
    assert raw.count_nonzero().item() == 0
    cache[1, -1, 15, 1].fill_(1.5)  # the last row of the last block: inside the tensor
    written = cache.float().nonzero()
    assert written.shape[0] == 32 and (written[:, :4] == torch.tensor(
        [1, num_blocks - 1, 15, 1])).all()
    assert (cache[1, -1, 15, 1].float() == 1.5).all()
