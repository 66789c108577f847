"""OpenMP's wait policy for the CPU threads torch uses.

By default OpenMP's worker threads spin, busy-waiting for the next parallel region. On a CPU
that other processes also use, spinning threads take turns with the threads doing the work and
generation slowed down 7-30x in our measurements (docs/performance.md); passive waiting (the
threads sleep in the kernel between regions) kept it within 1-3x of an idle machine. OpenMP
reads ``OMP_WAIT_POLICY`` once, when torch loads it, so this must run before ``import torch``.
"""

from __future__ import annotations

import os
import sys


def default_omp_wait_policy() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy or torch (and with it
    OpenMP) is already loaded; returns whether it was set."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
