"""What both connectors share: one background thread that sends saved pages and receives
loads into staging memory, and the bookkeeping the runner's calls read.

The runner's thread only gathers pages (``save``), registers loads (``start_load``), copies
staged pages into blocks (``finish_load``) and reads the news (``poll``); all waiting on the
transport happens in the background thread, so a slow or absent peer never stalls a step. On
a GPU the background thread's copies and transfers run on a side stream of their own
(``side_stream``), so that waiting for them never holds up the forward passes queued on the
default stream.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hitchllm.kv_transfer import (
    KVConnector,
    KVLoad,
    KVSave,
    KVTransferConfig,
    KVTransferEvents,
    KVTransferStats,
)

logger = logging.getLogger(__name__)

# How long the background thread sleeps when it has nothing to do but wait for loads.
IDLE_WAIT_S = 0.001


@dataclass
class _Load:
    load: KVLoad
    started: float
    arrived: threading.Event = field(default_factory=threading.Event)
    pages: list[torch.Tensor] | None = None


class BackgroundConnector(KVConnector):
    """A connector whose transport runs in one background thread; subclasses implement
    ``_send`` and ``_try_receive``."""

    def __init__(self, config: KVTransferConfig, engine_id: str, rank: int,
                 world_size: int) -> None:
        super().__init__(config, engine_id, rank, world_size)
        self._lock = threading.Lock()
        self._saves: queue.Queue[tuple[KVSave, list[torch.Tensor], Any, float]] = queue.Queue()
        self._loads: dict[str, _Load] = {}
        self._events = KVTransferEvents()
        self._stats = KVTransferStats()
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hitchllm-kv-{self.name}",
                                        daemon=True)
        self._thread.start()

    # ---- the runner's calls ----------------------------------------------------------------

    def save(self, save: KVSave) -> None:
        pages = self.gather_blocks(save.block_ids)
        ready = None
        if pages and pages[0].is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._saves.put((save, pages, ready, time.monotonic()))
        self._wake.set()

    def _report_saved(self, request_id: str) -> None:
        """Tell the scheduler a save is over without sending anything (it was not made)."""
        with self._lock:
            self._events.saves_done.append(request_id)

    def start_load(self, load: KVLoad) -> None:
        with self._lock:
            self._loads[load.request_id] = _Load(load, time.monotonic())
        self._wake.set()

    def finish_load(self, request_id: str) -> None:
        with self._lock:
            entry = self._loads.get(request_id)
        if entry is None:
            raise RuntimeError(f"request {request_id}: no KV load under way to finish")
        if not entry.arrived.wait(self.config.kv_load_timeout_s):
            raise RuntimeError(f"request {request_id}: rank {self.rank} did not receive its KV "
                               f"within {self.config.kv_load_timeout_s:g} s of rank 0")
        with self._lock:
            del self._loads[request_id]
        if entry.pages is None:
            raise RuntimeError(f"request {request_id}: rank {self.rank}'s KV transfer failed")
        self.scatter_blocks(entry.load.block_ids, entry.pages)

    def cancel_load(self, request_id: str) -> None:
        with self._lock:
            self._loads.pop(request_id, None)

    def poll(self) -> KVTransferEvents:
        with self._lock:
            events, self._events = self._events, KVTransferEvents()
            events.stats = KVTransferStats(**vars(self._stats))
        return events

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5)

    # ---- the transport (background thread) -----------------------------------------------

    @abc.abstractmethod
    def _send(self, save: KVSave, pages: list[torch.Tensor]) -> None:
        """Send one request's pages (blocking)."""

    @abc.abstractmethod
    def _try_receive(self, load: KVLoad) -> list[torch.Tensor] | None:
        """The load's pages if they are here (None: not yet); raise when they never will be."""

    def _run(self) -> None:
        while not self._closed.is_set():
            device = self.kv_caches[0].device if self.kv_caches else None
            with side_stream(device):
                busy = self._send_queued()
                busy |= self._receive_pending()
            if not busy:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()

    def _send_queued(self) -> bool:
        busy = False
        while True:
            try:
                save, pages, ready, started = self._saves.get_nowait()
            except queue.Empty:
                return busy
            busy = True
            if ready is not None:
                ready.synchronize()
            try:
                self._send(save, pages)
            except Exception:  # a failed save fails the consumer's load, which falls back
                logger.exception("request %s: saving its KV failed", save.request_id)
                with self._lock:
                    self._events.saves_done.append(save.request_id)
                continue
            with self._lock:
                self._events.saves_done.append(save.request_id)
                self._stats.num_saves += 1
                self._stats.bytes_saved += _nbytes(pages)
                self._stats.save_seconds += time.monotonic() - started

    def _receive_pending(self) -> bool:
        with self._lock:
            pending = [e for e in self._loads.values() if not e.arrived.is_set()]
        busy = False
        for entry in pending:
            load = entry.load
            deadline = entry.started + self.config.kv_load_timeout_s
            try:
                pages = self._try_receive(load)
                if pages is not None and pages and pages[0].is_cuda:
                    torch.cuda.current_stream().synchronize()  # here before it is reported
                if pages is None and time.monotonic() > deadline:
                    raise TimeoutError(f"nothing arrived in {self.config.kv_load_timeout_s:g} s")
                if pages is not None:
                    self.check_pages(-(-load.num_tokens // self._block_size(load)), pages)
            except Exception as exc:
                self._finish(entry, None, f"{type(exc).__name__}: {exc}")
                busy = True
                continue
            if pages is not None:
                self._finish(entry, pages, None)
                busy = True
        return busy

    def _finish(self, entry: _Load, pages: list[torch.Tensor] | None, error: str | None) -> None:
        rid = entry.load.request_id
        with self._lock:
            entry.pages = pages
            entry.arrived.set()
            if error is not None:
                self._stats.num_failed_loads += 1
                self._events.loads_failed.append((rid, error))
                self._loads.pop(rid, None)
                return
            assert pages is not None
            self._stats.num_loads += 1
            self._stats.bytes_loaded += _nbytes(pages)
            self._stats.load_seconds += time.monotonic() - entry.started
            self._events.loads_ready.append(rid)

    @staticmethod
    def _block_size(load: KVLoad) -> int:
        return int(load.params["block_size"])


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def side_stream(device: torch.device | None) -> Iterator[None]:
    """Run the block's CUDA work on ``device`` and a stream of its own (nothing off CUDA)."""
    if device is None or device.type != "cuda":
        yield
        return
    torch.cuda.set_device(device)
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        yield


def _nbytes(pages: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in pages)
