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

When the KV cache runs out of blocks, a running request is preempted and goes back to the
front of the waiting queue. The victim is chosen by ``PreemptionPolicy`` among the running
requests not yet scheduled in the step. By recompute (``PreemptionMode``), its blocks are freed
and its tokens computed again when it resumes (prefix caching usually makes that cheap); by
swap, its blocks are copied to the host pool (``KVCacheManager.swap_out``, the copies go in the
plan's ``swap_out``) and its computed tokens stay computed: when it is admitted again its
blocks come back (``swap_in``) before its next step. A request the host pool cannot take is
recomputed instead.

With a KV connector (disaggregated serving, ``hitchllm.kv_transfer``), a producer keeps a
finished request's blocks until its KV is saved, and a consumer reserves blocks for a request's
incoming KV and holds it out of the queues until the KV is in (``KVTransferScheduling``); a
request whose KV is in holds its blocks, so it is admitted before the other waiting requests.

Admission gates (``hitchllm.scheduler.admission``) from plugins may hold a waiting request
back for a step (the LoRA plugin does while every adapter slot serves other adapters); the
requests behind it are admitted in its place.

When a step fails, the engine hands its requests to ``quarantine``: they are preempted and run
apart, half of them at a time, until each has sampled once on its own or has failed alone
(bisection: a request that breaks every batch it is in is found in about log2(batch) steps).
While a group of suspects is out, steps schedule only that group's requests.

Micro-batches (pipeline parallelism, ``SchedulerConfig.num_micro_batches`` = M > 1): the
engine keeps up to M steps in flight, each over its own requests, so that the pipeline stages
work on different steps at once. ``schedule(busy=...)`` then skips the requests of the steps
in flight (their next token is not known yet) and never preempts them (their step is still
writing into their blocks). Each step takes what is free, within these limits: the token
budget ``max_num_batched_tokens`` is each step's own (it bounds one forward on every stage);
one step schedules at most ``ceil(running / M)`` of the running requests and at most
``ceil(min(max_num_seqs, unfinished requests) / M)`` requests in all, so that the requests
spread over M micro-batches instead of the first step taking them all and the others finding
nothing free (also when the KV cache holds fewer requests than are waiting). ``max_num_seqs``
still bounds the running requests of all micro-batches together (every stage's runner holds
the state of each).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.kv_transfer.connector import KVTransferEvents
from hitchllm.kv_transfer.scheduling import KVTransferScheduling
from hitchllm.request import Request, RequestStatus
from hitchllm.scheduler.admission import AdmissionGate
from hitchllm.scheduler.policy import PreemptionPolicy
from hitchllm.scheduler.preemption import PreemptionMode, SwapCostModel
from hitchllm.scheduler.step_plan import NewRequestData, StepPlan
from hitchllm.scheduler.stop import check_stop


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: PreemptionPolicy = PreemptionPolicy.FCFS
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    # Steps the engine keeps in flight at once over disjoint requests (pipeline stages).
    num_micro_batches: int = 1

    def __post_init__(self) -> None:
        if self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={self.num_micro_batches} must be at least 1 "
                             "(the number of pipeline stages)")


