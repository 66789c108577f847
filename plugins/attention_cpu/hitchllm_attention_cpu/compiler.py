"""Builds the plugin's C code with the machine's C compiler on first use, and loads it with
ctypes: the attention kernel (paged_attention.c, ``load_kernel``), the fused elementwise
functions (fused_ops.c, ``load_fused_ops``), the AMX linear kernel (amx_linear.c,
``load_amx_linear``) and the decode layer that calls them (decode_layer.c,
``load_decode_layer``), one shared library each.

Each shared library is cached under ``$HITCHLLM_CACHE_DIR/cpu_attn`` (default
``~/.cache/hitchllm/cpu_attn``, or a per-user folder in the system's temporary directory when
that cannot be written), named by a hash of the source, the compiler, its flags and the CPU, so
a changed kernel, compiler or machine builds afresh while every later process loads the
existing file in milliseconds; a cached file that no longer loads is rebuilt. Builds write a
temporary file and rename it into place, so processes building at once never load a
half-written library.

Flags: the attention kernel ``-O3`` with the floating-point relaxations that let reductions
vectorize, but not ``-ffast-math``, which on some compilers links startup code that flushes
denormals for the whole process; the fused functions, whose results must round as PyTorch's do,
``-O3`` with no contraction into fused multiply-adds and no reassociation. ``-march=native`` and
``-fopenmp`` are tried first and dropped where the compiler rejects them (Apple's clang has no
OpenMP: the code then runs on one thread).
"""

from __future__ import annotations

import ctypes
import functools
import getpass
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
SYMBOL = "hitch_paged_attention"
# Its variant that computes the units a shared cursor hands out (decode_layer.c's helper).
CLAIM_SYMBOL = "hitch_paged_attention_claim"
_FLAGS = [
    "-O3", "-std=c11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-ffinite-math-only",
    "-ffp-contract=fast",
]
FUSED_SOURCE = Path(__file__).with_name("fused_ops.c")
# IEEE arithmetic as written (each product and sum rounded on its own), as PyTorch computes.
FUSED_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
               "-ffp-contract=off"]
# Tried in order; the first set the compiler accepts is used.
_OPTIONAL_FLAGS = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])
# The attention kernel's loops over a block's 16 scores (maximum, exponentials, their sum) in
# one 16-float vector rather than GCC's default two of 8 on AVX-512 CPUs: 15-30% faster at the
# bundled model's decode shape (head size 32). Compilers that reject it get the sets above.
_ATTENTION_OPTIONAL_FLAGS = (["-march=native", "-mprefer-vector-width=512", "-fopenmp"],
                             *_OPTIONAL_FLAGS)
_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_double,
             ctypes.c_double, _I, ctypes.c_int, _P, _P, ctypes.c_int]
# fused_ops.c's functions and their arguments (each returns an int status).
FUSED_SYMBOLS = {
    "hitch_rms_norm": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, _INT, _INT],
    "hitch_silu_and_mul": [_P, _I, _P, _I, _I, _INT, _INT, _INT],
    "hitch_rotary": [_P, _P, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _P, _F, _INT,
                     _INT],
    "hitch_write_kv": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I],
    "hitch_set_sum_lanes": [_INT],
    "hitch_silu_exp_lanes": [],
    "hitch_set_silu_exp": [_P, _I],
}
AMX_SOURCE = Path(__file__).with_name("amx_linear.c")
# Included by every source above.
NUMERICS_HEADER = Path(__file__).with_name("cpu_numerics.h")
# amx_linear.c's functions and their arguments (each returns an int status).
AMX_SYMBOLS = {
    "hitch_amx_init": [],
    "hitch_amx_linear": [_P, _I, _I, _I, _P, _I, _P, _INT],
}
DECODE_LAYER_SOURCE = Path(__file__).with_name("decode_layer.c")
# decode_layer.c's function and its arguments (returns an int status).
DECODE_LAYER_SYMBOLS = {"hitch_decode_layer": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _INT]}


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded; the message says what to install or set."""


@dataclass(frozen=True)
class CompiledKernel:
    """The loaded kernel: ``function`` is ``hitch_paged_attention``, ``claim``
    ``hitch_paged_attention_claim`` (see paged_attention.c)."""

    path: Path
    flags: tuple[str, ...]
    function: ctypes._CFuncPtr
    claim: ctypes._CFuncPtr

    @property
    def openmp(self) -> bool:
        return "-fopenmp" in self.flags


@dataclass(frozen=True)
class CompiledFusedOps:
    """A loaded library's functions by name (``FUSED_SYMBOLS``, ``AMX_SYMBOLS``)."""

    path: Path
    flags: tuple[str, ...]
    functions: dict[str, ctypes._CFuncPtr]


