"""benchmarks/lora_throughput.py: the adapters it writes directly in PEFT's format are what
PEFT loads, and the engine's output with them equals PeftModel's; its CPU smoke run completes
all three configurations and appends its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_support import load_benchmark
from lora_reference import assert_outputs_match_peft
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from test_models_hf_parity import mixed_prompts
from transformers import AutoModelForCausalLM

from hitchllm import LLM, LoRARequest, SamplingParams
from hitchllm.tiny_model import build_tiny_checkpoint

MAX_NEW = 6
# name -> (rank, targets, alpha): every projection, and a subset with another alpha.
ADAPTERS = {"all": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"), None),
            "q-down": (4, ("q_proj", "down_proj"), 5.0)}


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/lora_throughput.py as a module (benchmarks/ on sys.path for its imports)."""
    return load_benchmark(monkeypatch, "lora_throughput.py")


@pytest.fixture
def qwen3_with_adapters(bench, tmp_path):
    # Attention wider than the hidden size (4 heads of 32 on 64), as in Qwen3-0.6B (16 heads of
    # 128 on 1024): q_proj and o_proj are not square, so their shapes are checked.
    base = str(build_tiny_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM", head_dim=32))
    config = json.loads((Path(base) / "config.json").read_text())
    paths = {name: str(bench.write_random_adapter(tmp_path / name, config, rank, targets,
                                                  alpha=alpha, seed=seed, std=0.2,
                                                  dtype=torch.float32))
             for seed, (name, (rank, targets, alpha)) in enumerate(ADAPTERS.items())}
    return base, paths


def test_peft_loads_every_written_tensor(qwen3_with_adapters):
    base, paths = qwen3_with_adapters
    for name, path in paths.items():
        rank, targets, alpha = ADAPTERS[name]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)
        config = model.peft_config["default"]
        assert (config.r, config.lora_alpha) == (rank, alpha if alpha is not None else 2 * rank)
        assert set(config.target_modules) == set(targets)
        loaded = get_peft_model_state_dict(model)
        written = load_file(str(Path(path) / "adapter_model.safetensors"))
        assert loaded.keys() == written.keys()  # PEFT found a weight for every LoRA module
        for key, tensor in written.items():
            assert torch.equal(loaded[key], tensor), key
        num_layers = model.config.num_hidden_layers
        assert len(written) == 2 * num_layers * len(targets)


def test_engine_output_with_written_adapters_equals_peft(qwen3_with_adapters):
    base, paths = qwen3_with_adapters
    names = [*paths, None, *paths]
    prompts = mixed_prompts(3, lengths=(9, 4, 13, 7, 2))
    requests = [None if n is None else LoRARequest(n, list(paths).index(n) + 1, paths[n])
                for n in names]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=requests, use_tqdm=False)
    assert_outputs_match_peft(base, paths, names, prompts, outs, MAX_NEW)


def test_writer_refuses_unknown_targets(bench, tiny_models, tmp_path):
    config = json.loads((Path(tiny_models["LlamaForCausalLM"]) / "config.json").read_text())
    with pytest.raises(ValueError, match="lm_head"):
        bench.write_random_adapter(tmp_path / "a", config, 4, ["q_proj", "lm_head"])


def test_cpu_smoke_run_completes_all_configurations(bench, tiny_models, tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    lines = bench.main(["--device", "cpu", "--model", tiny_models["LlamaForCausalLM"],
                        "--num-prompts", "8", "--input-len", "8", "16", "--output-len", "4", "8",
                        "--num-adapters", "4", "--rank", "4", "--swap-adapters", "6",
                        "--swap-max-loras", "2", "--results", str(results)])
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == ["no LoRA", "4 adapters, max_loras 4",
                                            "6 adapters, max_loras 2"]
    swaps = [r[6].strip() for r in rows]
    # Adapter 0 is in a slot after the warm-up; the timed run brings in the other three.
    assert swaps[:2] == ["-", "3"]
    assert int(swaps[2]) >= 5  # six adapters through two slots
    reads, evictions = (int(v) for v in rows[2][7].split("/"))
    assert reads >= 5 and evictions >= 5  # the host cache holds two of the six
    assert rows[1][7].strip() == "0 / 0"  # all four stay in host memory
    text = results.read_text()
    assert "## Multi-LoRA throughput (issue 17)" in text
    assert "goal (issue 17): 4 adapters, max_loras 4 reaches >= 75% of no LoRA" in text
    assert "--model MODEL" in text and str(results) not in text
    assert lines[-1] in capsys.readouterr().out
