"""The cyclic garbage collector around the engine: paused while the engine is built, then
everything alive frozen out of its reach (a command's or the server's process), or kept out of
its reach while ``LLM`` runs a batch (``collector_off``, ``collector_skips_older_objects``).

Importing torch and transformers and building an engine allocate millions of objects that
live as long as the process. The collector, triggered by allocation counts, walked them again
and again: 0.4 s of the bundled model's 4 s start-up on a 2-core CPU (four full collections
took 0.29 s of it). Later, while serving, each full collection walked them once more: on the
CPU with a tiny model one took 0.5 s, a pause of every stream (docs/serving.md).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# A threshold of the oldest generation that is never reached: no full collection.
_NEVER = 2**31 - 1


@contextmanager
def collector_paused(process_exits_after: bool = False) -> Iterator[None]:
    """Run the block with the cyclic collector off until ``freeze_startup_objects`` (called
    once the engine is built) turns it on again; afterwards restore the collector's state.

    ``process_exits_after``: the block is the whole life of the process (a command run from
    the shell), so what was frozen stays frozen: unfrozen, the interpreter's exit would walk it
    all once more (0.6 s of ``hitchllm generate``'s exit measured). Otherwise (a test calling
    the command's ``main``) it is unfrozen, and the caller gets its collector back as it was.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not process_exits_after:
            gc.unfreeze()
        if enabled:
            gc.enable()
        else:
            gc.disable()


def freeze_startup_objects(collect: bool = True) -> None:
    """Move every object alive now (the model, the tokenizer, the app) out of the collector's
    reach and turn the collector on. ``collect``: collect the garbage first (a long-lived
    server), which costs a full walk of the objects (0.1-0.3 s on a small CPU); a command
    that exits soon skips it."""
    if collect:
        gc.collect()
    gc.freeze()
    gc.enable()


@contextmanager
def collector_off() -> Iterator[None]:
    """Run the block with the cyclic collector off, then restore its state (``LLM`` builds
    its engine so: the engine's new objects would otherwise trigger collections again and
    again). If the collector was on, the garbage is collected first: an earlier engine that
    is garbage in a reference cycle still holds its device memory (its KV cache), which the
    new engine's memory profile would count as its own."""
    enabled = gc.isenabled()
    if enabled:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def collector_skips_older_objects() -> Iterator[None]:
    """Run the block with every object alive now frozen out of the collector's reach, and
    thaw them afterwards, so a full collection during the block walks only what the block
    made (``LLM.generate``: one took 0.13-0.16 s of a 2.5-4 s CPU run, walking torch,
    transformers and the model). Freezing and thawing move whole lists (constant time).

    Where objects are frozen already (a command or the server froze its start-up objects, or
    the caller, a library or the environment froze some), thawing at the end would thaw
    theirs too: they are left alone, and the block runs with no full collection instead
    (``_full_collections_off``; the young generations are still collected). On the GPU
    machine 375 objects frozen before the script ran had turned the freeze off, and a full
    collection then walked everything: 0.41-0.46 s of the first ``generate`` on an H100
    (docs/performance.md). Garbage in reference cycles that lives long enough to reach the
    oldest generation then waits for the end of the block. Python 3.14's incremental
    collector ignores the oldest generation's threshold, and collects it a slice at a time
    instead."""
    if gc.get_freeze_count():
        with _full_collections_off():
            yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _FullCollectionsOff:
    """Holds the oldest generation's threshold out of reach while any block (in any thread)
    asks for it: the first to enter saves the threshold, the last to leave gives it back, so
    blocks of two threads that overlap without nesting restore it all the same."""

    def __init__(self) -> None:
        # Reentrant: a collection triggered while it is held may run finalizers that enter
        # (a nested block, since the count is taken before the thresholds are touched).
        self._lock = threading.RLock()
        self._holders = 0
        self._oldest = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            self._holders += 1
            if self._holders == 1:
                young, middle, self._oldest = gc.get_threshold()
                gc.set_threshold(young, middle, _NEVER)
        try:
            yield
        finally:
            with self._lock:
                if self._holders == 1:
                    young, middle, _ = gc.get_threshold()
                    gc.set_threshold(young, middle, self._oldest)
                self._holders -= 1


_full_collections_off = _FullCollectionsOff()
