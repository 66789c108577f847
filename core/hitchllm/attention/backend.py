"""The attention API every backend implements.

Four roles:

- ``Attention`` (hitchllm.attention.layer): what a model calls, backend-agnostic.
- ``AttentionBackend``: a stateless class describing one kernel family: its name, priority,
  what it can serve (``validate``), its KV-cache shape, and its impl and builder classes.
- ``AttentionImpl``: runs the kernel for one layer: writes the new K/V through the slot
  mapping, then attends.
- ``AttentionMetadataBuilder``: once per engine step, turns the batch description
  (``CommonAttentionMetadata``) into what its kernel needs.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hitchllm.attention.kv_cache_spec import KVCacheKind, KVCacheSpec


@dataclass(frozen=True)
class AttentionSpec:
    """Everything a backend needs to know to decide whether it can serve a model on a device."""

    device_type: str
    dtype: torch.dtype
    # The dtype the cache stores: the model's, or fp8 (torch.float8_e4m3fn / float8_e5m2)
    # with per-layer scales (see ``AttentionImpl.k_scale``).
    kv_cache_dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    device_capability: tuple[int, int] | None = None
    # Multi-head latent attention: then ``head_size`` is the latent width the cache stores per
    # token (kv_lora_rank + rope dim) and ``num_kv_heads`` is 1.
    use_mla: bool = False
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    @classmethod
    def for_device(cls, device: torch.device, **fields: Any) -> AttentionSpec:
        """Build a spec filling ``device_type`` and ``device_capability`` from ``device``."""
        capability = None
        if device.type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
        return cls(device_type=device.type, device_capability=capability, **fields)


@dataclass
class CommonAttentionMetadata:
    """The batch of one engine step, as flat tensors, handed to a backend's builder.

    Requests are rows ``0..num_reqs-1``; their new tokens are packed back to back, request
    ``i`` owning tokens ``query_start_loc[i]:query_start_loc[i+1]``. ``seq_lens[i]`` is the
    request's context length after this step (cached tokens plus new ones). Device tensors
    have a ``_cpu`` twin where builders commonly need host values.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, host
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32, host: tokens already cached
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device; -1 = padding, not written
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    # Host copy of the block table's first ceil(max_seq_len / block_size) columns for the real
    # requests (padding requests of a CUDA-graph batch have no row), for builders that plan
    # on the host (FlashInfer's page lists). None when the caller has none.
    block_table_cpu: torch.Tensor | None = None
    # True when this batch is captured into, or replayed from, a CUDA graph (see
    # ``CudaGraphSupport``): then the device tensors above are views of buffers that stay in
    # place for the engine's lifetime, ``num_reqs`` counts padding requests too (query length
    # 1, ``seq_lens`` 0, slot -1), and ``max_seq_len`` is the engine's ``max_model_len``, an
    # upper bound rather than this step's value.
    cuda_graph: bool = False


class CudaGraphSupport(enum.Enum):
    """Whether a backend's kernels can be captured into CUDA graphs, and for which batches."""

    #: Never captured: every step runs eagerly.
    NEVER = "never"
    #: Batches where every request has exactly one new token (decode steps) are captured at a
    #: ladder of batch sizes and replayed. The backend's builder must then keep every device
    #: tensor its metadata references in persistent buffers (allocated once, updated in place
    #: by each ``build`` with ``common.cuda_graph`` set), and its impl may allocate only
    #: through PyTorch's caching allocator (``torch.empty``), never read device values back to
    #: the host, and launch the same kernels with the same arguments for a given padded batch
    #: size whatever the values in the buffers.
    UNIFORM_DECODE = "uniform_decode"
    #: As ``UNIFORM_DECODE``, and also batches where every request has the same number of new
    #: tokens (speculative verification: each request's newest token plus its K drafts), which
    #: are captured per query length as well. The builder's metadata for such a batch must
    #: depend only on the padded batch size and the query length.
    UNIFORM_BATCH = "uniform_batch"


class AttentionImpl(ABC):
    """Runs one layer's attention with one kernel family.

    ``k_scale`` and ``v_scale`` are the layer's fp8 KV-cache scales (float32 scalars on the
    device, stored value = K / k_scale), bound by the ``Attention`` layer; a backend that
    accepts an fp8 ``kv_cache_dtype`` divides by them on write and multiplies on read.
    """

    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, spec: AttentionSpec
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.spec = spec

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Write ``key``/``value`` ([num_tokens, num_kv_heads, head_size]) into ``kv_cache``
        through the slot mapping (skipping slots of -1), then attend ``query``
        ([num_tokens, num_heads, head_size]) over each request's cached context with causal
        masking. Returns [num_tokens, num_heads, head_size]."""


class AttentionMetadataBuilder(ABC):
    """Builds a backend's per-step metadata; one instance per engine, reused every step."""

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Turn the step's batch into the metadata the backend's impl consumes."""


class AttentionBackend(ABC):
    """A kernel family: stateless, described by class attributes and class methods.

    ``name`` is upper case (``"TORCH"``, ``"TRITON_ATTN"``, ...). Among backends whose
    ``validate`` returns no reasons, the highest ``priority`` wins; ties break by name.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    #: Which batches the engine may capture into CUDA graphs with this backend.
    cuda_graph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER
    #: Whether the impl reads a batch's sequence lengths, block table, query start locations
    #: and slot mapping only from ``CommonAttentionMetadata``'s device tensors when it runs
    #: (nothing derived from them on the host but a launch configuration that depends on the
    #: batch's shape). Then one graph may run several decode steps, advancing the positions,
    #: sequence lengths and slots on the device between them (the speculative drafter's
    #: multi-step draft graphs).
    reads_batch_on_device: ClassVar[bool] = False
    #: Query lengths whose steps make the impl choose kernels of their own (tiles sized to a
    #: short query, say; one length for each group it treats alike, prompts included). At
    #: start-up on CUDA the engine runs an eager step of each, its longest query that long
    #: beside a decoding request, so that those kernels compile then and not on the first
    #: request's step (``ModelRunner.warm_up``).
    warm_up_query_lens: ClassVar[tuple[int, ...]] = ()

    @classmethod
    @abstractmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        """Reasons this backend cannot serve ``spec`` (empty list: it can).

        Each reason should say what to change, e.g. "head size 96 is not supported (use one
        of 64, 128, 256)" or "flashinfer is not installed (pip install ...)".
        """

    @classmethod
    @abstractmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor holding ``num_blocks`` blocks."""

    @classmethod
    def get_kv_cache_shape_for_spec(cls, num_blocks: int, kv_spec: KVCacheSpec) -> tuple[int, ...]:
        """Shape of the cache tensor of a layer that declares ``kv_spec``; the engine
        allocates it in ``kv_spec.dtype``. The default serves keys and values through
        ``get_kv_cache_shape``; a backend whose layout depends on more of the spec (an MLA
        backend's one latent vector per token) overrides this instead."""
        if kv_spec.kind is KVCacheKind.MLA_LATENT:
            raise ValueError(f"{cls.name} declares no layout for an MLA latent cache "
                             "(an MLA backend overrides get_kv_cache_shape_for_spec)")
        return cls.get_kv_cache_shape(num_blocks, kv_spec.block_size, kv_spec.num_kv_heads,
                                      kv_spec.head_size)

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        """The class that runs this backend's kernel for one layer."""

    @classmethod
    @abstractmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The class that builds this backend's per-step metadata."""
