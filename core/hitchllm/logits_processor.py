"""The logits-processor seam: batched edits of the logits before sampling.

A ``LogitsProcessor`` is built once per engine (from the ``hitchllm_logits_processors`` hook).
Each step, for the logits rows of the requests that use it, ``prepare`` runs on the host and
returns a ``LogitsEdit``; the sampler applies every edit to the ``[N, V]`` float32 logits after
the raw logprobs are taken and before min_tokens, penalties, temperature and the top-k / top-p /
min-p filters. A step in which no request uses a processor calls nothing.

Rules an implementation keeps:

- ``prepare`` may do host work (a grammar's token mask, a list of banned ids) and copy its
  result to the device with ``host_to_device``; it must never read a device tensor back.
- A ``LogitsEdit`` is tensor code: it returns a new tensor and leaves its input unchanged.
- ``prepare`` runs on the engine loop; ``compile`` also runs in a worker thread before the
  request reaches the loop (``AsyncLLMEngine``), so slow per-request work belongs there.

Speculative decoding: a request with drafts ``d_0..d_{k-1}`` owns ``k + 1`` rows; row ``j`` is
sampled as if ``d_0..d_{j-1}`` were already output, so ``LogitsRow.output_token_ids`` ends
with those ``j`` drafts and ``LogitsRow.num_draft_tokens`` is ``j``. A processor edits each row
for that hypothetical output; the core's rejection sampling stays exact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hitchllm.sampling_params import SamplingParams

LogitsEdit = Callable[[torch.Tensor], torch.Tensor]
"""``edit(logits) -> logits``: ``[N, V]`` float32 in, a new ``[N, V]`` tensor out."""


@dataclass(frozen=True)
class LogitsRow:
    """One logits row of a step, as a processor sees it.

    ``index`` is the row in the step's ``[N, V]`` logits. ``output_token_ids`` is the
    request's output so far followed by the ``num_draft_tokens`` drafts this row assumes
    accepted (see the module docstring).
    """

    index: int
    request_id: str
    params: SamplingParams
    output_token_ids: Sequence[int]
    num_draft_tokens: int = 0


class LogitsProcessor(ABC):
    """A batched logits transform for the requests whose ``SamplingParams`` ask for it."""

    #: True when a row's edit depends on the request's latest output tokens (a grammar, banned
    #: word endings). The engine then does not launch a step before the previous step's tokens
    #: are on the host (no overlap with async scheduling for such requests).
    needs_output_tokens: bool = True
    #: The ``SamplingParams`` fields this processor implements. A request that sets a field
    #: only a plugin implements (``structured_outputs``) is rejected when no installed
    #: processor provides it, with the name of the plugin to install.
    provides: tuple[str, ...] = ()

    @abstractmethod
    def is_used_by(self, params: SamplingParams) -> bool:
        """Whether a request with ``params`` uses this processor (cheap; called once per
        request when it is added)."""

    def compile(self, params: SamplingParams) -> None:  # noqa: B027
        """Check a request that uses this processor and do its slow preparation (e.g. compile
        a grammar), caching the result; raise ``ValueError`` saying what to change to reject
        the request (nothing is queued then).

        Called for each request when it is added, on the engine loop, where it should be
        quick: ``AsyncLLMEngine`` calls it first in a worker thread (possibly several at
        once, so keep it thread-safe), and the call on the loop then finds the cache warm.
        """

    def remove_requests(self, request_ids: Sequence[str]) -> None:  # noqa: B027
        """Forget finished or aborted requests (ids this processor may never have seen).

        Called at the start of the step after they finished, before that step's ``prepare``;
        an id may already belong to a new request by then, so create per-request state
        lazily in ``prepare`` rather than when the request is added.
        """

    @abstractmethod
    def prepare(self, rows: list[LogitsRow], vocab_size: int, device: torch.device) -> LogitsEdit:
        """Return the edit for this step's ``rows`` (only rows of requests that use this
        processor; never empty). Runs on the host; must not read device tensors."""


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for the device (a pinned, non-blocking copy on
    CUDA; ``host`` itself elsewhere)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