def cache_dir() -> Path:
    """Where compiled kernels are kept (see ``_writable_cache_dir`` for the fallback)."""
    root = os.environ.get("HITCHLLM_CACHE_DIR")
    if root:
        return Path(root) / "cpu_attn"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "hitchllm" / "cpu_attn"


def find_compiler() -> list[str]:
    """The compiler's command line: ``$CC`` (which may carry a wrapper, ``ccache gcc``), else
    the first of cc, gcc, clang on the PATH."""
    named = shlex.split(os.environ.get("CC", ""))
    if named:
        found = shutil.which(named[0])
        if found is None:
            raise KernelBuildError(f"CC={named[0]!r} is not an executable on the PATH; point "
                                   "CC at a C compiler or unset it")
        return [found, *named[1:]]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise KernelBuildError("no C compiler found (install one, e.g. `apt install gcc` or "
                           "`xcode-select --install`, or point CC at one)")


@functools.cache
def load_kernel() -> CompiledKernel:
    """The attention kernel, built on the first call of this process if the cache has no
    copy."""
    path, flags, library = _library(SOURCE, _FLAGS, _ATTENTION_OPTIONAL_FLAGS)
    return CompiledKernel(path, flags, _function(library, SYMBOL, _ARGTYPES),
                          _function(library, CLAIM_SYMBOL, [*_ARGTYPES[:-1], _P]))


@functools.cache
def load_fused_ops() -> CompiledFusedOps:
    """The fused elementwise functions, built on the first call of this process if the cache
    has no copy."""
    path, flags, library = _library(FUSED_SOURCE, FUSED_FLAGS)
    return CompiledFusedOps(path, flags, {name: _function(library, name, argtypes)
                                          for name, argtypes in FUSED_SYMBOLS.items()})


@functools.cache
def load_amx_linear() -> CompiledFusedOps:
    """The AMX linear kernel (amx_linear.c), built on the first call of this process if the
    cache has no copy; its functions return -1 where the compiler did not target AMX."""
    path, flags, library = _library(AMX_SOURCE, FUSED_FLAGS)
    return CompiledFusedOps(path, flags, {name: _function(library, name, argtypes)
                                          for name, argtypes in AMX_SYMBOLS.items()})


@functools.cache
def load_decode_layer() -> CompiledFusedOps:
    """The decode layer's driver (decode_layer.c), built on the first call of this process if
    the cache has no copy."""
    path, flags, library = _library(DECODE_LAYER_SOURCE, [*FUSED_FLAGS, "-pthread"])
    return CompiledFusedOps(path, flags, {name: _function(library, name, argtypes)
                                          for name, argtypes in DECODE_LAYER_SYMBOLS.items()})


def _library(
    source_path: Path, base_flags: list[str],
    optional_flags: tuple[list[str], ...] = _OPTIONAL_FLAGS,
) -> tuple[Path, tuple[str, ...], ctypes.CDLL]:
    """``source_path`` built with ``base_flags`` and the first of ``optional_flags`` the
    compiler takes (a cached build first): its path, flags and the loaded library."""
    compiler = find_compiler()
    version = _compiler_version(compiler)
    # The shared header is part of every build's name: a change there rebuilds them all.
    source = source_path.read_bytes() + b"\0" + NUMERICS_HEADER.read_bytes()
    folder = _writable_cache_dir()
    builds = [(flags, folder / f"{source_path.stem}-{_digest(source, compiler, version, flags)}"
               f"{_suffix()}") for flags in ((*base_flags, *extra) for extra in optional_flags)]
    # A build cached earlier wins, so a compiler that rejects the first flag sets (no OpenMP)
    # is not asked again by every process.
    for flags, path in builds:
        if path.exists():
            try:
                return path, flags, _loaded(compiler, source_path, flags, _load(path))
            except KernelBuildError:
                path.unlink(missing_ok=True)  # damaged or from another machine: build afresh
    errors = []
    for flags, path in builds:
        library, error = _build(compiler, source_path, flags, path)
        if library is not None:
            return path, flags, _loaded(compiler, source_path, flags, library)
        errors.append(f"{' '.join(flags[len(base_flags):]) or 'plain'}: {error}")
    raise KernelBuildError(f"{' '.join(compiler)} could not build {source_path.name}: "
                           + " | ".join(errors))


def _loaded(
    compiler: list[str], source: Path, flags: tuple[str, ...], library: ctypes.CDLL
) -> ctypes.CDLL:
    if "-fopenmp" not in flags:
        logger.warning("%s has no OpenMP: %s runs on one thread (a compiler with -fopenmp, "
                       "e.g. gcc, uses them all)", compiler[0], source.name)
    return library


def _writable_cache_dir() -> Path:
    """``cache_dir()``, or (when it cannot be written and HITCHLLM_CACHE_DIR is not set) a
    per-user folder in the system's temporary directory."""
    preferred = cache_dir()
    folders = [preferred]
    if not os.environ.get("HITCHLLM_CACHE_DIR"):
        folders.append(Path(tempfile.gettempdir()) / f"hitchllm-{_user()}" / "cpu_attn")
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK | os.X_OK):
            if folder != preferred:
                logger.warning("the kernel cache %s cannot be written; using %s (set "
                               "HITCHLLM_CACHE_DIR to choose)", preferred, folder)
            return folder
    raise KernelBuildError(f"cannot write the kernel cache {preferred}; set HITCHLLM_CACHE_DIR "
                           "to a writable directory")


def _build(
    compiler: list[str], source: Path, flags: tuple[str, ...], path: Path
) -> tuple[ctypes.CDLL | None, str]:
    """Compile to a temporary file, load it, and only then move it to ``path`` (so another
    process never loads a half-written file): the library, or None and the first error."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=path.suffix)
    except OSError as err:
        return None, f"cannot write to {path.parent} ({err})"
    os.close(fd)
    try:
        try:
            done = subprocess.run([*compiler, *flags, str(source), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            return None, f"the compiler did not run to completion ({err})"
        if done.returncode != 0:
            return None, _first_error(done.stderr)
        os.chmod(tmp, 0o755)  # mkstemp made it private; the cache may be shared
        try:
            library = _load(Path(tmp))
        except KernelBuildError as err:
            return None, str(err)
        os.replace(tmp, path)  # the loaded mapping survives the rename
        return library, ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _first_error(stderr: str) -> str:
    """The line of a compiler's output that says what went wrong (not the linker driver's
    closing "collect2: error: ld returned 1")."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()
              and not line.startswith(("collect2", "clang: error: linker command"))]
    return (errors or lines or ["failed with no message"])[0]


def _load(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        raise KernelBuildError(f"cannot load {path} ({err})") from err


def _function(library: ctypes.CDLL, name: str, argtypes: list[type]) -> ctypes._CFuncPtr:
    try:
        function = getattr(library, name)
    except AttributeError as err:
        raise KernelBuildError(f"{library._name} has no function {name}") from err
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def _compiler_version(compiler: list[str]) -> str:
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelBuildError(f"cannot run the C compiler {' '.join(compiler)} ({err})") from err
    return done.stdout.splitlines()[0] if done.stdout else ""


def _digest(source: bytes, compiler: list[str], version: str, flags: tuple[str, ...]) -> str:
    """Names one build: the kernel, compiler and flags, and (for -march=native) the CPU."""
    h = hashlib.sha256(source)
    for part in (" ".join(compiler), version, " ".join(flags), platform.machine(),
                 _cpu_features()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _cpu_features() -> str:
    """The CPU's feature list where the OS shows one (Linux), else its model name (macOS's
    brand string, or what Python knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
    return platform.processor()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (some containers)
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


def _suffix() -> str:
    return ".dylib" if sys.platform == "darwin" else ".so"
