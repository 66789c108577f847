"""Continuous batching under one token budget, with chunked prefill and preemption.

Each step assigns ``{request: num_new_tokens}`` under ``max_num_batched_tokens`` and
``max_num_seqs``. There are no separate prefill and decode phases: running requests are
served first (a decode is 1 token, or 1 + k with speculative drafts; an unfinished prefill
continues with as many tokens as the budget allows), then waiting requests are admitted, their
prompts split across steps when they do not fit the remaining budget.

Scheduling a request advances its ``num_computed_tokens`` at once, and each sampling row adds
one *pending* token (``Request.num_pending_tokens``): sampled on the device but not yet seen
by the host. ``update_from_output`` turns pending tokens into output tokens. Because the next
step may be scheduled before that happens, a decode step's input can be a pending token (the
model runner takes it from the device); see ``LLMEngine`` for that overlap.

When the KV cache runs out of blocks, a running request is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue (prefix caching usually makes the
recompute cheap). The victim is chosen by ``PreemptionPolicy`` among the running requests not
yet scheduled in the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.request import Request, RequestStatus
from hitchllm.scheduler.policy import PreemptionPolicy
from hitchllm.scheduler.stop import check_stop


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: PreemptionPolicy = PreemptionPolicy.FCFS


@dataclass
class SchedulerOutput:
    """One step's batch: requests in row order and how many new tokens each computes."""

    requests: list[Request]
    num_scheduled_tokens: list[int]
    # Per row: whether the row's last scheduled token is the request's newest token, so the
    # step samples for it (false for a chunk in the middle of a prompt).
    samples: list[bool]
    # Per row: tokens whose K/V were cached before this step (the requests' own counters
    # already include this step's tokens).
    num_computed_tokens: list[int] = field(default_factory=list)
    # Requests whose runner rows must be dropped before this step: finished or preempted
    # since the last step.
    released_ids: list[str] = field(default_factory=list)
    # Of those, the ones that finished (their per-request sampling state goes too).
    finished_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class SchedulerStats:
    """Counters for metrics and tests."""

    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._released: list[str] = []
        self._finished: list[str] = []

    # ---- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.config.policy.enqueue(self.waiting, request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests (abort, stop string found): free their blocks at once."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        self._released.append(request.request_id)
        self._finished.append(request.request_id)
        del self.requests[request.request_id]

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted_any = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_tokens_to_compute(request, budget)
            if num_new == 0:
                index += 1
                continue
            # Drafts that do not fit this step's budget are dropped, not split across steps.
            num_known = request.num_tokens - request.num_computed_tokens
            del request.spec_token_ids[max(0, num_new - num_known):]
            while not self.kv_cache.allocate_slots(request, num_new):
                # Only requests not yet scheduled this step may be preempted: blocks of a
                # scheduled one may already be shared with (and relied on by) this step.
                victim = self.config.policy.pick_victim(self.running[index:])
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            else:
                scheduled[request] = num_new
                budget -= num_new
                index += 1

        # Admitting new work right after a preemption would only thrash the cache.
        while (
            not preempted_any
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            else:  # every prompt position needs its logits: no prefix-cache hit
                hit_blocks, num_hit = [], 0
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_cache.allocate_slots(request, num_new, hit_blocks):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_hit
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new

        requests = list(scheduled)
        counts = [scheduled[r] for r in requests]
        computed = [r.num_computed_tokens for r in requests]
        samples = [c + n >= r.num_tokens + r.num_pending_tokens
                   for r, c, n in zip(requests, computed, counts)]
        for request, num_new, sample in zip(requests, counts, samples):
            request.num_computed_tokens += num_new
            request.num_pending_tokens += sample
        released, self._released = self._released, []
        finished, self._finished = self._finished, []
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        return SchedulerOutput(requests, counts, samples, computed, released, finished)

    def _num_tokens_to_compute(self, request: Request, budget: int) -> int:
        if request.num_pending_tokens and self._ends_by_length(request):
            return 0  # its pending token is its last: nothing more to compute
        remaining = (request.num_tokens + request.num_pending_tokens
                     + len(request.spec_token_ids) - request.num_computed_tokens)
        room = self.config.max_model_len - request.num_computed_tokens
        return max(0, min(remaining, budget, room))

    def _ends_by_length(self, request: Request) -> bool:
        """True when the request's pending tokens reach max_tokens or max_model_len."""
        max_tokens = request.sampling_params.max_tokens
        pending = request.num_pending_tokens
        return ((max_tokens is not None and request.num_output_tokens + pending >= max_tokens)
                or request.num_tokens + pending >= self.config.max_model_len)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.config.policy.enqueue(self.waiting, request, front=True)
        self._released.append(request.request_id)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Append the step's sampled tokens, finish requests that stop.

        ``sampled`` maps request id to the tokens accepted for it this step (one token, or
        more with speculative decoding). A request preempted since the step was scheduled
        still gets its token (it was sampled from a complete context); an aborted one does
        not. Returns the requests that got new tokens.
        """
        updated = []
        for request, sample in zip(output.requests, output.samples):
            if not sample:
                continue
            request.num_pending_tokens -= 1
            tokens = sampled.get(request.request_id)
            if request.finished or not tokens:
                continue
            if request.status == RequestStatus.RUNNING:
                # Rejected drafts were computed but are not part of the sequence: their K/V
                # will be overwritten. ``tokens`` holds the accepted drafts plus one new token.
                request.num_computed_tokens -= len(request.spec_token_ids) - (len(tokens) - 1)
            request.spec_token_ids = []
            for token in tokens:
                request.append_output_token(token)
                status = check_stop(request, self.config.max_model_len)
                if status is not None:
                    if request.status == RequestStatus.RUNNING:
                        self.running.remove(request)
                    else:
                        self.waiting.remove(request)
                    self._finish(request, status)
                    break
            updated.append(request)
        return updated
