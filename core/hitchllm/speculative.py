"""The draft-proposer protocol for speculative decoding.

A speculative-decoding plugin returns ``Proposer`` subclasses from the
``hitchllm_speculative_proposers`` hook. After every engine step the engine hands the proposer
a ``ProposalBatch`` (the requests that sampled a token in that step and keep decoding) and
gets back a ``Proposal``: up to ``max_num_drafts`` draft tokens per request and, optionally,
the distribution each draft was sampled from. The next step computes the drafts together with
the request's newest token and the core's rejection sampler verifies them, so the output
distribution is the target model's whatever the drafts are:

- draft ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, where ``p_j`` is
  the target's distribution at that position exactly as the sampler computes it (after logits
  processors, penalties, temperature, top-k / top-p / min-p) and ``q_j`` the draft's;
- at the first rejection the emitted token is sampled from ``normalize(max(0, p_j - q_j))``
  and the remaining drafts are dropped; when all drafts are accepted, one more token is sampled
  from the target at the position after the last draft;
- greedy requests accept a draft exactly when it is the target's argmax.

Without ``probs`` a draft is verified as a point mass (accepted with probability ``p_j(d_j)``,
else ``p_j`` without ``d_j`` is sampled). The output is exact either way; what ``probs`` buys a
proposer that samples its drafts is acceptance: ``sum_x min(p_j(x), q_j(x))`` instead of
``sum_x p_j(x) q_j(x)`` (for ``q = p``, 1 instead of ``sum_x p_j(x)^2``). Give the distribution
the drafts were really drawn from: ``probs`` that do not match how the drafts were chosen (a
greedy draft with a smoothed ``q``) bias the output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from hitchllm.config import EngineConfig
    from hitchllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    """One request to draft for.

    ``token_ids`` is the request's whole sequence, prompt then output (the newest token, sampled
    in the step just completed, is last and its K/V is not cached yet). It is the engine's own
    list: read it during ``propose``, never modify or keep it.
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # Drafts beyond this many are dropped: num_speculative_tokens, capped so that the request
    # stays within max_tokens and max_model_len; at least 1 (a request that may take no
    # drafts is not asked).
    max_num_drafts: int
    # The request's sampling parameters, for a proposer that samples its drafts the way the
    # target samples (temperature, top-k / top-p / min-p, seed). Read-only, like token_ids.
    sampling_params: SamplingParams | None = None


@dataclass(frozen=True)
class ProposalBatch:
    """What a proposer gets after a step.

    ``hidden_states`` is set only for a proposer whose ``needs_hidden_states`` is true: a
    ``[len(requests), hidden_size]`` tensor on the engine's device, row ``i`` the target model's
    final hidden state (the input of its LM head) at the position that produced request
    ``i``'s newest token. Its dtype is the model's.
    """

    requests: list[DraftRequest]
    hidden_states: torch.Tensor | None = None


@dataclass(frozen=True)
class Draft:
    """Draft tokens for one request, and optionally the distribution they were drawn from.

    ``probs`` is a ``[len(token_ids), vocab_size]`` float tensor: row ``j`` the probabilities
    ``q_j`` from which ``token_ids[j]`` was sampled (rows sum to 1). It should live on the
    engine's device; leave it ``None`` when the drafts are a deterministic function of the
    context (n-gram lookup, a greedy draft model).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class Proposal:
    """A proposer's answer: request id -> its drafts. A request left out gets none."""

    drafts: dict[str, Draft] = field(default_factory=dict)


class Proposer(ABC):
    """Base class of a speculative-decoding proposer (see the module docstring).

    Built once per engine as ``cls(engine_config)``; ``engine_config.num_speculative_tokens``
    says how many drafts per step are wanted. ``propose`` runs on the engine loop between steps,
    so what it spends delays the next step; it may run a draft model on the engine's device.
    """

    # A model-based proposer (EAGLE-style heads, Medusa) sets this to receive the target's
    # hidden states; the engine keeps them only then.
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config

    def bind_target_model(self, model: torch.nn.Module) -> None:  # noqa: B027 (optional hook)
        """Called once by the engine right after construction, with the target model (weights
        loaded, on the engine's device) and before any ``propose``. A proposer that shares the
        target's layers (an EAGLE head uses its embedding and LM head) keeps them here and
        raises ``ValueError`` when it cannot work with this target. Does nothing by default."""

    def remove_requests(self, request_ids: list[str]) -> None:  # noqa: B027 (optional hook)
        """Forget requests that finished (stopped, aborted or failed). The engine calls this as
        they finish, before their ids can be reused, so a proposer that keeps per-request state
        (a draft model's KV-cache blocks) frees it here. Does nothing by default."""

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> Proposal:
        """Return drafts for (some of) ``batch.requests``; at most ``max_num_drafts`` each are
        used. A draft id outside the vocabulary ends that request's drafts there."""
