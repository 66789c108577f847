"""Beam search over the paged KV cache: vLLM's ``LLM.beam_search`` API, Hugging Face's scores.

Every beam is an ordinary request of the engine's scheduler. After each step the search
(``hitchllm.beam_scoring.BeamScorer``) picks the continuations; each continuation is a new
request *forked* from its parent beam (``Scheduler.fork_request``): it shares every KV block
of the parent (one more reference per block) and computes only its one new token. The
parent's partial last block, where siblings diverge, is copied on the device on a sibling's
first write (copy-on-write, ``StepPlan.block_copies``). Parents finish right after forking,
so pruned beams give their blocks back at once.

The search drives the engine's scheduler and executor itself (not ``LLMEngine.step``), so it
runs while the engine has no other request.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hitchllm.beam_scoring import BeamScorer, EarlyStopping
from hitchllm.request import Request, RequestStatus
from hitchllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hitchllm.engine.llm_engine import LLMEngine, Prompt


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings (vLLM's ``BeamSearchParams``, plus Hugging Face's
    ``early_stopping``).

    ``beam_width`` beams are kept and returned per prompt; ``max_tokens`` bounds the generated
    tokens; ``length_penalty`` divides a sequence's summed logprob by ``length **
    length_penalty`` to rank it; ``early_stopping`` is Hugging Face's (default ``False``, see
    ``hitchllm.beam_scoring``). Only deterministic search is implemented: ``temperature`` must
    be 0. Raises ``ValueError`` naming the field at construction.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(
                f"temperature={self.temperature} is not supported by beam search: only "
                "deterministic beam search (temperature=0) is implemented; use "
                "SamplingParams with temperature > 0 to sample")
        if isinstance(self.length_penalty, bool) or not isinstance(
                self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got "
                             f"{self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never' (Hugging Face's "
                             f"values), got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One returned beam. ``tokens`` is the prompt followed by the generated ids (as in
    vLLM); ``output_token_ids`` only the generated ones, ``text`` their decoded text.
    ``cum_logprob`` sums the generated tokens' log probabilities; ``score`` is Hugging Face's
    ``sequences_scores``: ``cum_logprob / len(output_token_ids) ** length_penalty``."""

    tokens: list[int]
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (ended with an EOS id) or "length"


@dataclass
class BeamSearchOutput:
    """A prompt's ``beam_width`` best sequences, best (highest ``score``) first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


def check_beam_search_supported(engine: LLMEngine, params: BeamSearchParams) -> None:
    """``ValueError`` naming the option when ``engine`` cannot run ``params``."""
    max_num_seqs = engine.config.max_num_seqs
    if params.beam_width > max_num_seqs:
        raise ValueError(
            f"beam_width={params.beam_width} is larger than max_num_seqs={max_num_seqs}: every "
            "beam runs as a sequence of the batch; lower beam_width or raise max_num_seqs")
    if engine.config.speculative_method is not None:
        raise ValueError(
            f"beam search cannot run with speculative decoding (speculative_method="
            f"{engine.config.speculative_method!r}); start an engine without it for beam "
            "search")


@dataclass
class _Beam:
    request: Request
    cum_logprob: float

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids


@dataclass
class _Search:
    """One prompt's search: its scorer, running beams, and their next-token logprobs."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    scorer: BeamScorer
    beams: list[_Beam] = field(default_factory=list)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return all(b.request.request_id in self.logprobs for b in self.beams)


