"""Run a plugin's compile check (``python -m MODULE``: Triton kernels compiled for a GPU on
the CPU, one line per kernel ending in "fits" or "TOO MUCH shared memory") in a fresh process,
with the interpreter off and a cache of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def compile_check_lines(module: str, cache_dir: Path) -> list[str]:
    """The check's output lines; fails the test if the check itself fails."""
    env = os.environ | {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir)}
    result = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()
