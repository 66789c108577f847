"""Start-up of a command's process: the cyclic garbage collector paused while the engine is
built, then everything alive frozen out of its reach.

Importing torch and transformers and building an engine allocate millions of objects that
live as long as the process. The collector, triggered by allocation counts, walked them again
and again: 0.4 s of the bundled model's 4 s start-up on a 2-core CPU (four full collections
took 0.29 s of it). Later, while serving, each full collection walked them once more: on the
CPU with a tiny model one took 0.5 s, a pause of every stream (docs/serving.md).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
