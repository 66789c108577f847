"""Shared fixtures: tiny random checkpoints built offline, and a Hugging Face greedy reference."""

import os

# OpenMP threads that spin while they wait slow every test down many times over on a shared,
# busy CPU (docs/performance.md); the hitchllm command sets the same. Read once, when torch
# loads OpenMP, so it comes before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # imports no Triton kernel, so it may come first

# Triton kernels must run in the interpreter on machines without a GPU; this must be set
# before any @triton.jit function is defined, so it sits at the very top of the test session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines in tests run on the CPU unless a test asks for CUDA (the GPU tests do), so the
# CPU suite means the same thing on a machine that has a GPU.
os.environ.setdefault("HITCHLLM_DEVICE", "cpu")
# Engines use the TORCH reference unless a test names a backend (see ``_fresh_plugins``); set
# here too so that module-scoped engines, built before any per-test fixture runs, do as well.
os.environ["HITCHLLM_ATTENTION_BACKEND"] = "TORCH"

import pytest
import torch

from hitchllm.plugins import reset_plugin_registry
from hitchllm.tiny_model import ARCHITECTURES, build_tiny_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Architecture name -> directory of a tiny random checkpoint of that architecture."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: str(build_tiny_checkpoint(root / arch, arch)) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_path(tiny_models) -> str:
    return tiny_models["LlamaForCausalLM"]


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    """Each test discovers plugins anew and sees no forcing from the developer's shell.

    Engines in tests use the TORCH reference unless a test names a backend: with
    TRITON_INTERPRET=1 (set above) an installed TRITON_ATTN would otherwise win auto mode on
    the CPU and every engine test would crawl through Triton's interpreter. Tests of auto mode
    use the ``auto_backend`` fixture.
    """
    for var in ("HITCHLLM_PLUGINS", "VLLM_ATTENTION_BACKEND", "HITCHLLM_MOE_KERNEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HITCHLLM_ATTENTION_BACKEND", "TORCH")
    reset_plugin_registry()
    yield
    reset_plugin_registry()


@pytest.fixture
def auto_backend(monkeypatch):
    """No backend forced: the selector's auto mode decides."""
    monkeypatch.delenv("HITCHLLM_ATTENTION_BACKEND", raising=False)
