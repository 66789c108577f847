"""Each pipeline stage builds and loads only its modules: its contiguous decoder layers, the
embedding on the first stage, the final norm and the LM head on the last (a tied head loads
its own copy of the embedding there). Each stage is built in ``distributed.pretend_rank``
(no process group is needed to load) and compared with the checkpoint read directly."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tp_support import only_builtin_plugins, qwen3_gqa_path  # noqa: F401

from hitchllm import distributed
from hitchllm.config import ModelConfig
from hitchllm.distributed import ParallelRank
from hitchllm.models import loader
from hitchllm.models.loader import load_model
from hitchllm.models.pipeline import StageLayout, stage_layers
from hitchllm.plugins import get_plugin_registry
from hitchllm.tiny_model import build_tiny_checkpoint

# The optional plugins (Triton imports) are not needed to build the core's models.
pytestmark = pytest.mark.usefixtures("only_builtin_plugins")


def stage_model(path: str, rank: ParallelRank) -> torch.nn.Module:
    with distributed.pretend_rank(rank):
        return load_model(ModelConfig.from_pretrained(path), get_plugin_registry(),
                          torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("num_layers, pp, expected", [
    (4, 2, [[0, 1], [2, 3]]),
    (3, 2, [[0, 1], [2]]),  # uneven: the earlier stage holds one layer more
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
    (2, 2, [[0], [1]]),
])
def test_layers_split_into_contiguous_stages(num_layers, pp, expected):
    assert [list(stage_layers(num_layers, pp, s)) for s in range(pp)] == expected


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size=3 is more than the model's 2 "
                                         r"decoder layers .*use at most 2$"):
        stage_layers(2, 3, 0)


def test_rank_layout_is_stage_major():
    ranks = [ParallelRank.of(r, tp_size=2, pp_size=2) for r in range(4)]
    assert [(r.pp_rank, r.tp_rank) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.global_rank for r in ranks] == [0, 1, 2, 3]
    assert [r.answers for r in ranks] == [False, False, True, False]
    assert ranks[3].describe() == "rank 3 (pipeline stage 1, tensor-parallel rank 1)"
    assert ParallelRank.of(1, 2, 1).describe() == "tensor-parallel rank 1"


def test_checkpoint_names_a_stage_holds():
    first = StageLayout(0, 2, range(0, 2), 64, torch.float32)
    last = StageLayout(1, 2, range(2, 3), 64, torch.float32)
    for name, on_first, on_last in [
        ("model.embed_tokens.weight", True, False),
        ("model.layers.1.mlp.down_proj.weight", True, False),
        ("model.layers.2.self_attn.q_proj.weight", False, True),
        ("model.layers.12.input_layernorm.weight", False, False),
        ("model.norm.weight", False, True),
        ("lm_head.weight", False, True),
    ]:
        assert (first.holds(name), last.holds(name)) == (on_first, on_last), name


class RecordingSafeOpen:
    """``safe_open`` that records the names of the tensors read."""

    read: ClassVar[list[str]] = []

    def __init__(self, *args, **kwargs) -> None:
        self._file = safe_open(*args, **kwargs)

    def __enter__(self):
        self._f = self._file.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._file.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        self.read.append(name)
        return self._f.get_tensor(name)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_each_stage_holds_only_its_layers(tmp_path, monkeypatch, arch):
    """3 layers over 2 stages; the mixture-of-experts member routes its experts' tensors by
    rule, and skips other stages' experts alike."""
    path = str(build_tiny_checkpoint(tmp_path / "m", arch, num_hidden_layers=3))
    ckpt = load_file(f"{path}/model.safetensors")
    full = set(dict(stage_model(path, ParallelRank()).named_parameters()))
    monkeypatch.setattr(loader, "safe_open", RecordingSafeOpen)
    names = []
    for s in range(2):
        RecordingSafeOpen.read = []
        model = stage_model(path, ParallelRank(pp_rank=s, pp_size=2))
        params = dict(model.named_parameters())
        # The stage reads only its tensors from the checkpoint (stacked q/k/v and gate/up
        # are read as the checkpoint's separate tensors).
        read_layers = {int(n.split(".")[2]) for n in RecordingSafeOpen.read
                       if n.startswith("model.layers.")}
        assert read_layers == ({0, 1} if s == 0 else {2})
        assert ("model.embed_tokens.weight" in RecordingSafeOpen.read) == (s == 0)
        names.append(set(params))
        layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
        assert layers == ({0, 1} if s == 0 else {2})
        assert ("model.embed_tokens.weight" in params) == (s == 0)
        assert ("model.norm.weight" in params) == (s == 1)
        assert ("lm_head.weight" in params) == (s == 1)
        # Only the stage's attention layers exist: its KV cache covers its layers alone.
        assert [m.layer_index for m in model.modules()
                if type(m).__name__ == "Attention"] == list(layers)
        for name, p in params.items():  # loaded from the checkpoint, not left at init
            if name.endswith("input_layernorm.weight") or name == "lm_head.weight":
                torch.testing.assert_close(p, ckpt[name], rtol=0, atol=0)
    assert names[0].isdisjoint(names[1])
    assert names[0] | names[1] == full


def test_a_tied_head_on_the_last_stage_loads_the_embedding(qwen3_gqa_path):  # noqa: F811
    ckpt = load_file(f"{qwen3_gqa_path}/model.safetensors")
    assert "lm_head.weight" not in ckpt  # tied: only the embedding is stored
    last = stage_model(qwen3_gqa_path, ParallelRank(pp_rank=1, pp_size=2))
    params = dict(last.named_parameters())
    assert "model.embed_tokens.weight" not in params
    torch.testing.assert_close(params["lm_head.weight"], ckpt["model.embed_tokens.weight"],
                               rtol=0, atol=0)
    # With tensor parallelism too: rank 1 of the last stage holds its vocabulary rows.
    shard = stage_model(qwen3_gqa_path, ParallelRank(tp_rank=1, tp_size=2, pp_rank=1,
                                                      pp_size=2))
    head = dict(shard.named_parameters())["lm_head.weight"]
    rows = head.shape[0]
    embedding = ckpt["model.embed_tokens.weight"]
    torch.testing.assert_close(head[: embedding.shape[0] - rows], embedding[rows:],
                               rtol=0, atol=0)
