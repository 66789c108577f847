"""A step timeline for finding where pipeline (and tensor) parallel steps lose their time.

Off by default and free when off: every call site tests ``timeline.ACTIVE is not None``.
With ``HITCHLLM_STEP_TIMELINE=1`` in the environment (worker processes inherit it), the engine's
process and every worker process keep a list of marks: what happened, for which step, when.

- The driver (``LLMEngine``): ``schedule_start`` / ``schedule_end``, ``launched`` (plan handed
  to the executor, with its requests, tokens and ``decodes``: rows of one token),
  ``answer_read`` (its output is back) and ``outputs_done`` (tokens folded into requests and
  outputs).
- A runner (in a worker process, or in the engine's process without workers):
  ``plan_received`` (worker processes), ``launch_start`` / ``launch_end`` on the host, and on
  the device ``step_start`` / ``step_end`` (the step's first and last work), ``forward_start``
  / ``forward_end`` (the model), ``recv_start`` / ``recv_end`` and ``send_start`` /
  ``send_end`` (activations from the previous and to the next pipeline stage); then
  ``result_ready`` (the host has the step's output) and ``answer_sent`` (worker processes).

Device marks on CUDA are timing events recorded on the current stream, turned into host-clock
times when the marks are drained (relative to an event recorded at start while the device was
idle); on the CPU they are host times. Times are ``time.perf_counter()`` seconds, one clock
for every process of a host, so the processes' marks line up.

``summarize`` turns the marks of a run into per-stage busy fractions and waits
(``benchmarks/pp_timeline.py`` prints them).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

ENV_VAR = "HITCHLLM_STEP_TIMELINE"


@dataclass
class Mark:
    """One thing that happened: ``what``, for step ``step`` (-1: none), at ``t`` seconds."""

    what: str
    step: int
    t: float
    info: dict[str, Any] = field(default_factory=dict)


class Timeline:
    """The marks of one process. ``step`` is the step its runner is launching (the default
    step of a mark)."""

    def __init__(self, who: str, device: torch.device | None = None) -> None:
        self.who = who
        self.step = -1
        self._marks: list[Mark] = []
        self._device_marks: list[tuple[str, int, torch.cuda.Event]] = []
        self._anchor: torch.cuda.Event | None = None
        self._anchor_t = 0.0
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record()
            self._anchor.synchronize()
            self._anchor_t = time.perf_counter()

    def mark(self, what: str, step: int | None = None, **info: Any) -> None:
        """A host mark now."""
        self._marks.append(Mark(what, self.step if step is None else step,
                                time.perf_counter(), info))

    def device_mark(self, what: str, step: int | None = None) -> None:
        """A mark when the device gets here (on the CPU: now)."""
        if self._anchor is None:
            self.mark(what, step)
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._device_marks.append((what, self.step if step is None else step, event))

    def drain(self) -> list[Mark]:
        """The marks so far, oldest first (device marks resolved: waits for the device);
        the list starts empty again."""
        marks, self._marks = self._marks, []
        if self._device_marks:
            assert self._anchor is not None
            torch.cuda.synchronize()
            marks += [Mark(what, step, self._anchor_t + self._anchor.elapsed_time(e) / 1e3)
                      for what, step, e in self._device_marks]
            self._device_marks = []
        marks.sort(key=lambda m: m.t)
        return marks


# This process's timeline while one is kept (``start``), else None.
ACTIVE: Timeline | None = None


def requested() -> bool:
    """Whether the environment asks for a timeline (``HITCHLLM_STEP_TIMELINE=1``)."""
    return os.environ.get(ENV_VAR, "") not in ("", "0")


def start(who: str, device: torch.device | None = None) -> Timeline | None:
    """Keep this process's timeline from now if the environment asks for one."""
    global ACTIVE
    if requested():
        ACTIVE = Timeline(who, device)
    return ACTIVE


def drain() -> list[Mark]:
    """This process's marks so far (empty without a timeline)."""
    return [] if ACTIVE is None else ACTIVE.drain()


@contextmanager
def device_span(name: str) -> Iterator[None]:
    """Device marks ``{name}_start`` and ``{name}_end`` around the block, if a timeline is
    kept."""
    tl = ACTIVE
    if tl is not None:
        tl.device_mark(f"{name}_start")
    yield
    if tl is not None:
        tl.device_mark(f"{name}_end")


# ---- reading a run's marks -----------------------------------------------------------------


