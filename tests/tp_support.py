"""Helpers of the tensor-parallel tests: engines whose worker processes are always reaped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hitchllm import LLM
from hitchllm.tiny_model import build_tiny_checkpoint

# Every multi-process test runs under this limit (pytest-timeout is not installed: the
# executor's own step timeout and this wall-clock check keep a broken run from hanging).
TP_TEST_TIMEOUT_S = 60


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a reaped child does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def qwen3_gqa_path(tmp_path_factory) -> str:
    """A tiny Qwen3 with one KV head (replicated on every rank), a tied LM head and a
    vocabulary of 515 rows (not divisible by 2: the last vocabulary partition is padded)."""
    return str(build_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3-gqa") / "m", "Qwen3ForCausalLM",
        num_key_value_heads=1, vocab_size=515, tie_word_embeddings=True))


@pytest.fixture
def only_builtin_plugins(monkeypatch):
    """Workers load no optional plugin: each worker's start-up is then the import of torch
    and the load of its shard (the optional plugins import Triton, seconds on 2 cores)."""
    monkeypatch.setenv("HITCHLLM_PLUGINS", "")


@contextmanager
def tp_llm(path: str, **kwargs) -> Iterator[LLM]:
    """An ``LLM`` used as a context manager (which closes it), with every worker process
    checked gone afterwards."""
    llm = LLM(path, **kwargs)
    pids = list(getattr(llm.engine.executor, "pids", []))
    try:
        with llm:
            yield llm
    finally:
        assert not [pid for pid in pids if alive(pid)], "a worker process outlived close()"
