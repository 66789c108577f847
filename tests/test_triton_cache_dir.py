"""One on-disk Triton cache for the engine's kernels and torch.compile's
(``hitchllm.attention.triton_support.pin_triton_cache_dir``)."""

from __future__ import annotations

import os

import pytest

from hitchllm.attention.triton_support import pin_triton_cache_dir

triton = pytest.importorskip("triton")


def test_engine_kernels_and_inductor_share_one_cache(monkeypatch, tmp_path):
    if getattr(triton, "knobs", None) is None:
        pytest.skip("this Triton has no triton.knobs")
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    # Unset for the test, whatever it was, and restored after it (setenv records it).
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # Unpinned, Inductor would move the process's later compiles out of Triton's default.
    assert triton_cache_dir(0) != triton.knobs.cache.dir
    pin_triton_cache_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache")
    assert triton_cache_dir(0) == triton.knobs.cache.dir == os.environ["TRITON_CACHE_DIR"]


def test_a_cache_dir_the_user_set_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    pin_triton_cache_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
