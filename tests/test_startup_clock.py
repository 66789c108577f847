"""The engine's start-up record: a process's age read from /proc, and the phases an engine
logs when it is ready."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from hitchllm import LLM
from hitchllm.engine.startup_clock import StartupClock, process_age_s

pytestmark = pytest.mark.skipif(process_age_s() is None, reason="needs Linux /proc")


def test_process_age_counts_from_the_process_start():
    code = ("import time; time.sleep(1.5); "
            "from hitchllm.engine.startup_clock import process_age_s; print(process_age_s())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)
    assert 1.5 <= age < 30


def test_laps_split_the_time_between_them():
    clock = StartupClock()
    before = clock.total_s()
    time.sleep(0.05)
    clock.lap("a")
    clock.lap("b")
    time.sleep(0.02)
    clock.lap("a")
    assert list(clock.phases) == ["imports and arguments", "a", "b"]
    assert clock.phases["a"] >= 0.07 and clock.phases["b"] < 0.02
    assert clock.total_s() - before >= 0.07
    summary = clock.summary()
    assert "s after the process started: imports and arguments" in summary
    assert ", a 0." in summary and summary.endswith(", b 0.0 s")


def test_the_engine_logs_its_start_up_phases(tiny_models, caplog):
    with caplog.at_level(logging.INFO, logger="hitchllm.engine.llm_engine"):
        llm = LLM(tiny_models["LlamaForCausalLM"], device="cpu")
    times = llm.engine.startup_times
    assert list(times) == ["imports and arguments", "config and tokenizer", "model",
                           "KV cache sizing", "KV cache allocation", "scheduler"]
    assert all(t >= 0 for t in times.values())
    # This pytest process started well before the engine: its age is most of the total.
    assert times["imports and arguments"] > sum(times.values()) - times["imports and arguments"]
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine ready")]
    assert len(ready) == 1 and "config and tokenizer" in ready[0] and "CUDA graphs" not in ready[0]
