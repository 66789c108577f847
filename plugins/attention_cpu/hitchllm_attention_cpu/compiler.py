"""Builds the C kernel with the machine's C compiler on first use, and loads it with ctypes.

The shared library is cached under ``$HITCHLLM_CACHE_DIR/cpu_attn`` (default
``~/.cache/hitchllm/cpu_attn``), named by a hash of the source, the compiler, its flags and the
CPU, so a changed kernel, compiler or machine builds afresh while every later process loads the
existing file in milliseconds. Builds write a temporary file and rename it into place, so
processes building at once never load a half-written library.

Flags: ``-O3`` with the floating-point relaxations that let reductions vectorize, but not
``-ffast-math``, which on some compilers links startup code that flushes denormals for the whole
process. ``-march=native`` and ``-fopenmp`` are tried first and dropped where the compiler
rejects them (Apple's clang has no OpenMP: the kernel then runs on one thread).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("paged_attention.c")
SYMBOL = "hitch_paged_attention"
_FLAGS = [
    "-O3", "-std=c11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-ffinite-math-only",
    "-ffp-contract=fast",
]
# Tried in order; the first set the compiler accepts is used.
_OPTIONAL_FLAGS = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_double,
             ctypes.c_double, _I, ctypes.c_int, ctypes.c_int]


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded; the message says what to install or set."""


@dataclass(frozen=True)
class CompiledKernel:
    """The loaded kernel: ``function`` is ``hitch_paged_attention`` (see paged_attention.c)."""

    path: Path
    flags: tuple[str, ...]
    function: ctypes._CFuncPtr

    @property
    def openmp(self) -> bool:
        return "-fopenmp" in self.flags


def cache_dir() -> Path:
    """Where compiled kernels are kept."""
    root = os.environ.get("HITCHLLM_CACHE_DIR")
    if root:
        return Path(root) / "cpu_attn"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "hitchllm" / "cpu_attn"


def find_compiler() -> str:
    """The C compiler to use: ``$CC``, else the first of cc, gcc, clang on the PATH."""
    named = os.environ.get("CC")
    if named:
        found = shutil.which(named)
        if found is None:
            raise KernelBuildError(f"CC={named!r} is not an executable on the PATH; point CC at "
                                   "a C compiler or unset it")
        return found
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    raise KernelBuildError("no C compiler found (install one, e.g. `apt install gcc` or "
                           "`xcode-select --install`, or point CC at one)")


@functools.cache
def load_kernel() -> CompiledKernel:
    """The kernel, built on the first call of this process if the cache has no copy."""
    compiler = find_compiler()
    version = _compiler_version(compiler)
    source = SOURCE.read_bytes()
    errors = []
    for optional in _OPTIONAL_FLAGS:
        flags = (*_FLAGS, *optional)
        name = f"paged_attention-{_digest(source, compiler, version, flags)}{_suffix()}"
        path = cache_dir() / name
        if path.exists():
            return CompiledKernel(path, flags, _load(path))
        function, error = _build(compiler, flags, path)
        if function is not None:
            return CompiledKernel(path, flags, function)
        errors.append(f"{' '.join(optional) or 'plain'}: {error}")
    raise KernelBuildError(f"{compiler} could not build {SOURCE.name}: " + " | ".join(errors))


def _build(
    compiler: str, flags: tuple[str, ...], path: Path
) -> tuple[ctypes._CFuncPtr | None, str]:
    """Compile to a temporary file, load it, and only then move it to ``path``: the kernel,
    or None and the compiler's (or loader's) first error line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise KernelBuildError(f"cannot create the kernel cache {path.parent} ({err}); set "
                               "HITCHLLM_CACHE_DIR to a writable directory") from err
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=path.suffix)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "error" in line.lower()]
            return None, (lines or done.stderr.splitlines() or ["failed"])[0].strip()
        try:
            function = _load(Path(tmp))
        except KernelBuildError as err:
            return None, str(err)
        os.replace(tmp, path)  # the loaded mapping survives the rename
        return function, ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> ctypes._CFuncPtr:
    try:
        library = ctypes.CDLL(str(path))
    except OSError as err:
        raise KernelBuildError(f"cannot load {path} ({err}); delete it to rebuild") from err
    function = getattr(library, SYMBOL)
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelBuildError(f"cannot run the C compiler {compiler} ({err})") from err
    return done.stdout.splitlines()[0] if done.stdout else ""


def _digest(source: bytes, compiler: str, version: str, flags: tuple[str, ...]) -> str:
    """Names one build: the kernel, compiler and flags, and (for -march=native) the CPU."""
    h = hashlib.sha256(source)
    for part in (compiler, version, " ".join(flags), platform.machine(), _cpu_features()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _cpu_features() -> str:
    """The CPU's feature list where the OS shows one (Linux), else its model name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _suffix() -> str:
    return ".dylib" if sys.platform == "darwin" else ".so"
