"""The per-step state an ``Attention`` layer reads: the backend's metadata for this batch.

The model runner sets it around each forward pass, so models never pass attention metadata
through their call signatures. It is per thread: on the CPU each engine runs its forwards on a
worker thread of its own, and two engines in one process (or a step of a closed engine still
finishing) must not see each other's batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """What attention layers need during one forward pass.

    ``split_attention``, when set, is called by every core ``Attention`` layer in place of its
    attention, as ``split_attention(layer, q, k, v) -> output``: the engine's piecewise CUDA
    graphs end a captured piece there (``hitchllm.engine.piecewise_graphs``), and run a padded
    step's attention on its real rows (``layer.attend``)."""

    attn_metadata: Any
    split_attention: Callable[..., Any] | None = None


class _ThreadContext(threading.local):
    current: ForwardContext | None = None


_state = _ThreadContext()


@contextmanager
def set_forward_context(
    attn_metadata: Any, split_attention: Callable[..., Any] | None = None
) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` (and ``split_attention``, see ``ForwardContext``) visible to every
    ``Attention`` layer of the enclosed forward (on this thread)."""
    previous = _state.current
    _state.current = ForwardContext(attn_metadata, split_attention)
    try:
        yield _state.current
    finally:
        _state.current = previous


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress on this thread."""
    current = _state.current
    if current is None:
        raise RuntimeError(
            "Attention layer called outside a forward pass: the model runner must wrap the "
            "model call in hitchllm.attention.set_forward_context(...)"
        )
    return current
