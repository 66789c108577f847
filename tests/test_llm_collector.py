"""``LLM`` and the cyclic garbage collector: the engine is built with the collector off, and a
batch runs with the objects alive before it frozen out of the collector's reach (so a full
collection in the middle of ``generate`` walks only what the batch made), thawed afterwards;
where objects are frozen already (by the caller, a command, a library) they stay as they were
and the batch runs with no full collection; the collector's state comes back whatever
happens."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable
from contextlib import ExitStack

import pytest

from hitchllm import LLM, SamplingParams
from hitchllm.beam_search import BeamSearchParams
from hitchllm.engine import llm_engine
from hitchllm.entrypoints import startup
from hitchllm.entrypoints.startup import collector_off, collector_skips_older_objects

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# Python 3.14's incremental collector ignores the oldest generation's threshold.
THRESHOLD_HOLDS = sys.version_info < (3, 14)
OLDEST_THRESHOLD = pytest.mark.skipif(not THRESHOLD_HOLDS,
                                      reason="the oldest generation's threshold is ignored")


@pytest.fixture
def clean_collector():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    yield
    gc.unfreeze()
    gc.enable()


class _Held:
    """Stands for an engine that is garbage in a reference cycle (and holds device memory)."""


def _garbage_cycle() -> weakref.ref:
    held = _Held()
    held.me = held
    return weakref.ref(held)


def test_engine_is_built_with_the_collector_off(monkeypatch, llama_path, clean_collector):
    seen = []
    real = llm_engine.LLMEngine.__init__

    def spy(self, config):
        seen.append((gc.isenabled(), garbage() is None))
        real(self, config)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", spy)
    garbage = _garbage_cycle()
    LLM(llama_path, dtype="float32")
    # Off while building, and the earlier garbage was collected before.
    assert seen == [(False, True)] and gc.isenabled()
    with pytest.raises(ValueError):
        LLM(llama_path, block_size=-1)
    assert gc.isenabled()  # given back when the build fails too
    gc.disable()
    garbage = _garbage_cycle()
    LLM(llama_path, dtype="float32")
    # A caller's "off" stays off, and nothing was collected behind its back.
    assert not gc.isenabled() and seen[-1] == (False, False)


def _read_during_batch(llm: LLM, read: Callable[[], int]) -> list[int]:
    """``read()`` at every request the engine takes in and every step it runs, in order."""
    seen: list[int] = []
    engine = llm.engine
    step, add_request = engine.step, engine.add_request

    def reading_step():
        seen.append(read())
        return step()

    def reading_intake(*args, **kwargs):
        seen.append(read())
        return add_request(*args, **kwargs)

    engine.step, engine.add_request = reading_step, reading_intake
    return seen


def test_generate_freezes_older_objects_for_the_batch_only(llama_path, clean_collector):
    llm = LLM(llama_path, dtype="float32")
    frozen_during = _read_during_batch(llm, gc.get_freeze_count)
    before = object()  # alive before the batch: frozen while it runs
    outs = llm.generate(["def f", "x = 1"], PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert len(frozen_during) > 2 and min(frozen_during) > 1000  # the intake's calls too
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    assert not gc.is_finalized(before)
    # Thawed: a cycle made before the batch is collected again afterwards.
    cycle: list = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_generate_leaves_a_callers_frozen_objects_alone(llama_path, clean_collector):
    llm = LLM(llama_path, dtype="float32")
    gc.freeze()
    frozen = gc.get_freeze_count()
    thresholds = gc.get_threshold()
    oldest_during = _read_during_batch(llm, lambda: gc.get_threshold()[2])
    # Not thawed by the batch (and nothing more frozen); a few frozen objects may be freed by
    # their reference counts meanwhile.
    llm.generate(["def f"], PARAMS, use_tqdm=False)
    assert frozen - 1000 < gc.get_freeze_count() <= frozen
    if THRESHOLD_HOLDS:
        # Instead, no full collection ran during the batch, its intake included: the oldest
        # generation's threshold was out of reach, and is back afterwards.
        assert len(oldest_during) >= 2 and min(oldest_during) >= 2**31 - 1
        assert gc.get_threshold() == thresholds
    # A prompt the engine refuses: the threshold comes back all the same.
    with pytest.raises(ValueError):
        llm.generate(["def f", {"prompt_token_ids": []}], PARAMS, use_tqdm=False)
    assert gc.get_threshold() == thresholds and not llm.engine.has_unfinished_requests()
    llm.beam_search([{"prompt_token_ids": [5, 17, 42]}],
                    BeamSearchParams(beam_width=2, max_tokens=3))
    assert frozen - 1000 < gc.get_freeze_count() <= frozen
    assert gc.get_threshold() == thresholds


@OLDEST_THRESHOLD
def test_a_few_frozen_objects_do_not_bring_back_full_collections(clean_collector):
    # A library froze a handful of objects: a full collection in the block would walk every
    # other object alive; none may run.
    gc.freeze()
    gc.collect()  # the oldest generation counts no survivors: its next full collection is due soon
    full = []

    def on_collect(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(info)

    gc.callbacks.append(on_collect)
    try:
        with collector_skips_older_objects():
            # Enough survivors to reach the oldest generation many times over.
            kept = [[] for _ in range(300_000)]
        assert not full and len(kept) == 300_000
        gc.collect()  # a positive control: the callback sees full collections
        assert full
    finally:
        gc.callbacks.remove(on_collect)


@OLDEST_THRESHOLD
def test_blocks_that_overlap_without_nesting_give_the_threshold_back(clean_collector):
    # Two threads' batches: the first ends while the second runs, the second ends last.
    gc.freeze()
    thresholds = gc.get_threshold()
    first, second = ExitStack(), ExitStack()
    try:
        first.enter_context(collector_skips_older_objects())
        second.enter_context(collector_skips_older_objects())
        first.close()
        assert gc.get_threshold()[2] == 2**31 - 1  # the second still holds them off
        gc.set_threshold(500, thresholds[1], gc.get_threshold()[2])  # set meanwhile: kept
        second.close()
        assert gc.get_threshold() == (500, *thresholds[1:])
    finally:
        first.close()
        second.close()
        gc.set_threshold(*thresholds)


@OLDEST_THRESHOLD
def test_a_finalizer_entering_while_the_threshold_changes_loses_nothing(
        clean_collector, monkeypatch):
    """A collection triggered inside the holder's own bookkeeping (here: as the last holder
    reads the thresholds to give the oldest back) may run a finalizer that runs a batch: the
    threshold that comes back is the process's, not the held one."""
    gc.freeze()
    thresholds = gc.get_threshold()
    reentered = []

    class Reentering:
        """``gc`` as seen by ``startup``, entering a block from its first threshold read."""

        def __getattr__(self, name):
            return getattr(gc, name)

        def get_threshold(self):
            if not reentered and gc.get_threshold()[2] == 2**31 - 1:  # the holder's exit
                reentered.append(True)
                with collector_skips_older_objects():
                    pass
            return gc.get_threshold()

    monkeypatch.setattr(startup, "gc", Reentering())
    try:
        with collector_skips_older_objects():
            assert gc.get_threshold()[2] == 2**31 - 1
        assert reentered and gc.get_threshold() == thresholds
    finally:
        gc.set_threshold(*thresholds)


