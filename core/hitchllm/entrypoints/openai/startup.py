"""What a serving process does once its engine is built, before it takes requests."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object alive now (the model, the tokenizer, the app) out of the garbage
    collector's reach. Otherwise each full collection while serving walks them all: on the
    CPU with a tiny model one took 0.5 s, a pause of every stream (docs/serving.md)."""
    gc.collect()
    gc.freeze()
