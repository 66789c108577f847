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
    #: In a step padded for graph pieces, how many leading rows of the activations are real
    #: tokens (padding rows follow); None when every row is one. Hooks that gather statistics
    #: over the rows (fp8 KV-scale calibration) take only these.
    num_real_tokens: int | None = None


class _ThreadContext(threading.local):
    current: ForwardContext | None = None


_state = _ThreadContext()


@contextmanager
def set_forward_context(
    attn_metadata: Any, split_attention: Callable[..., Any] | None = None,
    num_real_tokens: int | None = None,
) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` (and ``split_attention``, ``num_real_tokens``: see
    ``ForwardContext``) visible to every ``Attention`` layer of the enclosed forward (on this
    thread)."""
    previous = _state.current
    _state.current = ForwardContext(attn_metadata, split_attention, num_real_tokens)
    try:
        yield _state.current
    finally:
        _state.current = previous


def current_split_attention() -> Callable[..., Any] | None:
    """The ``split_attention`` hook of the forward running on this thread (None: none, or no
    forward is running)."""
    current = _state.current
    return None if current is None else current.split_attention


def real_rows(x: Any) -> Any:
    """The rows of ``x`` (a tensor over the forward's tokens) that are real tokens: all of them
    unless a forward of a padded step is running on this thread (see ``num_real_tokens``)."""
    current = _state.current
    if current is None or current.num_real_tokens is None:
        return x
    return x[: current.num_real_tokens]


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress on this thread."""
    current = _state.current
    if current is None:
        raise RuntimeError(
            "Attention layer called outside a forward pass: the model runner must wrap the "
            "model call in hitchllm.attention.set_forward_context(...)"
        )
    return current