@dataclass
class StageSummary:
    """One runner's (worker's) share of a run."""

    who: str
    steps: int
    busy_fraction: float  # device time computing (not waiting for a peer) / the run's wall time
    forward_ms: float  # mean per step: the model's forward, less its waits for peers
    wait_ms: float  # mean per step: waiting for the previous stage (recv) and the next (send)
    idle_ms: float  # mean per step: device idle between one step's end and the next's start
    launch_ms: float  # mean per step: host time to prepare and launch it
    answer_lag_ms: float  # mean per step: device done -> output sent (0 in one process)
    graph_steps: int = 0  # steps whose forward replayed a CUDA graph


@dataclass
class DriverSummary:
    """The engine's side of a run."""

    steps: int  # steps of at least one request
    wall_s: float
    schedule_ms: float  # mean per step
    round_trip_ms: float  # mean per step: plan launched -> its output read
    outputs_ms: float  # mean per step: output read -> folded into requests and outputs
    batch_requests: list[int]  # requests of each step, in launch order
    batch_tokens: list[int]  # tokens of each step
    mean_in_flight: float  # mean steps in flight when a step launched (itself included)
    max_in_flight: int


def _spans(marks: list[Mark], name: str) -> dict[int, float]:
    """Per step: the time between ``name_start`` and ``name_end`` marks (summed)."""
    starts: dict[int, list[float]] = defaultdict(list)
    total: dict[int, float] = defaultdict(float)
    for m in marks:
        if m.what == f"{name}_start":
            starts[m.step].append(m.t)
        elif m.what == f"{name}_end" and starts[m.step]:
            total[m.step] += m.t - starts[m.step].pop(0)
    return total


def _at(marks: list[Mark], what: str) -> dict[int, float]:
    return {m.step: m.t for m in marks if m.what == what}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_stage(who: str, marks: list[Mark], wall_s: float) -> StageSummary:
    """A runner's marks (see the module doc) over a run of ``wall_s`` seconds."""
    steps = _spans(marks, "step")
    forward, recv, send = _spans(marks, "forward"), _spans(marks, "recv"), _spans(marks, "send")
    launch = _spans(marks, "launch")
    waits = {s: recv.get(s, 0.0) + send.get(s, 0.0) for s in steps}
    busy = sum(steps.values()) - sum(waits.values())
    starts, ends = _at(marks, "step_start"), _at(marks, "step_end")
    order = sorted(steps, key=lambda s: starts[s])
    idle = [starts[b] - ends[a] for a, b in pairwise(order) if starts[b] > ends[a]]
    ready, sent = _at(marks, "step_end"), _at(marks, "answer_sent")
    lags = [sent[s] - ready[s] for s in sent if s in ready]
    return StageSummary(
        who=who, steps=len(steps),
        busy_fraction=busy / wall_s if wall_s > 0 else 0.0,
        forward_ms=1e3 * _mean([forward[s] - waits.get(s, 0.0) for s in forward]),
        wait_ms=1e3 * _mean(list(waits.values())),
        idle_ms=1e3 * _mean(idle),
        launch_ms=1e3 * _mean(list(launch.values())),
        answer_lag_ms=1e3 * _mean(lags),
        graph_steps=sum(m.what in ("graph_replay", "pieces_replay") for m in marks),
    )


def summarize_driver(marks: list[Mark]) -> DriverSummary:
    """The engine's marks (see the module doc)."""
    launched = [m for m in marks if m.what == "launched" and m.info.get("requests")]
    read, done = _at(marks, "answer_read"), _at(marks, "outputs_done")
    schedule = _spans(marks, "schedule")
    trips = [read[m.step] - m.t for m in launched if m.step in read]
    folds = [done[s] - read[s] for s in done if s in read]
    in_flight = [m.info.get("in_flight", 1) for m in launched]
    times = [m.t for m in marks]
    return DriverSummary(
        steps=len(launched),
        wall_s=max(times) - min(times) if times else 0.0,
        schedule_ms=1e3 * _mean(list(schedule.values())),
        round_trip_ms=1e3 * _mean(trips),
        outputs_ms=1e3 * _mean(folds),
        batch_requests=[m.info["requests"] for m in launched],
        batch_tokens=[m.info["tokens"] for m in launched],
        mean_in_flight=_mean(in_flight),
        max_in_flight=max(in_flight, default=0),
    )
