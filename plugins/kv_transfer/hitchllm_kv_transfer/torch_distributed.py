"""``torch_distributed``: KV pages sent point to point with torch.distributed, GPU to GPU.

Each tensor-parallel rank ``r`` of the producer pairs with rank ``r`` of the consumer in a
process group of two of its own (NCCL on CUDA, gloo on CPU), met through a ``TCPStore`` the
producer's rank opens at ``host:port + r``; the engines' own tensor-parallel groups are not
touched. A saved request's pages stay in the producer's device memory (a gathered copy: the
blocks themselves are free again) until the consumer asks for them: the consumer writes the
request id under the next sequence number in the store, the producer answers with a header
(found or not) and the pages, and the consumer receives them straight into device memory.

Why torch.distributed: NCCL moves device memory over NVLink or the network without a copy
through the host, and it ships with PyTorch, so there is nothing else to install (NIXL or
Mooncake would add RDMA transports without the NCCL group's rendezvous, at the price of a
dependency). Transfers of one pair run one at a time, in the consumer's order.

Options (``kv_connector_extra_config``): ``host`` (the producer's address, default
127.0.0.1), ``port`` (default 14579; rank ``r`` uses ``port + r``), ``backend`` (``nccl`` or
``gloo``; default nccl with CUDA, else gloo), ``ttl_s`` (how long the producer keeps pages no
consumer asked for, default 120), ``max_staged_gib`` (the most device memory the producer's
pages may hold while they wait for the consumer, default 2; a save beyond it is not made, and
the consumer computes that prompt itself).

The producer waits for its consumer for as long as it runs (the consumer may start, or come
back, at any time); until one is there, pages expire after ``ttl_s`` as always.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hitchllm.kv_transfer import KVLoad, KVSave, KVTransferConfig
from hitchllm_kv_transfer.background import BackgroundConnector, _nbytes, side_stream
from hitchllm_kv_transfer.options import check_options

_OPTIONS = {"host": str, "port": int, "backend": str, "ttl_s": (int, float),
            "max_staged_gib": (int, float)}
DEFAULT_PORT = 14579
_FOUND, _MISSING = 1, 0
# How often the producer looks for the consumer's next request in the store.
POLL_S = 0.001
# The store key a consumer sets once it is connected; the producer meets it then.
_HELLO = "consumer-here"

logger = logging.getLogger(__name__)


class TorchDistributedConnector(BackgroundConnector):
    """KV pages over a two-process torch.distributed group (NCCL between GPUs)."""

    name = "torch_distributed"
    replicas_may_share = False  # one producer, one consumer, one address

    def __init__(self, config: KVTransferConfig, engine_id: str, rank: int,
                 world_size: int) -> None:
        options = config.kv_connector_extra_config
        self.host = options.get("host", "127.0.0.1")
        self.port = int(options.get("port", DEFAULT_PORT)) + rank
        self.backend = options.get("backend") or ("nccl" if torch.cuda.is_available()
                                                   else "gloo")
        self.ttl_s = float(options.get("ttl_s", 120))
        self.max_staged_bytes = int(float(options.get("max_staged_gib", 2)) * 2**30)
        self.is_producer = config.kv_role == "producer"
        self._group: Any = None
        self._store: dist.TCPStore | None = None
        self._seq = 0
        self._staged: dict[str, tuple[list[torch.Tensor], float]] = {}
        self._staged_bytes = 0  # of pages gathered and not yet sent or dropped
        self._refused: dict[str, float] = {}  # saves not made (over max_staged_gib)
        self._staged_lock = threading.Condition()
        super().__init__(config, engine_id, rank, world_size)
        if self.is_producer:
            try:  # listen now: a port in use is a start-up error, not a silent serve thread
                self._store = dist.TCPStore(
                    self.host, self.port, 2, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=config.kv_load_timeout_s))
            except Exception as exc:
                super().close()
                raise ValueError(
                    f"the torch_distributed KV connector cannot listen on {self.host}:"
                    f"{self.port} ({exc}); give kv_connector_extra_config.port a free port "
                    "(rank r listens on port + r)") from exc
            self._server = threading.Thread(target=self._serve, daemon=True,
                                            name="hitchllm-kv-serve")
            self._server.start()

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        options = config.kv_connector_extra_config
        check_options(cls.name, options, _OPTIONS)
        if options.get("backend", "nccl") not in ("nccl", "gloo"):
            raise ValueError(f"kv_connector_extra_config.backend must be nccl or gloo, got "
                             f"{options['backend']!r}")
        if not 0 < options.get("port", DEFAULT_PORT) < 65536:
            raise ValueError(f"kv_connector_extra_config.port {options['port']} is not a port")
        if options.get("max_staged_gib", 1) <= 0:
            raise ValueError("kv_connector_extra_config.max_staged_gib must be positive")

    @classmethod
    def transfer_params(cls, config: KVTransferConfig, engine_id: str) -> dict[str, Any]:
        options = config.kv_connector_extra_config
        return {"host": options.get("host", "127.0.0.1"),
                "port": int(options.get("port", DEFAULT_PORT))}

    # ---- the pair's group --------------------------------------------------------------------

    def _connect(self) -> None:
        """Meet the peer; the producer is rank 0 of the pair. The producer's store opens at
        once and it waits for a consumer (expiring pages meanwhile) until one says hello or
        the connector closes; a consumer gives up after ``kv_load_timeout_s`` (its load falls
        back) and tries again with its next load."""
        if self._group is not None:
            return
        timeout = timedelta(seconds=self.config.kv_load_timeout_s)
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, 2, is_master=self.is_producer,
                                        timeout=timeout, wait_for_workers=False)
        if self.is_producer:
            while not self._store.check([_HELLO]):
                if self._closed.wait(POLL_S * 10):
                    raise ConnectionAbortedError("the connector closed")
                self._drop_expired()
        else:
            self._store.set(_HELLO, self.engine_id)
        store = dist.PrefixStore("hitchllm-kv", self._store)
        rank = 0 if self.is_producer else 1
        if self.backend == "nccl":
            self._group = dist.ProcessGroupNCCL(store, rank, 2)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        # One element each way opens NCCL's point-to-point communicator now (seconds), not on
        # the first request's pages.
        self._p2p(torch.zeros(1), send=self.is_producer)

    # ---- producer ------------------------------------------------------------------------------

    def save(self, save: KVSave) -> None:
        """Gather the pages unless they would take the staged pages past ``max_staged_gib``."""
        size = sum(shape.numel() * dtype.itemsize
                   for shape, dtype in self.page_shapes(len(save.block_ids)))
        with self._staged_lock:
            refuse = self._staged_bytes + size > self.max_staged_bytes
            if refuse:
                self._refused[save.request_id] = time.monotonic()
                self._staged_lock.notify_all()
            else:
                self._staged_bytes += size
        if refuse:
            logger.warning("request %s: not saving its KV (%.0f MiB): %.0f MiB already wait for "
                           "the consumer (max_staged_gib=%g); the consumer computes the prompt",
                           save.request_id, size / 2**20, self._staged_bytes / 2**20,
                           self.max_staged_bytes / 2**30)
            self._report_saved(save.request_id)
            return
        try:
            super().save(save)
        except BaseException:
            with self._staged_lock:
                self._staged_bytes -= size
            raise

    def _send(self, save: KVSave, pages: list[torch.Tensor]) -> None:
        """Stage the pages until the consumer asks (``_serve`` sends them)."""
        with self._staged_lock:
            self._staged[save.request_id] = (pages, time.monotonic())
            self._staged_lock.notify_all()

    def _serve(self) -> None:
        """Answer the consumer's requests, in its order, for as long as the engine runs. A
        failed answer is logged (the consumer's load fails and falls back); serving goes on."""
        while not self._closed.is_set():
            try:
                self._connect()
                break
            except ConnectionAbortedError:
                return
            except Exception:  # the pair's group could not form: try again with the next hello
                logger.exception("the KV connector's group with the consumer at %s:%d failed "
                                 "to form", self.host, self.port)
                self._group = None
                if self._store is not None:
                    self._store.delete_key(_HELLO)
                if self._closed.wait(1.0):
                    return
        assert self._store is not None
        while not self._closed.is_set():
            key = f"want/{self._seq}"
            if not self._store.check([key]):  # nothing asked yet
                self._drop_expired()
                self._closed.wait(POLL_S)
                continue
            rid = self._store.get(key).decode()
            self._store.delete_key(key)
            self._seq += 1
            try:
                self._answer(rid)
            except Exception:
                logger.exception("request %s: sending its KV to the consumer failed", rid)

    def _answer(self, request_id: str) -> None:
        pages = self._take_staged(request_id)
        header = torch.tensor([_FOUND if pages is not None else _MISSING,
                               len(pages or [])], dtype=torch.int64)
        try:
            with side_stream(self.kv_caches[0].device if self.kv_caches else None):
                self._p2p(header, send=True)
                for page in pages or []:
                    self._p2p(page, send=True)
                if pages and pages[0].is_cuda:  # the pages may go once they are sent
                    torch.cuda.current_stream().synchronize()
        finally:
            if pages:
                self._release(pages)

    def _take_staged(self, request_id: str) -> list[torch.Tensor] | None:
        """The request's pages; waits a little for a save still on its way (None at once for
        a save that was not made)."""
        deadline = time.monotonic() + self.config.kv_load_timeout_s
        with self._staged_lock:
            while request_id not in self._staged:
                left = deadline - time.monotonic()
                if self._refused.pop(request_id, None) is not None:
                    return None
                if left <= 0 or self._closed.is_set():
                    return None
                self._staged_lock.wait(min(left, 0.5))
            return self._staged.pop(request_id)[0]

    def _release(self, pages: list[torch.Tensor]) -> None:
        with self._staged_lock:
            self._staged_bytes -= _nbytes(pages)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        with self._staged_lock:
            for rid in [r for r, (_, t) in self._staged.items() if now - t > self.ttl_s]:
                self._staged_bytes -= _nbytes(self._staged.pop(rid)[0])
            for rid in [r for r, t in self._refused.items() if now - t > self.ttl_s]:
                del self._refused[rid]

    # ---- consumer ------------------------------------------------------------------------------

    def _try_receive(self, load: KVLoad) -> list[torch.Tensor] | None:
        params = load.params
        if (params["host"], int(params["port"]) + self.rank) != (self.host, self.port):
            raise ValueError(f"the producer is at {params['host']}:{params['port']}, this "
                             f"consumer's connector pairs with {self.host}:"
                             f"{self.port - self.rank}")
        device = self.kv_caches[0].device
        self._connect()
        assert self._store is not None
        self._store.set(f"want/{self._seq}", params["remote_request_id"])
        self._seq += 1
        header = torch.zeros(2, dtype=torch.int64)
        self._p2p(header, send=False)
        if int(header[0]) != _FOUND:
            raise LookupError(f"the producer holds no KV for request "
                              f"{params['remote_request_id']!r} (expired, or never saved)")
        num_blocks = -(-load.num_tokens // int(params["block_size"]))
        shapes = self.page_shapes(num_blocks)
        if int(header[1]) != len(shapes):
            raise ValueError(f"the producer sends {int(header[1])} layers, this engine has "
                             f"{len(shapes)}")
        pages = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        for page in pages:
            self._p2p(page, send=False)
        return pages

    def _p2p(self, tensor: torch.Tensor, send: bool) -> None:
        """Send to or receive from the peer; gloo moves host tensors, NCCL device ones."""
        peer = 1 if self.is_producer else 0
        on_wire = tensor
        if self.backend == "nccl" and not tensor.is_cuda:
            on_wire = tensor.cuda()
        elif self.backend == "gloo" and tensor.is_cuda:
            on_wire = tensor.cpu()
        if send:
            self._group.send([on_wire], peer, 0).wait()
        else:
            self._group.recv([on_wire], peer, 0).wait()
            if on_wire is not tensor:
                tensor.copy_(on_wire)

    def close(self) -> None:
        super().close()
        if self.is_producer:
            self._server.join(timeout=2)
