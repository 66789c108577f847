"""A request as the scheduler and the KV cache manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hitchllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Blocks reserved, the prompt's KV on its way from another engine (``hitchllm.kv_transfer``).
    WAITING_FOR_REMOTE_KV = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # A step failed while this request ran alone (see ``LLMEngine.step``).
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        # ``_value_`` is the member's plain attribute; ``value`` goes through the enum's
        # descriptor, which costs more than this whole test (it runs per request and step).
        return self._value_ >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED._value_
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``all_token_ids`` is the prompt followed by every sampled token; ``num_computed_tokens``
    counts the leading tokens whose K/V are in the paged cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens that end the sequence unless ``ignore_eos`` (the tokenizer's EOS plus any extra
    # end-of-turn ids from generation_config.json).
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    # Requests with the same share key may share prompt blocks even when prefix caching is
    # off (the children of an n > 1 request).
    prefix_share_key: str | None = None
    # What the caller passed as ``lora_request`` (interpreted by the LoRA plugin); its
    # ``lora_name`` enters every block hash so adapters never share cached blocks.
    lora_request: Any = None
    # The logits processors (``hitchllm.logits_processor``) this request uses, chosen when it
    # is added; empty for most requests, which then skip that step of sampling entirely.
    logits_processors: list[Any] = field(default_factory=list)

    # Disaggregated serving (``hitchllm.kv_transfer``): what the caller passed as
    # ``kv_transfer_params`` (a consumer: where the producer's KV is; a producer:
    # ``{"do_remote_decode": True}``), and, on a producer, the params its output hands on.
    kv_transfer_params: dict[str, Any] | None = None
    kv_transfer_out: dict[str, Any] | None = None

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens sampled (or being sampled) on the device that the host has not seen yet.
    num_pending_tokens: int = 0
    # Draft tokens proposed by a speculative decoder for the next step, and the [k, V]
    # distribution they were drawn from (None: deterministic drafts); the runner uses the rows
    # of the drafts still in ``spec_token_ids`` (the scheduler may drop trailing ones).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_token_probs: torch.Tensor | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def lora_name(self) -> str | None:
        return getattr(self.lora_request, "lora_name", None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first ``num_output_tokens`` (a stop string ended the
        sequence in the middle of a step's tokens)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    @property
    def finished(self) -> bool:
        return self.status.finished
