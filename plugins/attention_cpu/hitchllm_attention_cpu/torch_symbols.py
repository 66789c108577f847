"""Functions of libtorch's own shared library that the plugin's C code calls directly, so that
its results are PyTorch's: MKL's float32 GEMMs (``sgemm_``, which ``F.linear`` calls, and the
packed ``cblas_sgemm_*``) and Sleef's vector exponential (``F.silu``'s). libtorch_cpu is
already loaded by ``import torch``; ctypes opens the same mapping again."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if (lib / name).exists():
            try:
                return ctypes.CDLL(str(lib / name))
            except OSError:
                return None
    return None


def function(name: str) -> ctypes._CFuncPtr | None:
    """libtorch_cpu's exported function ``name`` (restype and argtypes still to set), or None
    where this torch build does not export it."""
    library = _library()
    if library is None:
        return None
    try:
        return getattr(library, name)
    except AttributeError:
        return None


def address(name: str) -> int | None:
    """The address of libtorch_cpu's exported function ``name``, or None."""
    found = function(name)
    return None if found is None else ctypes.cast(found, ctypes.c_void_p).value
