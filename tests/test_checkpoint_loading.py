"""Checkpoints load from safetensors (single file or sharded with an index) and from PyTorch
``.bin`` files (``torch.load(weights_only=True)``); one that does not fit the model fails with
an error listing what is missing and what is unexpected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hitchllm import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "import os\n"]


def greedy_ids(path: str) -> list[list[int]]:
    llm = LLM(path, block_size=4, max_model_len=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def copy_without_weights(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    return dst


@pytest.fixture(scope="module")
def state(llama_path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(llama_path) / "model.safetensors"))


def test_bin_and_sharded_checkpoints_give_the_same_tokens(llama_path, state, tmp_path):
    expected = greedy_ids(llama_path)

    single_bin = copy_without_weights(llama_path, tmp_path / "bin")
    torch.save(state, single_bin / "pytorch_model.bin")
    assert greedy_ids(str(single_bin)) == expected

    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    for kind, ext in (("safetensors", "safetensors"), ("bin", "bin")):
        sharded = copy_without_weights(llama_path, tmp_path / f"sharded-{kind}")
        weight_map = {}
        for i, part in enumerate(halves):
            prefix = "model" if kind == "safetensors" else "pytorch_model"
            file = f"{prefix}-{i + 1:05d}-of-00002.{ext}"
            tensors = {n: state[n].contiguous() for n in part}
            if kind == "safetensors":
                save_file(tensors, str(sharded / file))
            else:
                torch.save(tensors, sharded / file)
            weight_map.update(dict.fromkeys(part, file))
        index = "model.safetensors.index.json" if kind == "safetensors" else (
            "pytorch_model.bin.index.json")
        (sharded / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        assert greedy_ids(str(sharded)) == expected, kind


def test_bin_files_never_run_pickled_code(llama_path, tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("pickled code ran",))

    bad = copy_without_weights(llama_path, tmp_path / "evil")
    torch.save({"payload": Payload()}, bad / "pytorch_model.bin")
    with pytest.raises(Exception, match="[Ww]eights only"):
        LLM(str(bad), block_size=4, max_model_len=64)


def test_missing_and_unexpected_tensors_are_listed(llama_path, state, tmp_path):
    broken = copy_without_weights(llama_path, tmp_path / "broken")
    tensors = dict(state)
    dropped = sorted(n for n in tensors if ".mlp.down_proj." in n)
    for name in dropped:
        del tensors[name]
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        LLM(str(broken), block_size=4, max_model_len=64)
    message = str(err.value)
    assert f"is missing {len(dropped)} tensors" in message
    assert all(name in message for name in dropped)
    assert "unexpected 1 tensors: model.layers.0.extra.weight" in message


def test_a_checkpoint_without_weights_is_one_clear_error(llama_path, tmp_path):
    empty = copy_without_weights(llama_path, tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no weights in .*pytorch_model"):
        LLM(str(empty), block_size=4, max_model_len=64)
