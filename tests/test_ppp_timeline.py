"""The step timeline (``hitchllm.timeline``): off unless HITCHLLM_STEP_TIMELINE asks for it;
its summaries compute busy fractions, waits and micro-batch sizes as worked out by hand; and
``benchmarks/pp_timeline.py`` runs PP=1 and PP=2 on the CPU (gloo) and prints its table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hitchllm import timeline
from hitchllm.timeline import Mark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_timeline(monkeypatch):
    monkeypatch.setattr(timeline, "ACTIVE", None)


def test_the_timeline_is_off_unless_asked_for(monkeypatch, no_timeline):
    monkeypatch.delenv(timeline.ENV_VAR, raising=False)
    assert timeline.start("driver") is None and timeline.ACTIVE is None
    assert timeline.drain() == []
    monkeypatch.setenv(timeline.ENV_VAR, "0")
    assert timeline.start("driver") is None
    monkeypatch.setenv(timeline.ENV_VAR, "1")
    tl = timeline.start("driver")
    assert tl is timeline.ACTIVE
    tl.step = 4
    tl.mark("launch_start")
    tl.device_mark("step_start", step=7)  # on the CPU: a host mark
    marks = timeline.drain()
    assert [(m.what, m.step) for m in marks] == [("launch_start", 4), ("step_start", 7)]
    assert marks[0].t <= marks[1].t and timeline.drain() == []


def stage_marks() -> list[Mark]:
    """Two steps of a stage after the first: step 0 from 1.000 to 1.010 s, waiting 2 ms for
    its input; step 1 from 1.015 to 1.020 s, no wait; answers sent 1 ms after each."""
    spans = [(0, "step", 1.000, 1.010), (0, "forward", 1.001, 1.009), (0, "recv", 1.001, 1.003),
             (0, "launch", 0.999, 1.002),
             (1, "step", 1.015, 1.020), (1, "forward", 1.016, 1.019), (1, "launch", 1.014, 1.016)]
    marks = [Mark(f"{name}_{end}", step, t) for step, name, t0, t1 in spans
             for end, t in (("start", t0), ("end", t1))]
    marks += [Mark("answer_sent", 0, 1.011), Mark("answer_sent", 1, 1.021)]
    return sorted(marks, key=lambda m: m.t)


def test_stage_summary_matches_the_arithmetic():
    s = timeline.summarize_stage("stage 1", stage_marks(), wall_s=0.050)
    assert s.steps == 2
    # Device time (10 + 5 ms) less the 2 ms wait, over 50 ms.
    assert s.busy_fraction == pytest.approx(0.013 / 0.050)
    assert s.forward_ms == pytest.approx((6 + 3) / 2)  # (8 - 2) and 3 ms
    assert s.wait_ms == pytest.approx(1.0)  # 2 ms, 0 ms
    assert s.idle_ms == pytest.approx(5.0)  # 1.010 -> 1.015
    assert s.launch_ms == pytest.approx(2.5)
    assert s.answer_lag_ms == pytest.approx(1.0)


def test_driver_summary_counts_micro_batches_and_round_trips():
    marks = [
        Mark("schedule_start", 0, 0.000), Mark("schedule_end", 0, 0.001),
        Mark("launched", 0, 0.001, {"requests": 3, "tokens": 40, "in_flight": 1}),
        Mark("schedule_start", 1, 0.002), Mark("schedule_end", 1, 0.005),
        Mark("launched", 1, 0.005, {"requests": 2, "tokens": 2, "in_flight": 2}),
        Mark("answer_read", 0, 0.021), Mark("outputs_done", 0, 0.022),
        # An empty plan (finished ids only) is not a step of requests.
        Mark("launched", 2, 0.023, {"requests": 0, "tokens": 0, "in_flight": 1}),
        Mark("answer_read", 1, 0.025), Mark("outputs_done", 1, 0.028),
    ]
    d = timeline.summarize_driver(marks)
    assert d.steps == 2 and d.batch_requests == [3, 2] and d.batch_tokens == [40, 2]
    assert d.schedule_ms == pytest.approx(2.0)
    assert d.round_trip_ms == pytest.approx((20 + 20) / 2)
    assert d.outputs_ms == pytest.approx(2.0)
    assert d.mean_in_flight == pytest.approx(1.5) and d.max_in_flight == 2
    assert d.wall_s == pytest.approx(0.028)


def test_pp_timeline_benchmark_runs_pp1_and_pp2_on_the_cpu(llama_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(timeline.ENV_VAR, None)  # the script turns it on itself
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pp_timeline.py"), "--model", llama_path,
         "--num-prompts", "6", "--input-len", "8", "24", "--output-len", "4", "12",
         "--max-model-len", "128"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| PP=")]
    runs = {r[0].strip(): r for r in rows if len(r) == 9 and "rank" not in r[1]
            and "runner" not in r[1]}
    assert set(runs) == {"PP=1", "PP=2"}
    assert runs["PP=2"][5].strip().endswith("/2")  # two micro-batches in flight at most
    assert float(runs["PP=2"][1]) > 0
    stages = [r for r in rows if "pipeline stage" in r[1]]
    assert [re.search(r"stage (\d)", r[1]).group(1) for r in stages] == ["0", "1"]
    for r in stages:
        assert int(r[2]) > 0 and int(r[3]) == 0 and 0 < float(r[4]) <= 1  # no graphs on CPU
    assert "PP=2:" in done.stdout and "x of PP=1" in done.stdout
