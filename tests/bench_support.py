"""Loading a script of benchmarks/ as a module in a test (benchmarks/ on sys.path for its own
imports, the module registered under a name of its own for the test's duration)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(monkeypatch, filename: str) -> ModuleType:
    """``benchmarks/<filename>`` as a module named ``<stem>_bench``."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    name = f"{Path(filename).stem}_bench"
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
