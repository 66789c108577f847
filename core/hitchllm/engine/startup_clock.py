"""How long an engine took to start, phase by phase (issue 21: start-up measured and cut).

The engine logs one line when it is ready, e.g. ``Engine ready 21.4 s after the process
started: imports and arguments 6.1 s, config and tokenizer 0.4 s, model 3.2 s, KV cache
sizing 2.9 s, KV cache allocation 0.1 s, CUDA graphs 8.7 s``; ``LLMEngine.startup_times``
keeps the numbers for benchmarks.
"""

from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (after the parenthesized command, which may hold spaces): start time
            # in clock ticks after boot.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """Durations of named start-up phases, in the order they ran: each ``lap`` ends the
    phase that began at the previous one."""

    def __init__(self) -> None:
        age = process_age_s()
        # Everything before the engine was built: interpreter, imports, argument parsing.
        self.phases: dict[str, float] = {} if age is None else {"imports and arguments": age}
        self._start = self._mark = time.perf_counter()

    def lap(self, name: str) -> None:
        """End phase ``name`` now (its time is added to an earlier phase of that name)."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._mark
        self._mark = now

    def total_s(self) -> float:
        """Seconds since the process started (or since the clock started, where unknown)."""
        return self.phases.get("imports and arguments", 0.0) + time.perf_counter() - self._start

    def summary(self) -> str:
        """One line for the log."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        where = "the process started" if "imports and arguments" in self.phases \
            else "the engine was created"
        return f"Engine ready {self.total_s():.1f} s after {where}: {parts}"
