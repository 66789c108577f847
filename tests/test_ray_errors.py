"""What of the Ray executor needs no Ray cluster: the Ray-not-installed error, features refused
on Ray, the Ray flags reaching the engine config, and which Ray instance the executor joins
(and stops) - the latter against a recording stand-in for the ``ray`` module."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from hitchllm import LLM
from hitchllm.config import EngineConfig
from hitchllm.engine.ray_executor import _Actors, connect
from hitchllm.entrypoints.cli import build_parser, engine_kwargs


def test_ray_not_installed_says_how_to_install_it(llama_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    before = multiprocessing.active_children()
    with pytest.raises(ImportError, match=r"distributed_executor_backend='ray' needs Ray, "
                                          r"which is not installed: pip install "
                                          r"'hitchllm\[ray\]'"):
        LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert multiprocessing.active_children() == before


def test_speculative_decoding_on_ray_is_refused(llama_path):
    with pytest.raises(ValueError, match=r"speculative decoding \(speculative_method\) does "
                                         "not run on Ray workers yet"):
        LLM(llama_path, distributed_executor_backend="ray", speculative_method="ngram",
            num_speculative_tokens=2)


def test_ray_flags_reach_the_engine_config(llama_path):
    args = build_parser().parse_args([
        "generate", "--model", llama_path, "--prompt", "x", "-tp", "2",
        "--distributed-executor-backend", "ray", "--ray-placement-strategy", "SPREAD",
        "--ray-placement-timeout-s", "5"])
    config = EngineConfig(model=llama_path, **engine_kwargs(args))
    assert config.distributed_executor_backend == "ray"
    assert config.ray_placement_strategy == "SPREAD"
    assert config.ray_placement_timeout_s == 5
    with pytest.raises(ValueError, match="ray_placement_strategy"):
        EngineConfig(model=llama_path, ray_placement_strategy="EVERYWHERE")


class FakeRay:
    """What ``connect`` and ``_Actors.stop`` call on the ``ray`` module, recorded."""

    def __init__(self, initialized: bool = False, cluster_up: bool = False) -> None:
        self.initialized = initialized
        self.cluster_up = cluster_up
        self.calls: list[tuple] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, address: str | None = None, **kwargs) -> None:
        self.calls.append(("init", address, kwargs))
        if address == "auto" and not self.cluster_up:
            raise ConnectionError("Could not find any running Ray instance")
        self.initialized = True

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))
        self.initialized = False


def test_the_engine_joins_the_ray_it_finds_and_starts_one_only_when_there_is_none(
        monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connected = FakeRay(initialized=True)
    assert connect(connected) is False and connected.calls == []
    running = FakeRay(cluster_up=True)  # `ray start --head` on this host
    assert connect(running) is False
    assert running.calls == [("init", "auto", {})]
    none = FakeRay()
    assert connect(none) is True  # started here: the executor stops it at close
    assert none.calls == [("init", "auto", {}), ("init", None, {"include_dashboard": False})]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    named = FakeRay()
    assert connect(named) is False
    assert named.calls == [("init", None, {})]  # Ray reads RAY_ADDRESS itself


def test_closing_stops_only_a_ray_instance_the_executor_started():
    ours, theirs = FakeRay(initialized=True), FakeRay(initialized=True)
    _Actors(ours, owns_ray=True).stop()
    _Actors(theirs, owns_ray=False).stop()
    assert ours.calls == [("shutdown",)]
    assert theirs.calls == []
