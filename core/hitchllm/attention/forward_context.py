"""The per-step state an ``Attention`` layer reads: the backend's metadata for this batch.

The model runner sets it around each forward pass, so models never pass attention metadata
through their call signatures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """What attention layers need during one forward pass."""

    attn_metadata: Any


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` visible to every ``Attention`` layer for the enclosed forward."""
    global _current
    previous, _current = _current, ForwardContext(attn_metadata)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress."""
    if _current is None:
        raise RuntimeError(
            "Attention layer called outside a forward pass: the model runner must wrap the "
            "model call in hitchllm.attention.set_forward_context(...)"
        )
    return _current