@dataclass
class SchedulerStats:
    """Counters for metrics and tests."""

    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    # Speculative decoding: verifications of a request's drafts (one per request and step
    # that had drafts), the draft tokens verified, and those accepted.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # Prompt tokens scheduled for computation (prefix-cache hits and KV received from a
    # producer are not computed).
    num_prompt_tokens_computed: int = 0
    # Swap preemption: requests swapped out to and back in from the host pool, and requests
    # recomputed instead: preemptions that wanted to swap but found the host pool full, and
    # swapped-out requests turned into ones to recompute (after a failed step, or when the
    # device blocks they kept stopped every other request).
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swap_fallbacks: int = 0


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager."""

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager,
        on_finish: Callable[[list[str]], None] | None = None,
        gates: Iterable[AdmissionGate] = (),
        kv_transfer: KVTransferScheduling | None = None,
        swap_cost: SwapCostModel | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        if config.preemption_mode is not PreemptionMode.RECOMPUTE and kv_cache.host is None:
            raise ValueError(f"preemption_mode={config.preemption_mode.value} needs a host "
                             "pool: give the KV cache manager num_host_blocks (swap_space)")
        # ``auto``'s estimates (see ``SwapCostModel``).
        self.swap_cost = swap_cost or SwapCostModel()
        self.gates = list(gates)
        self.kv_transfer = kv_transfer
        # Told the id of every request as it finishes (the speculative proposer's
        # ``remove_requests``), whatever ended it.
        self.on_finish = on_finish
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._preempted: list[str] = []
        self._finished: list[str] = []
        # How many of each request's blocks the runner has been told of; a request missing
        # here is new to the runner (first scheduled, or scheduled again after preemption).
        self._blocks_sent: dict[str, int] = {}
        # Groups of requests to run apart after a failed step; the first group runs now.
        self._suspects: list[set[Request]] = []

    # ---- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.config.policy.enqueue(self.waiting, request)
        self.requests[request.request_id] = request

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add ``child``, whose tokens extend ``parent``'s (a beam), sharing ``parent``'s KV
        blocks (``KVCacheManager.fork``): it runs at once, computing only its new tokens.
        A parent that holds no blocks (preempted, or already finished) gives nothing to
        share: the child then queues and is computed from its prompt like any request.

        The parent must not be scheduled again while it shares its partial last block (beam
        search finishes every parent right after forking it): copy-on-write replaces blocks
        only of requests the runner has not been sent yet.
        """
        if parent.status != RequestStatus.RUNNING or not parent.num_computed_tokens:
            self.add_request(child)
            return
        self.kv_cache.fork(parent, child)
        self.requests[child.request_id] = child
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        for gate in self.gates:
            gate.admitted(child)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests (abort, stop string found): free their blocks at once."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.finished:
                continue
            self._dequeue(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running
                    or (self.kv_transfer is not None and self.kv_transfer.has_work()))

    def update_kv_transfers(self, events: KVTransferEvents) -> None:
        """The runner's KV-transfer news (loads arrived or failed): such requests wait again,
        first in the queue."""
        if self.kv_transfer is not None:
            for request in self.kv_transfer.update(events):
                self.config.policy.enqueue(self.waiting, request, front=True)

    def _dequeue(self, request: Request) -> None:
        """Take ``request`` out of its queue (running or waiting)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            for gate in self.gates:
                gate.released(request)
        elif request.status != RequestStatus.WAITING_FOR_REMOTE_KV:  # that one is in none
            self.waiting.remove(request)
        if self.kv_transfer is not None:
            self.kv_transfer.forget(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._clear_suspect(request)
        if self.kv_transfer is None or not self.kv_transfer.hold_for_save(request):
            self.kv_cache.free(request)
        self._blocks_sent.pop(request.request_id, None)
        self._finished.append(request.request_id)
        del self.requests[request.request_id]
        if self.on_finish is not None:
            self.on_finish([request.request_id])

    # ---- one step ----------------------------------------------------------------------

    def schedule(self, busy: Collection[Request] = ()) -> StepPlan:
        """Choose this step's batch. ``busy``: requests of steps still in flight (micro-batches,
        see the module doc), neither scheduled nor preempted by this step."""
        budget = self.config.max_num_batched_tokens
        max_running, max_rows = self._micro_batch_shares()
        scheduled: dict[Request, int] = {}
        preempted_any = False
        # After a failed step only the current group of suspects runs.
        allowed = self._suspects[0] if self._suspects else None
        if self.kv_transfer is not None:
            for request in self.kv_transfer.expire():
                self.config.policy.enqueue(self.waiting, request, front=True)

        index = 0
        while index < len(self.running) and budget > 0 and len(scheduled) < max_running:
            request = self.running[index]
            if (allowed is not None and request not in allowed) or request in busy:
                index += 1
                continue
            num_new = self._num_tokens_to_compute(request, budget)
            if num_new == 0:
                index += 1
                continue
            if request.spec_token_ids:
                # Drafts that do not fit this step's budget are dropped, not split across
                # steps.
                num_known = request.num_tokens - request.num_computed_tokens
                del request.spec_token_ids[max(0, num_new - num_known):]
            while not self.kv_cache.allocate_slots(request, num_new):
                if self._recompute_swapped_if_stuck(request):
                    continue  # blocks only swapped-out requests kept are free now
                # Only requests not yet scheduled this step may be preempted: blocks of a
                # scheduled one may already be shared with (and relied on by) this step.
                victim = self.config.policy.pick_victim(
                    [r for r in self.running[index:] if r not in busy])
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            else:
                scheduled[request] = num_new
                budget -= num_new
                index += 1

        # Admitting new work right after a preemption would only thrash the cache, unless
        # nothing is left to run: then the blocks that stopped the running requests are held
        # by waiting ones (a consumer's loaded requests), which only admission runs.
        stalled = preempted_any and not scheduled
        for request in [] if preempted_any and not stalled else (
                self._admission_candidates(allowed)):
            if (budget <= 0 or len(self.running) >= self.config.max_num_seqs
                    or len(scheduled) >= max_rows):
                break
            if not all(gate.may_admit(request) for gate in self.gates):
                continue  # it keeps its place; the requests behind it may go first
            if self.kv_transfer is not None and self.kv_transfer.wants_load(request):
                if not self.kv_transfer.reserve(request):
                    break
                self.waiting.remove(request)  # it waits for its KV outside the queues
                continue
            if self.kv_cache.is_swapped(request.request_id):
                num_new = self._swap_in(request, budget, allowed, busy)
                if num_new is not None:
                    if num_new:
                        scheduled[request] = num_new
                        budget -= num_new
                    continue
                if not self._recompute_swapped_if_stuck():
                    break  # running requests will free blocks
                # It is a request to recompute now, admitted like any.
            if self.kv_transfer is not None and self.kv_transfer.is_loaded(request):
                hit_blocks, num_hit = [], request.num_computed_tokens  # KV from a producer
            elif request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            else:  # every prompt position needs its logits: no prefix-cache hit
                hit_blocks, num_hit = [], 0
            num_new = min(request.num_tokens - num_hit, budget)
            if not self._allocate_for_admission(request, num_new, hit_blocks, allowed,
                                                busy) and not (
                    self._recompute_swapped_if_stuck()
                    and self._allocate_for_admission(request, num_new, hit_blocks, allowed,
                                                     busy)):
                break
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_hit
            self._start_running(request)
            scheduled[request] = num_new
            budget -= num_new

        plan = StepPlan()
        # One pass over the scheduled requests (it runs for every request and step).
        for request, num_new in scheduled.items():
            computed = request.num_computed_tokens
            sample = (computed + num_new
                      >= len(request.all_token_ids) + request.num_pending_tokens)
            num_prompt = len(request.prompt_token_ids)
            if computed < num_prompt:
                self.stats.num_prompt_tokens_computed += (
                    min(computed + num_new, num_prompt) - computed)
            request.num_computed_tokens = computed + num_new
            request.num_pending_tokens += sample
            plan.request_ids.append(request.request_id)
            plan.num_scheduled_tokens.append(num_new)
            plan.num_computed_tokens.append(computed)
            plan.samples.append(sample)
            self._plan_request(plan, request)
        plan.block_copies = self.kv_cache.take_block_copies()
        plan.swap_out, plan.swap_in = self.kv_cache.take_swaps()
        plan.preempted_ids, self._preempted = self._preempted, []
        plan.finished_ids, self._finished = self._finished, []
        if self.kv_transfer is not None:
            self.kv_transfer.fill_plan(plan)
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = self.num_waiting
        return plan

    @property
    def num_waiting(self) -> int:
        """Requests not running: those queued and those waiting for their KV (a consumer's,
        outside the queues)."""
        receiving = 0 if self.kv_transfer is None else len(self.kv_transfer.receiving)
        return len(self.waiting) + receiving

    def _micro_batch_shares(self) -> tuple[int, int]:
        """The most running requests one step schedules, and the most requests in all (the
        admitted ones included): with one micro-batch, every one it may; with M, an M-th
        (rounded up) of the running requests, and of the unfinished requests that may run at
        once. (When the KV cache holds fewer requests than are unfinished, the running ones
        still split over the micro-batches.)"""
        m = self.config.num_micro_batches
        if m == 1:
            return len(self.running), self.config.max_num_seqs
        unfinished = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return -(-len(self.running) // m), max(1, -(-unfinished // m))

    def _plan_request(self, plan: StepPlan, request: Request) -> None:
        """Add what the runner needs to know of a scheduled request beyond its row's counts:
        its data when it is new to the runner, its new blocks, its drafts (copies: the
        request's lists go on changing while the plan is in flight)."""
        rid = request.request_id
        blocks = self.kv_cache.get_block_ids(rid)
        sent = self._blocks_sent.get(rid)
        if sent is None:
            sent = 0
            plan.new_requests.append(NewRequestData(
                rid, request.prompt_token_ids, request.sampling_params, request.eos_token_ids,
                list(request.output_token_ids), request.lora_request))
        if sent == len(blocks):  # most decode steps: no new block
            plan.new_block_ids.append([])
        else:
            plan.new_block_ids.append(blocks[sent:])
            self._blocks_sent[rid] = len(blocks)
        if request.spec_token_ids:
            plan.draft_token_ids[rid] = list(request.spec_token_ids)
            if request.spec_token_probs is not None:
                plan.draft_probs[rid] = request.spec_token_probs[: len(request.spec_token_ids)]

    def _start_running(self, request: Request) -> None:
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        for gate in self.gates:
            gate.admitted(request)

    def _swap_in(self, request: Request, budget: int, allowed: set[Request] | None,
                 busy: Collection[Request]) -> int | None:
        """Admit a swapped-out request: its blocks come back and it resumes where it was.
        Returns its tokens to compute this step (0: not this step, it keeps its place), or
        None when its blocks do not fit (admission stops)."""
        if request.num_pending_tokens:
            return 0  # its last step's token is not back yet: resume once it is
        num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                      self.config.max_model_len - request.num_computed_tokens)
        if num_new <= 0:
            return 0
        while not self.kv_cache.swap_in(request, num_new):
            idle = [r for r in self.running
                    if allowed is not None and r not in allowed and r not in busy]
            if not idle:
                return None
            # Recomputed, never swapped: a plan's swap-outs all come before its swap-ins.
            self._preempt(self.config.policy.pick_victim(idle), may_swap=False)
        self.stats.num_swap_ins += 1
        self._start_running(request)
        return num_new

    def _recompute_swapped_if_stuck(self, request: Request | None = None) -> bool:
        """When nothing runs but ``request`` (so no other block will be freed) and a request
        does not fit (a waiting one, or ``request`` itself growing), the device blocks that
        swapped-out requests kept (shared when they were swapped out) may be what fills the
        cache: recompute every swapped-out request, freeing them. True if any kept one."""
        if any(r is not request for r in self.running) or not any(
                self.kv_cache.keeps_device_blocks(r.request_id) for r in self.waiting):
            return False
        self._recompute_swapped()
        return True

    def _recompute_swapped(self) -> None:
        """Turn every swapped-out request into one to recompute, freeing the device blocks
        they kept and their host blocks."""
        for request in self.waiting:
            if self.kv_cache.is_swapped(request.request_id):
                self.kv_cache.free(request)
                request.num_computed_tokens = 0
                self.stats.num_swap_fallbacks += 1

    def _admission_candidates(self, allowed: set[Request] | None) -> list[Request]:
        """The waiting requests that may be admitted, in queue order (a snapshot: admitting
        one changes the queue). While suspects run apart, only the current group's. Requests
        whose KV arrived from a producer come first: they hold their blocks already, so they
        need none to run, and a request ahead of them that needs their blocks would otherwise
        wait for them forever."""
        candidates = list(self.waiting) if allowed is None else [
            r for r in self.waiting if r in allowed]
        if self.kv_transfer is not None:
            candidates.sort(key=lambda r: not self.kv_transfer.is_loaded(r))  # stable
        return candidates

    def _allocate_for_admission(
        self, request: Request, num_new: int, hit_blocks: list, allowed: set[Request] | None,
        busy: Collection[Request],
    ) -> bool:
        """Allocate an admitted request's slots. While suspects run apart, requests outside
        the group (and outside steps in flight) do not run, so they give way (are preempted)
        when blocks run out."""
        while not self.kv_cache.allocate_slots(request, num_new, hit_blocks):
            idle = [r for r in self.running
                    if allowed is not None and r not in allowed and r not in busy]
            if not idle:
                return False
            # Recomputed, never swapped: a plan's swap-outs all come before its swap-ins.
            self._preempt(self.config.policy.pick_victim(idle), may_swap=False)
        return True

    # ---- isolating a failing request ---------------------------------------------------

    def quarantine(self, suspects: list[Request], bystanders: list[Request] = ()) -> None:
        """A step failed: preempt its requests and those of a dropped batch (``bystanders``)
        (their pending tokens are lost; they are recomputed), and run ``suspects`` apart in
        two halves, ahead of everything else."""
        live = [r for r in dict.fromkeys(suspects) if not r.finished]
        for request in [*live, *bystanders]:
            if request.finished:
                continue
            request.num_pending_tokens = 0
            request.spec_token_ids = []
            # Their K/V may come from the failed step: never swapped, always recomputed.
            if request.status == RequestStatus.RUNNING:
                self._preempt(request, may_swap=False)
        # The failed step may not have made its swap-out copies: no host copy is trusted.
        self._recompute_swapped()
        for request in live:
            self._clear_suspect(request)
        half = (len(live) + 1) // 2
        self._suspects[:0] = [set(g) for g in (live[:half], live[half:]) if g]

    def uncache_unwritten(self, plan: StepPlan) -> None:
        """``plan``'s step failed or never ran: the blocks it was to write leave the prefix
        cache (they were offered to it when scheduled). Call before ``quarantine`` frees
        them."""
        for rid, num_computed in zip(plan.request_ids, plan.num_computed_tokens):
            request = self.requests.get(rid)
            if request is not None:
                self.kv_cache.uncache_from(request, num_computed)

    def requeue_unsent(self, plan: StepPlan) -> None:
        """``plan`` was dropped before the runner saw it (a step in flight failed while it
        waited): the finished and preempted requests it reported go out with the next plan,
        so the runner still drops their state. Its scheduled requests are recomputed
        (``quarantine``'s bystanders; ``uncache_unwritten`` first). Its KV transfers go out
        with the next plan too (``KVTransferScheduling.requeue``): call this before
        ``quarantine``, whose preemptions drop those of the requests it preempts."""
        self._preempted[:0] = plan.preempted_ids
        self._finished[:0] = plan.finished_ids
        if self.kv_transfer is not None:
            self.kv_transfer.requeue(plan)

    @property
    def num_suspects(self) -> int:
        return sum(len(g) for g in self._suspects)

    def _clear_suspect(self, request: Request) -> None:
        if not self._suspects:
            return
        for group in self._suspects:
            group.discard(request)
        self._suspects = [g for g in self._suspects if g]

    def _num_tokens_to_compute(self, request: Request, budget: int) -> int:
        # Runs for every running request and step: list lengths are read directly.
        computed = request.num_computed_tokens
        pending = request.num_pending_tokens
        num_tokens = len(request.all_token_ids)
        max_model_len = self.config.max_model_len
        if pending:
            # Its pending tokens reach max_tokens or max_model_len: the last one is being
            # sampled, nothing more to compute.
            max_tokens = request.sampling_params.max_tokens
            if ((max_tokens is not None
                 and len(request.output_token_ids) + pending >= max_tokens)
                    or num_tokens + pending >= max_model_len):
                return 0
        remaining = num_tokens + pending + len(request.spec_token_ids) - computed
        # A decode (the common case) needs one token and fits any budget and room left.
        if remaining == 1 and budget >= 1 and computed < max_model_len:
            return 1
        return max(0, min(remaining, budget, max_model_len - computed))

    def _preempt(self, request: Request, may_swap: bool = True) -> None:
        self._dequeue(request)
        if not (may_swap and self._swap_out(request)):
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.spec_token_probs = None
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.config.policy.enqueue(self.waiting, request, front=True)
        self._blocks_sent.pop(request.request_id, None)
        self._preempted.append(request.request_id)

    def _swap_out(self, request: Request) -> bool:
        """Preempt ``request`` by swap if the mode (and for ``auto``, the cost) says so and
        the host pool has room; False: recompute it."""
        mode = self.config.preemption_mode
        if mode is PreemptionMode.RECOMPUTE or not request.num_computed_tokens:
            return False
        if mode is PreemptionMode.AUTO:
            to_copy, kept_tokens = self.kv_cache.swap_out_size(request)
            # Everyone left running shares the steps a recompute would take.
            if not self.swap_cost.prefers_swap(
                    to_copy, request.num_computed_tokens - kept_tokens, len(self.running)):
                return False
        if self.kv_cache.swap_out(request):
            self.stats.num_swap_outs += 1
            return True
        self.stats.num_swap_fallbacks += 1
        return False

    def update_from_output(
        self, plan: StepPlan, requests: list[Request], sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Append the step's sampled tokens, finish requests that stop.

        ``requests`` are the ``Request`` objects of ``plan``'s rows (as scheduled: an id may
        name a new request by the time the step completes). ``sampled`` maps request id to
        the tokens accepted for it this step (one token, or more with speculative decoding).
        A request preempted since the step was scheduled still gets its token (it was sampled
        from a complete context); an aborted one does not. Returns the requests that got new
        tokens.

        Stop decisions are the scheduler's alone: token stops here (``check_stop``), stop
        strings (found by the detokenizer) through ``finish_requests``.
        """
        updated = []
        # The loop runs for every request and step: what only drafts or suspects need is
        # skipped without them.
        all_drafts = plan.draft_token_ids
        for request, sample in zip(requests, plan.samples, strict=True):
            if not sample:
                continue
            request.num_pending_tokens -= 1
            tokens = sampled.get(request.request_id)
            if not tokens or request.finished:
                continue
            drafts = all_drafts.get(request.request_id) if all_drafts else None
            if drafts:
                self.stats.num_spec_drafts += 1
                self.stats.num_spec_draft_tokens += len(drafts)
                self.stats.num_spec_accepted_tokens += len(tokens) - 1
            if request.spec_token_ids or len(tokens) > 1:
                if request.status == RequestStatus.RUNNING:
                    # Rejected drafts were computed but are not part of the sequence: their
                    # K/V will be overwritten. ``tokens`` holds the accepted drafts plus one
                    # new token.
                    request.num_computed_tokens -= (len(request.spec_token_ids)
                                                    - (len(tokens) - 1))
                request.spec_token_ids = []
            request.spec_token_probs = None
            if self._suspects:
                self._clear_suspect(request)  # it sampled without failing
            for token in tokens:
                request.append_output_token(token)
                status = check_stop(request, self.config.max_model_len)
                if status is not None:
                    self._dequeue(request)
                    self._finish(request, status)
                    break
            updated.append(request)
        return updated
