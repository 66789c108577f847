"""Backend selection for MLA: auto picks an MLA backend for MLA models, standard backends
refuse MLA specs, MLA backends refuse standard ones, and forcing the wrong kind says why."""

from __future__ import annotations

import pytest
import torch
from mla_checkpoints import build_tiny_deepseek

pytest.importorskip("hitchllm_attention_mla")

from hitchllm import LLM
from hitchllm.attention import AttentionSpec
from hitchllm.attention.selector import (
    AttentionBackendError,
    rank_backends,
    select_attention_backend,
)
from hitchllm.entrypoints.backends_table import print_backends

MLA_BACKENDS = {"TORCH_MLA", "TRITON_MLA"}
# The tests run with TRITON_INTERPRET=1 (conftest), where TRITON_MLA serves float32 on the CPU
# and, with the higher priority, wins auto mode.
BEST_MLA = "TRITON_MLA"


def mla_spec(**fields) -> AttentionSpec:
    return AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=40, num_heads=4, num_kv_heads=1, block_size=16, use_mla=True,
                         **fields)


def llama_spec() -> AttentionSpec:
    return AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=16, num_heads=4, num_kv_heads=2, block_size=16)


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory):
    return build_tiny_deepseek(tmp_path_factory.mktemp("v2"), "DeepseekV2ForCausalLM")


def test_only_mla_backends_serve_an_mla_spec():
    ranked = rank_backends(mla_spec())
    assert {c.name for c in ranked} >= MLA_BACKENDS
    assert {c.name for c in ranked if c.valid} == MLA_BACKENDS
    assert ranked[0].name == BEST_MLA
    assert {c.name: c.backend.priority for c in ranked}["TORCH_MLA"] < \
        {c.name: c.backend.priority for c in ranked}["TRITON_MLA"]
    for c in ranked:
        if c.name not in MLA_BACKENDS:
            assert c.reasons, c.name


def test_mla_backends_refuse_standard_attention():
    for c in rank_backends(llama_spec()):
        if c.name in MLA_BACKENDS:
            assert any("multi-head latent attention" in r for r in c.reasons)


def test_torch_mla_refuses_an_fp8_latent_cache():
    spec = mla_spec()
    fp8 = AttentionSpec(**{**spec.__dict__, "kv_cache_dtype": torch.float8_e4m3fn})
    with pytest.raises(AttentionBackendError, match="KV-cache dtype"):
        select_attention_backend(fp8, "TORCH_MLA")


@pytest.mark.parametrize("forced", ["TRITON_ATTN", "TORCH"])
def test_forcing_a_standard_backend_on_mla_is_refused(forced):
    with pytest.raises(AttentionBackendError, match=f"{forced} .*cannot serve.*MLA"):
        select_attention_backend(mla_spec(), forced)


def test_auto_picks_an_mla_backend_for_deepseek(auto_backend, deepseek_path):
    llm = LLM(deepseek_path, block_size=4)
    assert llm.engine.attention_backend.name == BEST_MLA


def test_auto_falls_back_to_torch_mla_without_triton_mla(auto_backend, monkeypatch,
                                                         deepseek_path):
    monkeypatch.delenv("TRITON_INTERPRET")  # TRITON_MLA: "no CUDA device"
    llm = LLM(deepseek_path, block_size=4)
    assert llm.engine.attention_backend.name == "TORCH_MLA"


def test_forcing_triton_attn_on_deepseek_is_refused(deepseek_path):
    with pytest.raises(AttentionBackendError, match="TRITON_ATTN.*MLA"):
        LLM(deepseek_path, attention_backend="TRITON_ATTN")


@pytest.mark.parametrize("forced", sorted(MLA_BACKENDS))
def test_forcing_an_mla_backend_on_llama_is_refused(llama_path, forced):
    with pytest.raises(AttentionBackendError,
                       match=f"{forced}.*multi-head latent attention.*standard attention"):
        LLM(llama_path, attention_backend=forced)


def test_backends_table_shows_the_mla_spec_of_a_deepseek_model(deepseek_path, capsys,
                                                               auto_backend):
    assert print_backends(deepseek_path, "cpu", "float32", 16) == 0
    out = capsys.readouterr().out
    assert "head size 40 (MLA latent), heads 4/1" in out
    assert f"auto mode picks: {BEST_MLA}" in out
