"""A one-line description of this machine for benchmark records."""

from __future__ import annotations

import contextlib
import os
import platform


def describe_machine() -> str:
    """GPU name when CUDA is available, else the CPU model and core count."""
    try:
        import torch

        if torch.cuda.is_available():
            versions = [f"torch {torch.__version__}"]
            for name in ("triton", "transformers"):
                with contextlib.suppress(ImportError):
                    versions.append(f"{name} {__import__(name).__version__}")
            return f"{torch.cuda.get_device_name()} ({', '.join(versions)})"
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {model}, {os.cpu_count()} cores"
