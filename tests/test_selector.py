"""Backend discovery and selection: auto, forced, unknown, invalid, broken plugins."""

from __future__ import annotations

import logging

import pytest
import torch
from fake_dists import install_fake_plugin

from hitchllm import LLM, SamplingParams
from hitchllm.attention import AttentionSpec
from hitchllm.attention.selector import AttentionBackendError, select_attention_backend
from hitchllm.plugins import get_plugin_registry

pytestmark = pytest.mark.usefixtures("auto_backend")


@pytest.fixture(autouse=True)
def _only_this_modules_plugins(monkeypatch):
    """These tests describe a machine with the core and the fake plugins below only; real
    plugins installed here (TRITON_ATTN, ...) stay out through the allow-list."""
    monkeypatch.setenv("HITCHLLM_PLUGINS", "hitchllm-fake-backends,hitchllm-broken,"
                       "hitchllm-fake-model,hitchllm-typo,hitchllm-torch2")

SPEC = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                     head_size=64, num_heads=8, num_kv_heads=2, block_size=16)

BACKENDS_SOURCE = """
from hitchllm import hookimpl
from hitchllm.attention import TorchAttentionBackend


class Fast(TorchAttentionBackend):
    name = "FAST"
    priority = 50


class Alpha(TorchAttentionBackend):
    # Same priority as FAST: the tie breaks by name.
    name = "ALPHA"
    priority = 50


class NeedsGpu(TorchAttentionBackend):
    name = "NEEDS_GPU"
    priority = 100

    @classmethod
    def validate(cls, spec):
        return ["no CUDA device (this backend needs sm_90)"] if spec.device_type != "cuda" else []


@hookimpl
def hitchllm_attention_backends():
    return [Fast, Alpha, NeedsGpu]
"""


@pytest.fixture
def fake_backends(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-fake-backends", "1.2.3",
                        "fake_backends_plugin", BACKENDS_SOURCE)


def test_auto_with_core_only_picks_torch():
    assert select_attention_backend(SPEC).name == "TORCH"


def test_auto_picks_highest_priority_valid_backend_ties_by_name(fake_backends):
    assert select_attention_backend(SPEC).name == "ALPHA"


@pytest.mark.parametrize("how", ["argument", "HITCHLLM_ATTENTION_BACKEND",
                                 "VLLM_ATTENTION_BACKEND"])
def test_forced_backend_wins_over_priority(fake_backends, monkeypatch, how):
    if how == "argument":
        assert select_attention_backend(SPEC, forced="torch").name == "TORCH"
    else:
        monkeypatch.setenv(how, "FAST")
        assert select_attention_backend(SPEC).name == "FAST"


def test_forced_invalid_backend_quotes_its_reasons(fake_backends):
    with pytest.raises(AttentionBackendError, match=r"NEEDS_GPU.*hitchllm-fake-backends.*sm_90"):
        select_attention_backend(SPEC, forced="NEEDS_GPU")


def test_unknown_backend_lists_installed_ones_with_their_distribution(fake_backends):
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(SPEC, forced="FLASHINFER")
    msg = str(err.value)
    assert "'FLASHINFER'" in msg
    assert "TORCH (hitchllm " in msg and "FAST (hitchllm-fake-backends 1.2.3)" in msg


def test_no_valid_backend_lists_every_reason(fake_backends):
    mla = AttentionSpec(**{**SPEC.__dict__, "use_mla": True})
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(mla, forced=None)
    msg = str(err.value)
    for name in ("TORCH", "FAST", "ALPHA", "NEEDS_GPU"):
        assert name in msg
    assert "MLA" in msg and "sm_90" in msg


def test_broken_plugin_is_reported_and_skipped(tmp_path, monkeypatch, caplog):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-broken", "0.0.1",
                        "broken_plugin", "import a_module_that_does_not_exist\n")
    with caplog.at_level(logging.WARNING, logger="hitchllm"):
        registry = get_plugin_registry()
    [failed] = registry.failed
    assert (failed.distribution, failed.version) == ("hitchllm-broken", "0.0.1")
    assert "a_module_that_does_not_exist" in failed.error
    assert "hitchllm-broken" in caplog.text
    assert select_attention_backend(SPEC).name == "TORCH"
    with pytest.raises(AttentionBackendError, match="hitchllm-broken.*a_module_that_does_not"):
        select_attention_backend(SPEC, forced="BROKEN_BACKEND")


def test_allow_list_restricts_loaded_plugins(fake_backends, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "some-other-plugin")
    assert select_attention_backend(SPEC).name == "TORCH"
    with pytest.raises(AttentionBackendError, match="unknown"):
        select_attention_backend(SPEC, forced="FAST")


def test_allow_list_accepts_distribution_name(fake_backends, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "hitchllm-fake-backends")
    assert select_attention_backend(SPEC).name == "ALPHA"


def test_engine_uses_a_third_party_backend_and_logs_it_once(fake_backends, llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="hitchllm"):
        llm = LLM(llama_path)
    assert llm.engine.attention_backend.name == "ALPHA"
    assert caplog.text.count("Using attention backend ALPHA") == 1
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_engine_forced_unknown_backend_fails_clearly(llama_path):
    with pytest.raises(AttentionBackendError, match="Installed backends: TORCH"):
        LLM(llama_path, attention_backend="TRITON_ATTN")


def test_model_architecture_from_a_plugin(tmp_path, monkeypatch, llama_path):
    import json
    import shutil

    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-fake-model", "0.1",
                        "fake_model_plugin", """
        from hitchllm import hookimpl
        from hitchllm.models.llama import LlamaForCausalLM


        class RenamedLlama(LlamaForCausalLM):
            pass


        @hookimpl
        def hitchllm_model_architectures():
            return {"RenamedLlamaForCausalLM": RenamedLlama}
        """)
    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["RenamedLlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(model))
    assert type(llm.engine.executor.runner.model).__name__ == "RenamedLlama"


def test_misspelled_hook_rejects_the_plugin(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-typo", "0.2", "typo_plugin", """
        from hitchllm import hookimpl


        @hookimpl
        def hitchllm_attention_backend():
            return []
        """)
    registry = get_plugin_registry()
    [failed] = registry.failed
    assert failed.distribution == "hitchllm-typo"
    assert "hitchllm_attention_backend" in failed.error


def test_plugin_registered_last_wins_a_name_clash(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-torch2", "0.3", "torch2_plugin",
                        """
        from hitchllm import hookimpl
        from hitchllm.attention import TorchAttentionBackend


        class Replacement(TorchAttentionBackend):
            name = "TORCH"
            priority = 1


        @hookimpl
        def hitchllm_attention_backends():
            return [Replacement]
        """)
    chosen = select_attention_backend(SPEC)
    assert chosen.__name__ == "Replacement"
