"""``draft_model``: a smaller model of the target's vocabulary drafts K tokens per step.

Set-up (``speculative_model=PATH``): the checkpoint is checked against the target
(``draft_checkpoint``), loaded with the core's loader on the engine's device and dtype, given
an attention backend by the core's selector, and its own paged KV cache (``DraftKVCache``
blocks, ``DraftRunner`` tensors), then its draft steps are captured into CUDA graphs (on CUDA,
unless ``enforce_eager``).

The draft cache has a fixed size: enough blocks for ``max_num_seqs`` requests of
``max_model_len`` tokens, capped at ``DRAFT_KV_CACHE_CPU_BYTES`` on a CPU and at
``DRAFT_KV_CACHE_GPU_SHARE`` of the card's memory on CUDA (allocated before the engine sizes
the target's cache, which therefore gets the rest). It must hold at least one request of
``max_model_len`` tokens. When it runs short, requests not being drafted for are evicted, then
requests go without drafts.

Each step (``propose``), for every request asked:

1. catch up: roll the request's draft cache back to the drafts the target accepted, then run
   the draft model over the tokens it lacks (at least the newest token; the whole prompt for a
   new request), batched over all requests in one forward (split when larger than
   ``max_num_batched_tokens``); its last position gives draft 1;
2. K - 1 draft steps of one token per request, batched, each fed the previous step's samples
   on the device (CUDA graphs when captured); a request that may take fewer drafts
   (``max_num_drafts``) leaves the batch early; with CUDA graphs one more step caches the
   last draft (``feed_last_draft``);
3. one copy of all drafts to the host, queued before the forward that caches the last draft,
   so the host reads the drafts while that forward runs.

Steps 1 and 2 of a greedy batch whose requests each lack only their newest token and take K
drafts (the steady state) run as one CUDA graph, the draft runner's draft chain, when the
attention backend allows it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hitchllm.attention import AttentionSpec, bytes_per_shared_block
from hitchllm.attention.selector import select_attention_backend
from hitchllm.config import EngineConfig, ModelConfig
from hitchllm.engine.cuda_graphs import default_capture_sizes
from hitchllm.models.loader import load_model
from hitchllm.plugins import get_plugin_registry
from hitchllm.speculative import Draft, DraftRequest, Proposal, ProposalBatch, Proposer
from hitchllm_specdec.draft_cache import DraftKVCache, DraftState
from hitchllm_specdec.draft_checkpoint import check_same_vocabulary, read_draft_config
from hitchllm_specdec.draft_runner import DraftRunner
from hitchllm_specdec.draft_sampling import DraftSampling, draft_seed

logger = logging.getLogger(__name__)

DRAFT_KV_CACHE_CPU_BYTES = 2**30
DRAFT_KV_CACHE_GPU_SHARE = 0.05
# The engine's default step budget, also the draft's largest catch-up forward.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class DraftModelProposer(Proposer):
    """Drafts with a smaller model run on its own paged KV cache (see the module docstring)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        cfg = engine_config
        target = ModelConfig.from_pretrained(cfg.model)
        self.vocab_size = target.vocab_size
        self.max_model_len = cfg.max_model_len or target.max_position_embeddings
        draft = read_draft_config(cfg, self.max_model_len)
        check_same_vocabulary(cfg, target, draft)
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.device = cfg.resolve_device()
        dtype = cfg.resolve_dtype(target.checkpoint_dtype, self.device)
        registry = get_plugin_registry()
        model = load_model(draft, registry, self.device, dtype)
        spec = AttentionSpec.for_device(
            self.device, dtype=dtype, kv_cache_dtype=dtype,
            head_size=draft.mla_latent_width or draft.head_dim,
            num_heads=draft.num_attention_heads,
            num_kv_heads=1 if draft.use_mla else draft.num_key_value_heads,
            block_size=cfg.block_size, use_mla=draft.use_mla, sliding_window=draft.sliding_window)
        backend = select_attention_backend(spec, cfg.attention_backend, registry)
        self.max_num_tokens = max(cfg.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                  cfg.max_num_seqs)
        self.runner = DraftRunner(
            model, backend, spec, cfg.max_num_seqs, self.max_num_tokens, self.max_model_len,
            self.device, cfg.cuda_graph_sizes or default_capture_sizes(cfg.max_num_seqs))
        num_blocks = self._num_blocks(bytes_per_shared_block(self.runner.kv_cache_specs))
        self.runner.allocate_kv_cache(num_blocks)
        self.cache = DraftKVCache(num_blocks, cfg.block_size)
        if not cfg.enforce_eager:
            self.runner.capture_cuda_graphs(self.num_speculative_tokens, self.vocab_size)
        # With graphs, one more replay caches the last draft too: then whatever the target
        # accepts, the next catch-up is one token per request (uniform, from a graph) instead
        # of an eager forward of two when every draft was accepted. Eagerly it would cost a
        # forward per step for a token that is often rejected.
        self.feed_last_draft = self.runner.graphs is not None and self.runner.graphs.captured
        self.generator = torch.Generator(self.device).manual_seed(draft_seed(cfg.seed))
        logger.info("Draft model %s (%s attention): KV cache of %d blocks of %d tokens",
                    draft.path, backend.name, num_blocks, cfg.block_size)

    def _num_blocks(self, bytes_per_block: int) -> int:
        cfg = self.engine_config
        blocks_per_seq = -(-self.max_model_len // cfg.block_size)
        if self.device.type == "cuda":
            budget = int(torch.cuda.get_device_properties(self.device).total_memory
                         * DRAFT_KV_CACHE_GPU_SHARE)
        else:
            budget = DRAFT_KV_CACHE_CPU_BYTES
        num_blocks = min(cfg.max_num_seqs * blocks_per_seq, budget // bytes_per_block)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the draft model's KV cache ({budget / 2**30:.2f} GiB) holds "
                f"{num_blocks * cfg.block_size} tokens, fewer than one max_model_len="
                f"{self.max_model_len} request; lower max_model_len or use a smaller draft model")
        return num_blocks

    # ---- the engine's side --------------------------------------------------------------

    def remove_requests(self, request_ids: list[str]) -> None:
        """Free the draft-cache blocks of finished requests."""
        for rid in request_ids:
            self.cache.free(rid)

    def propose(self, batch: ProposalBatch) -> Proposal:
        requests, states = self._admit(batch.requests)
        if not requests:
            return Proposal()
        n = len(requests)
        limits = np.array([r.max_num_drafts for r in requests], dtype=np.int64)
        lengths = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
        max_cols = -(-int((lengths + limits - 1 + self.feed_last_draft).max())
                     // self.cache.block_size)
        block_table = np.zeros((n, max_cols), dtype=np.int32)
        for i, state in enumerate(states):
            block_table[i, : len(state.blocks)] = state.block_ids[:max_cols]
        sampling = DraftSampling(
            [r.sampling_params for r in requests], [s.generator for s in states],
            self.generator, self.vocab_size, self.device)

        chain = self._chain_size(states, lengths, limits, sampling)
        if chain is not None:
            newest = np.array([r.token_ids[-1] for r in requests], dtype=np.int64)
            tokens = self.runner.run_chain(chain, newest, lengths - 1, block_table)
            return self._proposal(requests, states, tokens, None, limits, lengths, sampling,
                                  block_table)
        logits = self._catch_up(requests, states, block_table)
        num_steps = int(limits[0])
        tokens = torch.zeros(n, num_steps, dtype=torch.int64, device=self.device)
        probs = None
        for step in range(num_steps):
            active = int((limits > step).sum())  # rows are sorted by limit, longest first
            if step:
                logits = self.runner.forward(
                    np.ones(active, dtype=np.int64), lengths[:active] + step - 1,
                    block_table[:active], device_token_ids=tokens[:active, step - 1])
            sampled, step_probs = sampling.sample(logits)
            tokens[:active, step] = sampled
            if step_probs is not None:
                if probs is None:
                    probs = torch.zeros(n, num_steps, self.vocab_size, device=self.device)
                probs[:active, step] = step_probs
        return self._proposal(requests, states, tokens, probs, limits, lengths, sampling,
                              block_table)

    def _chain_size(self, states: list[DraftState], lengths: np.ndarray, limits: np.ndarray,
                    sampling: DraftSampling) -> int | None:
        """The draft-chain graph for this proposal, if it can run as one: every request
        greedy, lacking only its newest token, taking all K drafts."""
        if not (self.feed_last_draft and sampling.all_greedy
                and (limits == self.num_speculative_tokens).all()):
            return None
        if any(s.num_computed != end - 1 for s, end in zip(states, lengths, strict=True)):
            return None
        return self.runner.chain_size(len(states))

    def _proposal(self, requests: list[DraftRequest], states: list[DraftState],
                  tokens: torch.Tensor, probs: torch.Tensor | None, limits: np.ndarray,
                  lengths: np.ndarray, sampling: DraftSampling,
                  block_table: np.ndarray) -> Proposal:
        """Copy the drafts to the host (with graphs, while the last draft is cached: see the
        module docstring), record what the draft cache now holds, and package them."""
        n = len(requests)
        if self.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        if self.feed_last_draft:
            last = tokens[torch.arange(n, device=self.device),
                          torch.from_numpy(limits - 1).to(self.device)]
            self.runner.forward(np.ones(n, dtype=np.int64), lengths + limits - 1, block_table,
                                device_token_ids=last)
        if self.device.type == "cuda":
            copied.synchronize()
            drafts = host.tolist()
        else:
            drafts = tokens.tolist()
        proposal = {}
        for i, (r, state) in enumerate(zip(requests, states, strict=True)):
            ids = drafts[i][: limits[i]]
            state.num_context = int(lengths[i])
            state.num_computed = state.num_context + len(ids) - 1 + self.feed_last_draft
            state.drafts = ids
            row_probs = None if probs is None or sampling.greedy[i] else probs[i, : len(ids)]
            proposal[r.request_id] = Draft(ids, row_probs)
        return Proposal(proposal)

    def _admit(self, asked: list[DraftRequest]) -> tuple[list[DraftRequest], list[DraftState]]:
        """The requests to draft for, longest draft limit first, each with its caught-up
        state holding blocks for everything this step computes; a request the cache cannot
        take goes without drafts."""
        limit = self.num_speculative_tokens
        asked = sorted(asked, key=lambda r: -min(limit, r.max_num_drafts))
        busy = {r.request_id for r in asked}
        requests, states = [], []
        for r in asked:
            state = self.cache.catch_up(r.request_id, r.token_ids)
            params = r.sampling_params
            if state.generator is None and params is not None and params.seed is not None:
                state.generator = torch.Generator(self.device).manual_seed(
                    draft_seed(params.seed))
            drafts = min(limit, r.max_num_drafts)
            cached = len(r.token_ids) + drafts - 1 + self.feed_last_draft
            if self.cache.allocate(state, cached, busy):
                requests.append(DraftRequest(r.request_id, r.token_ids, r.num_prompt_tokens,
                                             drafts, params))
                states.append(state)
            else:
                self.cache.evict(state)
        return requests, states

    def _catch_up(self, requests: list[DraftRequest], states: list[DraftState],
                  block_table: np.ndarray) -> torch.Tensor:
        """Compute each request's tokens the draft cache lacks; the logits at every request's
        newest token (``[n, vocab]``). Forwards hold at most ``max_num_tokens`` tokens."""
        n = len(requests)
        starts = np.array([s.num_computed for s in states], dtype=np.int64)
        ends = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
        logits: torch.Tensor | None = None
        while True:
            rows = np.flatnonzero(starts < ends)
            if not len(rows):
                break
            wanted = ends[rows] - starts[rows]
            # Fill the budget request by request; the last one taken may get a part.
            before = np.cumsum(wanted) - wanted
            take = np.clip(self.max_num_tokens - before, 0, wanted)
            rows, take = rows[take > 0], take[take > 0]
            token_ids = np.concatenate([
                np.asarray(requests[i].token_ids[starts[i] : starts[i] + t], dtype=np.int64)
                for i, t in zip(rows, take, strict=True)])
            out = self.runner.forward(take, starts[rows], block_table[rows], token_ids)
            starts[rows] += take
            done = starts[rows] == ends[rows]
            if done.all() and len(rows) == n:
                logits = out
                continue
            if logits is None:
                logits = out.new_empty(n, out.shape[-1])
            index = torch.from_numpy(rows[done]).to(self.device)
            logits[index] = out[torch.from_numpy(np.flatnonzero(done)).to(self.device)]
        for state, end in zip(states, ends, strict=True):
            state.num_computed = int(end)
        assert logits is not None
        return logits