class _BeamSearchRun:
    """The search of a batch of prompts on one engine; ``run`` returns the outputs."""

    def __init__(self, engine: LLMEngine, params: BeamSearchParams, searches: list[_Search],
                 on_done: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_done = on_done
        self.scheduler = engine.scheduler
        self.params = params
        self.searches = searches
        # Each beam asks for its best next tokens: enough to hold the K candidates overall.
        self.request_params = SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
            logprobs=searches[0].scorer.num_candidates if searches else 1)
        self._ids = itertools.count()
        self._owner: dict[str, _Search] = {}

    def run(self) -> list[BeamSearchOutput]:
        waiting = deque(self.searches)
        active: list[_Search] = []
        seats = self.engine.config.max_num_seqs // self.params.beam_width
        try:
            while waiting or active:
                while waiting and len(active) < seats:
                    search = waiting.popleft()
                    self._start(search)
                    active.append(search)
                # Beams waiting for their siblings may hold the blocks the siblings need:
                # those that have their logprobs give their blocks up (their children are
                # computed afresh, from the prefix cache where it still has their blocks).
                if not self._step() and not self._park_sampled(active):
                    # One beam always fits (add_request's checks); this is a bug.
                    raise RuntimeError("beam search made no progress with beams queued")
                for search in [s for s in active if s.ready]:
                    self._advance(search)
                    if search.scorer.done:
                        active.remove(search)
                        if self.on_done is not None:
                            self.on_done()
        finally:
            self.scheduler.finish_requests(list(self._owner), RequestStatus.FINISHED_ABORTED)
        return [self._output(s) for s in self.searches]

    def _park_sampled(self, active: list[_Search]) -> bool:
        """End the requests of the beams that already have their next-token logprobs (the
        search keeps their tokens); False when there is none."""
        parked = [b for s in active for b in s.beams
                  if b.request.request_id in s.logprobs and not b.request.finished]
        self._finish(parked, RequestStatus.FINISHED_STOPPED)
        return bool(parked)

    def _new_request(self, search: _Search, output_token_ids: list[int]) -> Request:
        request = Request(
            request_id=f"beam-{search.index}-{next(self._ids)}",
            prompt_token_ids=search.prompt_token_ids,
            sampling_params=self.request_params,
            eos_token_ids=self.engine.eos_token_ids,
            # Beams preempted and recomputed share their prompt's blocks even without the
            # prefix cache.
            prefix_share_key=f"beam-search-{id(self)}-{search.index}",
        )
        for token in output_token_ids:
            request.append_output_token(token)
        return request

    def _start(self, search: _Search) -> None:
        root = self._new_request(search, [])
        self.scheduler.add_request(root)
        self._owner[root.request_id] = search
        search.beams = [_Beam(root, 0.0)]

    def _step(self) -> bool:
        """One engine step of every beam that has something to compute; records the
        next-token logprobs of the beams that reached their end. False when no beam could
        be scheduled and none was preempted (preempting makes room for the next step)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            # No row, but maybe work for the runner: states to drop, blocks to swap out.
            self.engine.executor.execute_model(plan).result()
            return bool(plan.preempted_ids)
        requests = [self.scheduler.requests[rid] for rid in plan.request_ids]
        output = self.engine.executor.execute_model(plan).result()
        # The search, not the sampler, chooses each beam's next token: nothing is appended.
        self.scheduler.update_from_output(plan, requests, {})
        for rid, entries in output.logprobs.items():
            search = self._owner.get(rid)
            if search is not None:
                search.logprobs[rid] = {t: lp.logprob for t, lp in entries[-1].items()}
        return True

    def _advance(self, search: _Search) -> None:
        """Let the scorer pick the continuations, fork them, and finish every parent."""
        parents = search.beams
        continuations = search.scorer.step(
            [(b.output_token_ids, b.cum_logprob) for b in parents],
            [search.logprobs[b.request.request_id] for b in parents])
        children = []
        for c in continuations:
            parent = parents[c.beam].request
            child = self._new_request(search, [*parent.output_token_ids, c.token])
            self.scheduler.fork_request(parent, child)
            self._owner[child.request_id] = search
            children.append(_Beam(child, c.cum_logprob))
        self._finish(parents, RequestStatus.FINISHED_STOPPED)
        search.beams = children
        search.logprobs = {}

    def _finish(self, beams: list[_Beam], status: RequestStatus) -> None:
        """End the beams' requests: their blocks go back at once."""
        ids = [b.request.request_id for b in beams]
        self.scheduler.finish_requests(ids, status)
        for rid in ids:
            self._owner.pop(rid, None)  # a parked beam is no longer owned

    def _output(self, search: _Search) -> BeamSearchOutput:
        decode = self.engine.tokenizer.decode
        return BeamSearchOutput(search.prompt, search.prompt_token_ids, [
            BeamSearchSequence(
                tokens=search.prompt_token_ids + h.token_ids, output_token_ids=h.token_ids,
                text=decode(h.token_ids, skip_special_tokens=True),
                cum_logprob=h.cum_logprob, score=h.score, finish_reason=h.finish_reason)
            for h in search.scorer.finished])


def beam_search(engine: LLMEngine, prompts: Sequence[Prompt], params: BeamSearchParams,
                on_done: Callable[[], None] | None = None) -> list[BeamSearchOutput]:
    """Run ``params``' beam search for every prompt on ``engine`` (which must have no other
    request); one ``BeamSearchOutput`` per prompt, in order. Raises ``ValueError`` for an
    invalid prompt or an option the engine cannot honour, before anything runs.
    ``on_done`` is called as each prompt's search ends."""
    check_beam_search_supported(engine, params)
    if engine.has_unfinished_requests():
        raise RuntimeError("beam search runs alone: the engine still has requests; finish "
                           "or abort them first")
    eos = () if params.ignore_eos else engine.eos_token_ids
    searches = []
    for index, prompt in enumerate(prompts):
        text, token_ids = engine.tokenize(prompt)
        engine._validate(token_ids, SamplingParams(max_tokens=params.max_tokens))
        # The last generated token is never fed back: a beam ends at max_model_len.
        max_tokens = min(params.max_tokens, engine.max_model_len - len(token_ids) + 1)
        scorer = BeamScorer(params.beam_width, max_tokens, eos, params.length_penalty,
                            params.early_stopping)
        searches.append(_Search(index, text, token_ids, scorer))
    return _BeamSearchRun(engine, params, searches, on_done).run()