def test_an_interrupt_during_intake_leaves_nothing_queued(llama_path, clean_collector):
    llm = LLM(llama_path, dtype="float32")
    gc.freeze()
    thresholds = gc.get_threshold()
    add_request = llm.engine.add_request
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return add_request(*args, **kwargs)

    llm.engine.add_request = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["def f", "x = 1", "y"], PARAMS, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert gc.get_threshold() == thresholds


def test_an_interrupt_after_the_engine_queued_a_prompt_leaves_nothing_queued(
        llama_path, clean_collector):
    """The interrupt lands once ``add_request`` has queued the second prompt, before its id
    returns: ``generate`` knew the id from before, so that request is aborted too."""
    llm = LLM(llama_path, dtype="float32", block_size=4)
    add_request = llm.engine.add_request
    calls = []

    def interrupted_on_return(*args, **kwargs):
        request_id = add_request(*args, **kwargs)
        calls.append(request_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return request_id

    llm.engine.add_request = interrupted_on_return
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["def f", "x = 1", "y"], PARAMS, use_tqdm=False)
    assert len(calls) == 2
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.output_processor.parents
    del llm.engine.add_request
    assert llm.generate("def f", PARAMS, use_tqdm=False)[0].finished  # the engine carries on


def test_a_failing_batch_thaws_and_frees_its_requests(llama_path, clean_collector):
    llm = LLM(llama_path, dtype="float32")

    def failing_step():
        raise RuntimeError("boom")

    llm.engine.step = failing_step
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["def f"], PARAMS, use_tqdm=False)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    assert not llm.engine.has_unfinished_requests()


def test_context_managers_restore_the_collector(clean_collector):
    with pytest.raises(KeyError), collector_off():
        assert not gc.isenabled()
        raise KeyError
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_skips_older_objects():
        assert gc.get_freeze_count() > 0
        raise KeyError
    assert gc.get_freeze_count() == 0
