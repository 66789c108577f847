"""Runs one scheduled batch: flat input tensors, one forward pass, logits where sampling
happens, sampling. Owns the KV-cache tensors and the backend's metadata builder."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from hitchllm import distributed, timeline
from hitchllm.attention import (
    Attention,
    AttentionBackend,
    AttentionSpec,
    CommonAttentionMetadata,
    KVCacheKind,
    KVCacheSpec,
    set_forward_context,
)
from hitchllm.attention.block_copy import block_dim, copy_blocks
from hitchllm.engine.cuda_graphs import graphs_for
from hitchllm.engine.input_batch import InputBatch, RequestState
from hitchllm.engine.kv_swap import HostKVCache
from hitchllm.engine.piecewise_graphs import PieceGraphs, RowAttention, can_split
from hitchllm.engine.prompt_logprobs import compute_prompt_logprobs
from hitchllm.engine.rejection_sampler import build_draft_tokens
from hitchllm.engine.runner_output import PendingOutput, RunnerOutput
from hitchllm.engine.sampler import Sampler
from hitchllm.engine.sampling_metadata import SamplingMetadata, build_sampling_metadata
from hitchllm.engine.step_buffers import StepBuffers
from hitchllm.kv_transfer.connector import KVConnector, run_kv_transfers
from hitchllm.logits_processor import LogitsEdit, LogitsProcessor, LogitsRow
from hitchllm.models.pipeline import StageGraphIO, graph_transfers, model_stage
from hitchllm.sampling_params import SamplingParams
from hitchllm.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)


class ModelRunner:
    """Executes step plans for one model with one attention backend.

    The runner keeps its own state per request (``InputBatch``), built from the plans' new
    requests and advanced by its own sampled tokens; it never sees the scheduler's requests.

    Set-up order: construct, ``initialize_kv_cache(num_blocks)`` (on CUDA the engine first
    calls ``measure_peak_memory`` to size the cache), ``warm_up()`` (CUDA), then
    ``capture_cuda_graphs()`` when graphs are wanted.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: type[AttentionBackend],
        spec: AttentionSpec,
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        seed: int,
        before_forward: Callable[..., Any] | None = None,
        cuda_graph_sizes: list[int] | None = None,
        logits_processors: list[LogitsProcessor] | None = None,
        keep_hidden_states: bool = False,
        graph_query_lens: tuple[int, ...] = (1,),
        samples: bool = True,
        kv_connector: KVConnector | None = None,
        piece_token_sizes: list[int] | None = None,
    ) -> None:
        self.model = model
        # Disaggregated serving: saves and loads this rank's share of requests' KV blocks.
        self.kv_connector = kv_connector
        # False on a pipeline stage before the last: it runs its layers (the model hands the
        # hidden state on) and has no LM head; its request states advance with the tokens
        # the driver feeds it (``append_fed_tokens``).
        self.samples = samples
        self.logits_processors = logits_processors or []
        self.backend = backend
        self.spec = spec
        self.device = device
        self.before_forward = before_forward
        self.block_size = spec.block_size
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        max_blocks_per_req = -(-max_model_len // spec.block_size)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, max_blocks_per_req)
        self.buffers = StepBuffers(max_num_tokens, max_num_seqs, max_blocks_per_req, device)
        self.builder = backend.get_builder_cls()(spec, device)
        self.layers = sorted(
            (m for m in self.model.modules() if isinstance(m, Attention)),
            key=lambda m: m.layer_index,
        )
        # What each layer caches per token, in the layers' order: sizes the cache and shapes
        # each layer's tensor.
        self.kv_cache_specs: list[KVCacheSpec] = [
            layer.get_kv_cache_spec(spec.block_size, spec.kv_cache_dtype) for layer in self.layers
        ]
        if any((s.kind is KVCacheKind.MLA_LATENT) != spec.use_mla for s in self.kv_cache_specs):
            raise ValueError(
                f"with use_mla={spec.use_mla} every attention layer must declare "
                f"{'an' if spec.use_mla else 'no'} MLA latent KV cache; the layers declare "
                f"{sorted({s.kind.value for s in self.kv_cache_specs})}")
        self.kv_caches: list[torch.Tensor] = []
        # Swap preemption's host pool (``initialize_kv_cache`` with host blocks).
        self.host_kv: HostKVCache | None = None
        # Each cache tensor's block dimension, for copy-on-write block copies.
        self.kv_block_dims = [block_dim(backend, s) for s in self.kv_cache_specs]
        # Uniform decode batches up to the largest size are padded to a capture size (and
        # replayed from a graph once ``capture_cuda_graphs`` ran), so eager and graph runs of
        # the same batch launch the very same kernels. With a backend that allows it, so are
        # batches of ``graph_query_lens`` tokens per request (speculative verification).
        self.graphs = graphs_for(backend, device, cuda_graph_sizes or [], max_num_seqs,
                                 max_num_tokens, graph_query_lens)
        # A pipeline stage's graph input and outputs (once its graphs are captured).
        self.stage_io: StageGraphIO | None = None
        # Other steps (prompt chunks, mixed batches) up to the largest of
        # ``piece_token_sizes`` tokens are padded to one of those sizes, and replayed as
        # graph pieces around eagerly run attention once captured (see piecewise_graphs).
        self.pieces: PieceGraphs | None = None
        piece_sizes = [n for n in piece_token_sizes or [] if n <= max_num_tokens]
        if device.type == "cuda" and piece_sizes:
            reason = can_split(model, self.layers)
            if reason is None:
                self.pieces = PieceGraphs(piece_sizes)
            else:
                logger.info("Prompt and mixed steps run eagerly: %s", reason)
        self.sampler = Sampler()
        # The newest sampled token of each input-batch row, kept on the device for a next
        # step scheduled before the host has seen it.
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        # Host buffers the sampled tokens are copied into, used in turn: one per step whose
        # output may still be unread when the next is launched (with pipeline stages up to
        # one per stage in flight, read by the worker's answer thread, plus the one
        # launching).
        self._sampled_host = [torch.zeros(max_num_tokens, dtype=torch.int64,
                                          pin_memory=device.type == "cuda")
                              for _ in range(max(2, distributed.pp_world_size() + 1))]
        self._sampled_slot = 0
        self._inputs_copied: torch.cuda.Event | None = None
        self._sample_rows: torch.Tensor | None = None
        self.default_generator = torch.Generator(device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        # The last step's sampling metadata and the request states of its rows, while it may
        # serve a next step of the same rows (``_sampling_metadata``).
        self._reusable_metadata: tuple[tuple[RequestState, ...], SamplingMetadata] | None = None
        # Whether a step's output carries the final hidden states of its sampled positions
        # (for a proposer that drafts from them); off, they cost nothing.
        self.keep_hidden_states = keep_hidden_states
        # Steps launched (every plan, empty ones too): the step index of timeline marks.
        self.num_steps = 0

    # ---- set-up ------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> float | None:
        """Allocate every layer's KV cache with ``num_blocks`` blocks, as its spec declares,
        and bind it. With ``num_host_blocks``, also the host pool that swap preemption copies
        blocks to; returns then the measured seconds to swap one block out and back in."""
        self.kv_caches = []
        self.host_kv = None
        for layer in self.layers:
            layer.bind(None, None)  # drop an earlier cache before allocating the next
        impl_cls = self.backend.get_impl_cls()
        for layer, kv_spec in zip(self.layers, self.kv_cache_specs):
            shape = self.backend.get_kv_cache_shape_for_spec(num_blocks, kv_spec)
            cache = zeroed_kv_cache(shape, kv_spec.dtype, self.device)
            impl = impl_cls(layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads,
                            self.spec)
            layer.bind(impl, cache)
            self.kv_caches.append(cache)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches, self.kv_block_dims)
        if not num_host_blocks:
            return None
        self.host_kv = HostKVCache(self.backend, self.kv_cache_specs, self.kv_caches,
                                   self.kv_block_dims, num_host_blocks, self.device)
        return self.host_kv.measure_seconds_per_block(num_blocks)

    @torch.inference_mode()
    def measure_peak_memory(self) -> int:
        """Peak bytes PyTorch allocates in a worst-case step: a forward over
        ``max_num_tokens`` prompt tokens, then logits and sampling (top-k, top-p, min-p,
        penalties, logprobs) for ``max_num_seqs`` rows. Runs on a one-block KV cache (no slot
        is written; every block-table entry points at that block), which is freed again.
        Its sampling draws from a generator of its own, not the engine's."""
        self.initialize_kv_cache(1)
        # The largest step the scheduler can plan: no request beyond max_model_len.
        num_tokens = min(self.max_num_tokens, self.max_num_seqs * self.max_model_len)
        num_reqs = min(self.max_num_seqs, -(-num_tokens // self.max_model_len))
        lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        lens[: num_tokens % num_reqs] += 1
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = self._dummy_forward(lens)
        if not self.samples:
            return self._peak_after(hidden)
        n = self.max_num_seqs
        logits = self.model.compute_logits(hidden[torch.arange(n, device=self.device) % num_tokens])
        worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05,
                               repetition_penalty=1.1, presence_penalty=0.1, logprobs=20)
        self._sample_once(logits, worst)
        del logits
        return self._peak_after(hidden)

    def _dummy_forward(self, lens: np.ndarray) -> torch.Tensor:
        """An eager forward over requests of ``lens`` new tokens each (no context): token ids
        0, no slot written, every block-table entry block 0 (read, not written)."""
        b = self.buffers
        num_tokens = int(lens.sum())
        starts = np.cumsum(lens) - lens
        b.input_ids.np[:num_tokens] = 0
        b.positions.np[:num_tokens] = np.arange(num_tokens) - np.repeat(starts, lens)
        b.slot_mapping.np[:num_tokens] = -1
        common = b.common_metadata(
            lens, np.zeros(len(lens), dtype=np.int64),
            np.zeros((len(lens), -(-int(lens.max()) // self.block_size)), dtype=np.int32),
            num_tokens, cuda_graph=False, max_model_len=self.max_model_len)
        return self._eager_forward(b.input_ids.to_device(num_tokens),
                                   b.positions.to_device(num_tokens), self.builder.build(common))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """After ``initialize_kv_cache``: run once the eager steps that choose kernels of
        their own, so that those compile now and not on the first request's step (a compile
        there stalls every request in it); the engine calls it on CUDA. An eager step of each
        query length the attention backend names (``AttentionBackend.warm_up_query_lens``)
        beside a decoding request (alone where the step budget leaves no room for it; a
        one-token step where the backend names none), then the LM head at every row count and
        plain temperature sampling (``race_kernel`` on CUDA; ``_warm_up_logits``). No slot
        is written; every block-table entry is block 0, which is read; the sampling draws from
        a generator of its own. Every rank runs the same steps (pipeline stages send and
        receive as in a real step). CUDA graphs cover their decode batches; prompt lengths the
        backend treats alike need one entry."""
        hidden = None
        for query_len in self.backend.warm_up_query_lens:
            if query_len > self.max_model_len:
                continue
            lens = [1, query_len][-self.max_num_seqs:]
            if sum(lens) > self.max_num_tokens:
                lens = [query_len]  # no decoding request fits beside it
            if query_len <= self.max_num_tokens:
                hidden = self._dummy_forward(np.array(lens, dtype=np.int64))
        if hidden is None:  # on every pipeline stage: each forward sends to the next
            hidden = self._dummy_forward(np.array([1], dtype=np.int64))
        if self.samples:
            self._warm_up_logits(hidden[-1:])

    def _warm_up_logits(self, row: torch.Tensor) -> None:
        """The LM head at every row count a step of one token per request samples
        (``max_num_seqs`` down to 1; the largest first, so its memory serves the rest), from
        copies of the hidden state ``row``, and plain temperature sampling once. The LM head
        runs outside the graphs, and cuBLAS chooses and loads a kernel the first time it
        meets a row count: before this, the first pass over a workload paid that in every
        prompt-and-decode step and in the shrinking batch's steps (0.1-0.15 s of a 7 s run
        on an H100; docs/performance.md). Speculative verification and prompt logprobs take
        more rows than these."""
        rows = row.expand(self.max_num_seqs, -1).contiguous()
        self._sample_once(self.model.compute_logits(rows), SamplingParams(temperature=1.0))
        for n in range(self.max_num_seqs - 1, 0, -1):
            self.model.compute_logits(rows[:n])

    def _sample_once(self, logits: torch.Tensor, params: SamplingParams) -> None:
        """Sample every row of ``logits`` with ``params``, from a throwaway generator."""
        n = logits.shape[0]
        self.sampler(logits, build_sampling_metadata(
            params=[params] * n, prompt_token_ids=[[0]] * n, output_token_ids=[[0]] * n,
            eos_token_ids=[None] * n, generators=[None] * n,
            default_generator=torch.Generator(device=self.device), vocab_size=self.vocab_size,
            device=self.device))

    def _peak_after(self, hidden: torch.Tensor) -> int:
        """The profiled peak, once the profiling step is done; frees its one-block cache."""
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del hidden
        for layer in self.layers:
            layer.bind(None, None)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture the forward at every graph size and query length, and the pieces of prompt
        and mixed steps at every token size (after ``initialize_kv_cache``); all share one
        memory pool."""
        b = self.buffers
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        if self.pieces is not None:
            def forward_tokens(tokens: int) -> torch.Tensor:
                # The device buffers themselves: a step fills them (and writes its pending
                # tokens into them) before the replay.
                return self.model(b.input_ids.device[:tokens], b.positions.device[:tokens])

            self.pieces.capture(forward_tokens, pool)
        if self.graphs is None:
            return

        def prepare(size: int, query_len: int) -> None:
            # A batch of padding requests: the graph's kernels do not depend on the values.
            self.buffers.pad_decode_inputs(0, size * query_len)
            common = self.buffers.common_metadata(
                np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                np.zeros((0, 1), dtype=np.int32), 0, cuda_graph=True,
                max_model_len=self.max_model_len, padded_reqs=size, pad_query_len=query_len)
            self._graph_metadata = self.builder.build(common)

        def forward(size: int, query_len: int) -> torch.Tensor:
            tokens = size * query_len
            return self._eager_forward(b.input_ids.device[:tokens], b.positions.device[:tokens],
                                       self._graph_metadata)

        stage = model_stage(self.model)
        if stage is None or stage.pp_size == 1:
            self.graphs.capture(prepare, forward, pool)
        else:
            # A pipeline stage: the graphs run its layers; the runner receives and sends
            # their activations around each replay.
            self.stage_io = StageGraphIO(self.graphs.max_tokens, stage.hidden_size,
                                         stage.dtype, self.device)
            with graph_transfers(self.stage_io):
                self.graphs.capture(prepare, forward, pool)
        del self._graph_metadata

    # ---- one step ----------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run the step and wait for its output."""
        return self.execute_async(plan).result()

    @torch.inference_mode()
    def execute_async(self, plan: StepPlan) -> PendingOutput:
        """Launch the step; returns before the device finishes (except for prompt logprobs,
        which are read back here).

        A scheduled token the host has not seen yet (the pending token of a request whose
        previous step is still running) is taken from that step's sampled tokens on the
        device. The KV connector's transfers run first (``hitchllm.kv_transfer.connector``).
        """
        tl = timeline.ACTIVE
        if tl is not None:
            tl.step = self.num_steps
            tl.mark("launch_start")
        self.num_steps += 1
        kv_events = None
        if self.kv_connector is not None:
            kv_events = run_kv_transfers(self.kv_connector, plan)
        pending = self._launch(plan)
        pending.kv_events = kv_events
        if tl is not None:
            tl.mark("launch_end")
        return pending

    def _launch(self, plan: StepPlan) -> PendingOutput:
        batch = self.input_batch
        for rid in (*plan.preempted_ids, *plan.finished_ids):
            batch.release(rid)
        for rid in plan.finished_ids:  # a preempted request keeps its random stream
            self._generators.pop(rid, None)
        if plan.finished_ids:
            for processor in self.logits_processors:
                processor.remove_requests(plan.finished_ids)
        for new in plan.new_requests:
            batch.add(new, [p for p in self.logits_processors
                            if p.is_used_by(new.sampling_params)])
        if self.host_kv is not None or plan.swap_out or plan.swap_in:
            self._swap(plan)  # every step: it may wait for the last step's swap-outs
        copy_blocks(self.kv_caches, self.kv_block_dims, plan.block_copies)
        if plan.is_empty:
            return PendingOutput()

        tl = timeline.ACTIVE
        if tl is not None:
            tl.device_mark("step_start")
        # ``known``: tokens of each row the host knows; the rest of its scheduled tokens are
        # pending.
        states, drafts, rows, known = batch.sync_rows(
            plan.request_ids, plan.new_block_ids, plan.draft_token_ids)
        num_sched = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.asarray(plan.num_computed_tokens, dtype=np.int64)
        graph_size = None
        query_len = int(num_sched[0])
        if self.graphs is not None and (num_sched == query_len).all():
            graph_size = self.graphs.padded_size(len(num_sched), query_len)
        num_tokens = int(num_sched.sum())
        piece_tokens = None
        if graph_size is None and self.pieces is not None:
            piece_tokens = self.pieces.padded_tokens(num_tokens)
        sample_rows = [i for i, s in enumerate(plan.samples) if s]
        sampling = [(states[i], drafts[i]) for i in sample_rows]
        common, input_ids, positions, logits_idx = self._prepare_inputs(
            rows, num_sched, num_computed, graph_size, query_len, known, sample_rows, sampling,
            piece_tokens)
        attn_metadata = self.builder.build(common)
        if self.before_forward is not None:
            self.before_forward(requests=states, num_scheduled_tokens=plan.num_scheduled_tokens,
                                model=self.model, running_requests=batch.states.values())
        if tl is not None:
            tl.device_mark("forward_start")
        if graph_size is not None and self.graphs is not None and self.graphs.captured:
            hidden = self._replay(graph_size, query_len)
        elif piece_tokens is not None and self.pieces is not None and self.pieces.captured:
            if tl is not None:
                tl.mark("pieces_replay", tokens=piece_tokens)
            hidden = self.pieces.replay(piece_tokens, num_tokens, attn_metadata)
        else:  # a step padded for pieces launches their kernels eagerly
            hidden = self._eager_forward(input_ids, positions, attn_metadata,
                                         None if piece_tokens is None else num_tokens)
        if tl is not None:
            tl.device_mark("forward_end")
        pending = self._sample_step(plan, states, hidden, num_computed, logits_idx, sampling)
        if tl is not None:
            tl.device_mark("step_end")
        return pending

    def _replay(self, size: int, query_len: int) -> torch.Tensor:
        """Replay the graph of ``size`` requests of ``query_len`` tokens; a pipeline stage
        receives its input first (after the first stage) and sends its output after (before
        the last)."""
        assert self.graphs is not None
        if timeline.ACTIVE is not None:
            timeline.ACTIVE.mark("graph_replay", tokens=size * query_len)
        io = self.stage_io
        if io is None:
            return self.graphs.replay(size, query_len)
        rank, tokens = distributed.current_rank(), size * query_len
        if not rank.is_first_stage:
            io.receive(tokens)
        hidden = self.graphs.replay(size, query_len)
        if not rank.is_last_stage:
            io.send(tokens)
        return hidden

    def _sample_step(
        self, plan: StepPlan, states: list[RequestState], hidden: torch.Tensor,
        num_computed: np.ndarray, logits_idx: torch.Tensor,
        sampling: list[tuple[RequestState, list[int]]],
    ) -> PendingOutput:
        """Prompt logprobs, logits and sampling of a step whose forward is launched (nothing
        on a pipeline stage before the last)."""
        if not self.samples:
            return PendingOutput()
        prompt_lps = {}
        if any(s.sampling_params.prompt_logprobs is not None for s in states):
            prompt_lps = compute_prompt_logprobs(
                self.model, hidden, states, num_computed, self.buffers.query_start_loc.np)
        if not sampling:
            return PendingOutput(prompt_logprobs=prompt_lps)
        sampled_hidden = hidden[logits_idx]
        logits = self.model.compute_logits(sampled_hidden)
        pending = self._sample(sampling, logits, plan.draft_probs)
        pending.prompt_logprobs = prompt_lps
        if self.keep_hidden_states:
            pending.hidden_states = sampled_hidden
        return pending

    def _swap(self, plan: StepPlan) -> None:
        """Run the plan's swap-outs and swap-ins (see ``HostKVCache.swap``)."""
        if self.host_kv is None:
            raise RuntimeError("the step plan swaps KV blocks but this runner has no host "
                               "pool (initialize_kv_cache without num_host_blocks)")
        written: set[int] = set()
        if plan.swap_out:
            written.update(b for ids in plan.new_block_ids for b in ids)
            written.update(d for _, d in plan.block_copies)
        self.host_kv.swap(plan.swap_out, plan.swap_in, written)

    def append_fed_tokens(self, sampled: dict[str, list[int]]) -> None:
        """Record tokens sampled elsewhere (by the last pipeline stage) for this runner's
        requests, as its own sampling would; ids it does not hold (finished since) are
        ignored."""
        states = self.input_batch.states
        for rid, tokens in sampled.items():
            state = states.get(rid)
            if state is not None:
                state.append_tokens(tokens)

    def _eager_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
        real_tokens: int | None = None,
    ) -> torch.Tensor:
        """The model's forward; with ``real_tokens``, the inputs are padded past that many
        tokens (a step of graph pieces' size) and attention runs on the real rows only."""
        split = None if real_tokens is None else RowAttention(real_tokens)
        with set_forward_context(attn_metadata, split_attention=split,
                                 num_real_tokens=real_tokens):
            return self.model(input_ids, positions)

    def _prepare_inputs(
        self, rows: np.ndarray, num_sched: np.ndarray, num_computed: np.ndarray,
        graph_size: int | None, query_len: int, known: np.ndarray, sample_rows: list[int],
        sampling: list[tuple[RequestState, list[int]]], piece_tokens: int | None = None,
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fill the step buffers for this batch (padded to ``graph_size`` requests of
        ``query_len`` tokens when given: a uniform batch that runs as, or like, a CUDA graph;
        or with padding tokens up to ``piece_tokens``, which attention does not see: a step
        that runs as, or like, graph pieces) and copy them to the device. ``known`` counts
        each row's tokens the host knows (the others are taken from the device). Also returns
        the indices of the tokens whose logits are sampled."""
        b = self.buffers
        if self._inputs_copied is not None:
            # The previous step's copies out of these host buffers must be done.
            self._inputs_copied.synchronize()
        num_reqs = len(rows)
        num_tokens = int(num_sched.sum())
        cu = np.cumsum(num_sched)
        token_req = np.repeat(np.arange(num_reqs), num_sched)
        positions = num_computed[token_req] + (np.arange(num_tokens) - (cu - num_sched)[token_req])
        token_rows = rows[token_req]
        b.input_ids.np[:num_tokens] = self.input_batch.token_ids[token_rows, positions]
        b.positions.np[:num_tokens] = positions
        block_ids = self.input_batch.block_table[token_rows, positions // self.block_size]
        b.slot_mapping.np[:num_tokens] = (block_ids.astype(np.int64) * self.block_size
                                          + positions % self.block_size)
        seq_lens = num_computed + num_sched
        num_cols = -(-int(seq_lens.max()) // self.block_size)
        block_table = self.input_batch.block_table[rows, :num_cols]
        total_tokens = num_tokens
        if graph_size is not None:
            total_tokens = graph_size * query_len
            self.buffers.pad_decode_inputs(num_tokens, total_tokens)
        elif piece_tokens is not None:
            total_tokens = piece_tokens
            self.buffers.pad_decode_inputs(num_tokens, total_tokens)
        common = self.buffers.common_metadata(
            num_sched, num_computed, block_table, num_tokens,
            cuda_graph=graph_size is not None, max_model_len=self.max_model_len,
            padded_reqs=graph_size, pad_query_len=query_len)
        input_ids = b.input_ids.to_device(total_tokens)
        pending = np.flatnonzero(positions >= known[token_req])
        if len(pending):
            # Tokens still on the device, sampled by the previous step for these rows.
            n = len(pending)
            b.pending_dst.np[:n] = pending
            b.pending_rows.np[:n] = token_rows[pending]
            input_ids[b.pending_dst.to_device(n)] = self.last_sampled[b.pending_rows.to_device(n)]
        logits_idx = self._logits_indices(sampling, sample_rows)
        # Rows whose sampled token ``_sample`` keeps in ``last_sampled`` (none with drafts).
        self._sample_rows = None
        if all(not drafts for _, drafts in sampling):
            b.sample_rows.np[: len(sample_rows)] = rows[sample_rows]
            self._sample_rows = b.sample_rows.to_device(len(sample_rows))
        positions_dev = b.positions.to_device(total_tokens)
        if self.device.type == "cuda":
            # Every copy out of the host buffers is queued: the next step may refill them once
            # this event (ahead of this step's forward) has passed.
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        return common, input_ids, positions_dev, logits_idx

    def _logits_indices(
        self, sampling: list[tuple[RequestState, list[int]]], sample_rows: list[int]
    ) -> torch.Tensor:
        """Each sampling row needs logits at its last token, plus one per draft before it."""
        ends = self.buffers.query_start_loc.np[1:][sample_rows].astype(np.int64)
        if not any(d for _, d in sampling):  # no drafts: the last token of each row
            self.buffers.logits_indices.np[: len(ends)] = ends - 1
            return self.buffers.logits_indices.to_device(len(ends))
        counts = np.fromiter((len(d) + 1 for _, d in sampling), dtype=np.int64,
                             count=len(sampling))
        first = np.repeat(ends - counts, counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        num_logits = int(counts.sum())
        self.buffers.logits_indices.np[:num_logits] = first + within
        return self.buffers.logits_indices.to_device(num_logits)

    def _sample(
        self, sampling: list[tuple[RequestState, list[int]]], logits: torch.Tensor,
        draft_probs: dict[str, torch.Tensor],
    ) -> PendingOutput:
        """Sample one token per logits row and start copying them to the host.

        A request with drafts ``d_0..d_{k-1}`` has ``k + 1`` logits rows (one per draft
        position plus the bonus position); row ``j``'s distribution is computed as if
        ``d_0..d_{j-1}`` were already output, and the sampler verifies ``d_j`` against it by
        rejection sampling (``hitchllm.engine.rejection_sampler``), with the request's draft
        probabilities (``draft_probs``) when its proposer gave them. ``PendingOutput.result``
        then walks the rows.
        """
        metadata = self._sampling_metadata(sampling, draft_probs, logits.shape[0])
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids
        if self._sample_rows is not None:  # keep each row's token for a next step's input
            self.last_sampled[self._sample_rows] = sampled
        if self.device.type != "cuda":
            return PendingOutput(sampling, sampled, None, result.logprobs)
        # The host buffers in turn: the previous steps' may not have been read yet.
        self._sampled_slot = (self._sampled_slot + 1) % len(self._sampled_host)
        host = self._sampled_host[self._sampled_slot][: logits.shape[0]]
        host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingOutput(sampling, host, ready, result.logprobs)

    def _sampling_metadata(
        self, sampling: list[tuple[RequestState, list[int]]],
        draft_probs: dict[str, torch.Tensor], num_logit_rows: int,
    ) -> SamplingMetadata:
        """The step's sampling metadata (``num_logit_rows``: one per request, plus one per
        draft). While the same request states sample in the same rows without drafts, the
        previous step's is used again (a shallow copy) when nothing in it depends on the
        tokens sampled since (``SamplingMetadata.reusable``): a batch of decoding requests
        rebuilds it only when a request joins, leaves or moves."""
        rows = tuple(r for r, _ in sampling)
        reused = self._reusable_metadata
        if reused is not None and num_logit_rows == len(rows) and reused[0] == rows:
            return replace(reused[1])
        logit_rows = [(r, drafts[:j]) for r, drafts in sampling for j in range(len(drafts) + 1)]
        metadata = build_sampling_metadata(
            params=[r.sampling_params for r, _ in logit_rows],
            prompt_token_ids=[r.prompt_token_ids for r, _ in logit_rows],
            # Only draft rows need a copy (their output so far includes earlier drafts).
            output_token_ids=[r.output_token_ids + d if d else r.output_token_ids
                              for r, d in logit_rows],
            eos_token_ids=[r.eos_token_ids for r, _ in logit_rows],
            generators=[self._generator_for(r) for r, _ in logit_rows],
            default_generator=self.default_generator,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        metadata.logits_edits = self._logits_edits(logit_rows)
        if not metadata.all_greedy and len(logit_rows) > len(sampling):
            metadata.drafts = build_draft_tokens(
                [(drafts, draft_probs.get(r.request_id) if drafts else None)
                 for r, drafts in sampling],
                self.vocab_size, self.device)
        reusable = len(logit_rows) == len(rows) and metadata.reusable
        self._reusable_metadata = (rows, metadata) if reusable else None
        return metadata

    def _logits_edits(
        self, logit_rows: list[tuple[RequestState, list[int]]]
    ) -> list[LogitsEdit]:
        """Each used logits processor's edit for its rows (none when no request uses one)."""
        if not any(r.logits_processors for r, _ in logit_rows):
            return []
        rows: dict[LogitsProcessor, list[LogitsRow]] = {}
        for i, (r, drafts) in enumerate(logit_rows):
            for processor in r.logits_processors:
                rows.setdefault(processor, []).append(LogitsRow(
                    index=i, request_id=r.request_id, params=r.sampling_params,
                    output_token_ids=r.output_token_ids + drafts if drafts else r.output_token_ids,
                    num_draft_tokens=len(drafts)))
        return [p.prepare(p_rows, self.vocab_size, self.device) for p, p_rows in rows.items()]

    def _generator_for(self, request: RequestState) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A zero-filled KV-cache tensor. On the CPU it comes from ``calloc`` (through numpy),
    whose large allocations are fresh pages the kernel hands out zeroed on first touch, so
    nothing writes them up front: ``torch.zeros`` wrote every page of the bundled model's
    512 MiB cache, 0.25-0.3 s of a 2.5 s start-up. Pages are faulted in as blocks are first
    written. 64-byte aligned, as torch's own CPU allocator aligns."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)
