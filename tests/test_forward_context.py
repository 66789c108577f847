"""The forward context is per thread: each engine runs its CPU forwards on a worker thread
of its own, and a forward on one thread must keep its batch while another thread's forward
starts and ends (a process-wide context lost it: the CI failure this test reproduces)."""

from __future__ import annotations

import threading

import pytest

from hitchllm.attention.forward_context import get_forward_context, set_forward_context


def test_a_forward_keeps_its_context_while_another_thread_enters_and_leaves():
    b_entered, a_left = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def forward_a() -> None:
        with set_forward_context("batch A"):
            assert b_entered.wait(10)
        a_left.set()  # A's forward ends while B's is still running

    def forward_b() -> None:
        with set_forward_context("batch B"):
            b_entered.set()
            assert a_left.wait(10)
            seen["b"] = get_forward_context().attn_metadata

    threads = [threading.Thread(target=forward_a), threading.Thread(target=forward_b)]
    threads[0].start()
    threads[1].start()
    for thread in threads:
        thread.join(10)
    assert seen == {"b": "batch B"}


def test_nested_contexts_restore_the_outer_one_and_none_outside():
    with set_forward_context("outer"):
        with set_forward_context("inner"):
            assert get_forward_context().attn_metadata == "inner"
        assert get_forward_context().attn_metadata == "outer"
    with pytest.raises(RuntimeError, match="outside a forward pass"):
        get_forward_context()
