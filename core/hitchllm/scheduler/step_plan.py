"""The step plan: what the scheduler tells the model runner(s) to do in one step.

Plain data only (ids, token ids, block ids, sampling parameters), so that a plan can be
pickled and sent to a worker process. The runner keeps its own state per request, built from
``NewRequestData`` when a request first runs (or runs again after preemption) and advanced by
the runner's own sampled tokens; it never sees the scheduler's ``Request`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hitchllm.kv_transfer.connector import KVLoad, KVSave
from hitchllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption
    (then ``output_token_ids`` holds what it had sampled before)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    # Whatever the caller passed as ``lora_request`` (the LoRA plugin reads it); it travels
    # with the plan, so a multiprocess executor needs it picklable.
    lora_request: Any = None


@dataclass
class StepPlan:
    """One step's batch, in row order.

    Row ``i`` is request ``request_ids[i]``: it computes ``num_scheduled_tokens[i]`` tokens
    starting at position ``num_computed_tokens[i]`` (the tokens whose K/V were cached before
    this step), gets ``new_block_ids[i]`` appended to its block table, and samples when
    ``samples[i]`` (false for a chunk in the middle of a prompt). A row's scheduled tokens
    past the tokens the runner knows are its drafts (``draft_token_ids``), then, in an
    overlapped step, the token the previous step is still sampling.
    """

    request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Requests of this step the runner has no state for (a subset of ``request_ids``).
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Draft tokens to verify this step, per request id (only requests that have drafts), and
    # the [num_drafts, vocab] distribution they were drawn from when the proposer gave one.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    # Requests whose runner state goes before this step: preempted (they come back as new
    # requests) or finished since the previous step.
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Copy-on-write: (source, destination) KV block ids to copy in every layer's cache, in
    # order, before this step's forward (a forked beam's first write into a shared block).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # KV transfer (disaggregated serving; ``hitchllm.kv_transfer.connector`` says the order
    # the runner's connector runs them in, before the forward): producer requests to save,
    # consumer loads to start, loads whose KV arrived to copy into their blocks, and loads to
    # drop. Empty on engines without a connector.
    kv_saves: list[KVSave] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_load_finishes: list[str] = field(default_factory=list)
    kv_load_cancels: list[str] = field(default_factory=list)

    # Swap preemption: (device block, host block) pairs to copy out to the host pool, then
    # (host block, device block) pairs to copy back in, in every layer's cache, before this
    # step's forward reads or writes the device blocks (the device blocks swapped out are
    # already free in the scheduler and may be reused by this very step). Every swap-out is
    # decided before every swap-in (preemptions come before admissions), so running all
    # swap-outs first reads each host and device block before it is written.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def has_kv_transfers(self) -> bool:
        return bool(self.kv_saves or self.kv_loads or self.kv_load_finishes
                    or self.kv_load_cancels)


    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids
