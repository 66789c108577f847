"""Benchmark entries name the commit their numbers come from (benchmarks/results_md.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest


@pytest.fixture
def results_md():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        yield importlib.import_module("results_md")
    finally:
        sys.path.pop(0)


def test_the_commit_named_by_the_environment_wins(results_md, monkeypatch):
    monkeypatch.setenv("HITCHLLM_COMMIT", "abc1234")
    assert results_md.current_commit() == "abc1234"
    assert "commit abc1234)" in results_md.entry_heading("t", "cmd")[0]


def test_without_it_git_names_the_checkout(results_md, monkeypatch):
    monkeypatch.delenv("HITCHLLM_COMMIT", raising=False)
    calls = []

    def fake_run(args, **kwargs):
        calls.append(args)
        out = {"rev-parse": "def5678\n", "status": " M core/x.py\n"}[args[1]]
        return type("Done", (), {"stdout": out})()

    monkeypatch.setattr(results_md.subprocess, "run", fake_run)
    assert results_md.current_commit() == "def5678+changes"
    assert calls[1][:2] == ["git", "status"]
