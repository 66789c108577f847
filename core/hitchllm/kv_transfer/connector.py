"""The KV connector interface, and what a step plan asks the runner's connector to do.

A connector lives beside each model runner (one per tensor-parallel rank, each moving its
own shard of every layer's cache). The scheduler decides *what* moves and *when*; the runner
calls the connector at the start of each step, before the forward, in this order:

1. ``cancel_load`` for every request that finished, was preempted, or whose load the
   scheduler gave up on (timeout, failure): what is received for it later is dropped;
2. ``finish_load`` for every request whose KV the scheduler saw arrive: copy it into the
   request's blocks now (the step may already compute the request's next token);
3. ``save`` for every finished producer request: copy its blocks' KV out *during the call*
   (stream-ordered on a GPU) and send it asynchronously. The scheduler frees the blocks right
   after this step's plan, so nothing may read them later;
4. ``start_load`` for every request the scheduler reserved blocks for: start receiving,
   asynchronously, into the connector's own staging memory;
5. ``poll``: the saves done and the loads that arrived (or failed) since the last step, and
   the counters. The engine reads tensor-parallel rank 0's answer; it keeps stepping until
   every save it planned is reported done (or ``kv_load_timeout_s`` passed).

Cache writes therefore happen only inside steps, in plan order: a block freed on abort or
timeout can never be written by a late transfer, and every rank writes the same blocks in
the same step.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hitchllm.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from hitchllm.plugins import PluginRegistry
    from hitchllm.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSave:
    """Save the KV of a producer request's first ``num_tokens`` tokens, held in
    ``block_ids`` (the request's leading blocks)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True)
class KVLoad:
    """Receive the KV of a consumer request's first ``num_tokens`` tokens, to go into
    ``block_ids`` (reserved for it); ``params`` are the producer's transfer params."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    params: dict[str, Any]


@dataclass
class KVTransferStats:
    """A connector's running totals (this rank's share of the bytes)."""

    num_saves: int = 0
    bytes_saved: int = 0
    # From ``save`` until the KV is out of this process (written, sent).
    save_seconds: float = 0.0
    num_loads: int = 0
    bytes_loaded: int = 0
    # From ``start_load`` until the KV is here (includes waiting for the producer).
    load_seconds: float = 0.0
    num_failed_loads: int = 0


@dataclass
class KVTransferEvents:
    """A connector's news since its last ``poll``: saves whose KV is out of this process
    (sent, or failed and logged), loads that arrived, loads that failed (request id, why), and
    its totals."""

    saves_done: list[str] = field(default_factory=list)
    loads_ready: list[str] = field(default_factory=list)
    loads_failed: list[tuple[str, str]] = field(default_factory=list)
    stats: KVTransferStats = field(default_factory=KVTransferStats)


class KVConnector(abc.ABC):
    """Moves KV blocks between engines. Subclasses name themselves in ``name`` and are
    listed by a plugin's ``hitchllm_kv_connectors``.

    Constructed once per runner as ``cls(config, engine_id, rank, world_size)``: ``engine_id``
    is unique per engine (the producer's goes into its transfer params, so that several
    producers can share a transport), ``rank`` the tensor-parallel rank. The runner then calls
    ``register_kv_caches`` (again after every re-allocation), then the per-step methods in
    the order the module docstring gives. ``close`` stops background work.
    """

    name: ClassVar[str]
    #: Whether several engines of one role may run with the same settings (data-parallel
    #: replicas behind one server). False for a transport that pairs one producer with one
    #: consumer at a fixed address: ``serve --data-parallel-size N`` then refuses to start.
    replicas_may_share: ClassVar[bool] = True

    def __init__(self, config: KVTransferConfig, engine_id: str, rank: int,
                 world_size: int) -> None:
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.world_size = world_size
        self.kv_caches: list[torch.Tensor] = []
        self.block_dims: list[int] = []

    @classmethod  # noqa: B027 (no options to check by default)
    def check_config(cls, config: KVTransferConfig) -> None:
        """Refuse bad ``kv_connector_extra_config`` options at engine start-up with a
        ``ValueError`` that says what to change."""

    @classmethod
    @abc.abstractmethod
    def transfer_params(cls, config: KVTransferConfig, engine_id: str) -> dict[str, Any]:
        """Producer: what a consumer's connector needs to find this engine's saved KV (an
        address, a directory); JSON-serializable. Called in the engine's process."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dims: list[int]) -> None:
        """This rank's cache tensors, one per attention layer, and the dimension of each that
        indexes blocks."""
        self.kv_caches = kv_caches
        self.block_dims = block_dims

    @abc.abstractmethod
    def save(self, save: KVSave) -> None:
        """Producer: copy the KV of ``save.block_ids`` out now, and send it asynchronously."""

    @abc.abstractmethod
    def start_load(self, load: KVLoad) -> None:
        """Consumer: start receiving ``load``'s KV into staging memory; report it in ``poll``
        once here (or failed)."""

    @abc.abstractmethod
    def finish_load(self, request_id: str) -> None:
        """Consumer: copy a received request's KV into its blocks (on a rank other than 0,
        wait for it if it is not here yet)."""

    @abc.abstractmethod
    def cancel_load(self, request_id: str) -> None:
        """Forget a load (finished, aborted, given up on); a no-op for an unknown id."""

    @abc.abstractmethod
    def poll(self) -> KVTransferEvents:
        """Loads that arrived or failed since the last call, and the running totals."""

    def close(self) -> None:  # noqa: B027 (nothing to release by default)
        """Stop background threads and release what the connector holds."""

    # ---- helpers for subclasses ----------------------------------------------------------

    def gather_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of ``block_ids``' pages of every layer (block dimension first; bytes for
        fp8 caches), queued on the current stream."""
        if not self.kv_caches:
            return []
        ids = torch.tensor(block_ids, dtype=torch.int64).to(self.kv_caches[0].device)
        return [_raw(cache).index_select(dim, ids).movedim(dim, 0).contiguous()
                for cache, dim in zip(self.kv_caches, self.block_dims, strict=True)]

    def scatter_blocks(self, block_ids: list[int], pages: list[torch.Tensor]) -> None:
        """Write ``pages`` (as ``gather_blocks`` returns them, on any device) into
        ``block_ids`` of every layer; ``ValueError`` when their shapes do not fit."""
        self.check_pages(len(block_ids), pages)
        device = self.kv_caches[0].device
        ids = torch.tensor(block_ids, dtype=torch.int64).to(device)
        for cache, dim, page in zip(self.kv_caches, self.block_dims, pages, strict=True):
            raw = _raw(cache)
            raw.index_copy_(dim, ids, page.to(device, non_blocking=True).movedim(0, dim))

    def page_shapes(self, num_blocks: int) -> list[tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of each layer's pages for ``num_blocks`` blocks, as
        ``gather_blocks`` returns them."""
        shapes = []
        for cache, dim in zip(self.kv_caches, self.block_dims, strict=True):
            raw = _raw(cache)
            shape = list(raw.shape)
            del shape[dim]
            shapes.append((torch.Size([num_blocks, *shape]), raw.dtype))
        return shapes

    def check_pages(self, num_blocks: int, pages: list[torch.Tensor]) -> None:
        """``ValueError`` unless ``pages`` fit ``num_blocks`` blocks of this rank's caches."""
        want = self.page_shapes(num_blocks)
        got = [(p.shape, p.dtype) for p in pages]
        if got != want:
            raise ValueError(
                f"received KV pages do not fit this engine's cache: {len(got)} layers "
                f"{got[:1]} vs {len(want)} layers {want[:1]} (the producer must serve the same "
                "model with the same block_size, kv_cache_dtype and tensor_parallel_size)")


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """fp8 caches move as bytes (index kernels for fp8 are missing on some devices)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def connector_class(config: KVTransferConfig, registry: PluginRegistry) -> type[KVConnector]:
    """The connector class ``config.kv_connector`` names; ``ValueError`` listing the
    installed ones when no plugin provides it."""
    classes: dict[str, type[KVConnector]] = {}
    for result in reversed(registry.hook.hitchllm_kv_connectors()):
        classes.update(result or {})
    cls = classes.get(config.kv_connector)
    if cls is None:
        installed = ", ".join(sorted(classes)) or "none"
        raise ValueError(
            f"kv_connector {config.kv_connector!r} is not provided by any installed plugin; "
            f"installed: {installed} (pip install hitchllm-kv-transfer for shared_memory and "
            "torch_distributed)")
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise TypeError(f"kv_connector {config.kv_connector!r} maps to {cls!r}, which is not a "
                        "subclass of hitchllm.kv_transfer.KVConnector")
    cls.check_config(config)
    return cls


def run_kv_transfers(connector: KVConnector, plan: StepPlan) -> KVTransferEvents:
    """One step's connector calls, in the order the module docstring gives.

    A save that raises (device memory for the copy, a transport error) is logged and reported
    done: its request's consumer computes the prompt itself, and this engine goes on."""
    for rid in (*plan.finished_ids, *plan.preempted_ids, *plan.kv_load_cancels):
        connector.cancel_load(rid)
    for rid in plan.kv_load_finishes:
        connector.finish_load(rid)
    failed = []
    for save in plan.kv_saves:
        try:
            connector.save(save)
        except Exception:
            logger.exception("request %s: saving its KV failed; its consumer will compute the "
                             "prompt itself", save.request_id)
            failed.append(save.request_id)
    for load in plan.kv_loads:
        connector.start_load(load)
    events = connector.poll()
    events.saves_done.extend(failed)
    return events
