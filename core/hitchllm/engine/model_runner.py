"""Runs one scheduled batch: flat input tensors, one forward pass, logits where sampling
happens, sampling. Owns the KV-cache tensors and the backend's metadata builder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hitchllm.attention import (
    Attention,
    AttentionBackend,
    AttentionSpec,
    CommonAttentionMetadata,
    set_forward_context,
)
from hitchllm.engine.input_batch import InputBatch
from hitchllm.engine.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from hitchllm.engine.sampler import Sampler, SamplerOutput
from hitchllm.engine.sampling_metadata import build_sampling_metadata
from hitchllm.outputs import Logprob
from hitchllm.request import Request
from hitchllm.scheduler.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    """Tokens emitted per request id this step (more than one when drafts were accepted),
    and, when asked, one logprobs entry per emitted token."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Executes scheduled batches of one model with one attention backend."""

    def __init__(
        self,
        model: nn.Module,
        backend: type[AttentionBackend],
        spec: AttentionSpec,
        num_blocks: int,
        max_num_seqs: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        seed: int,
        before_forward: Callable[..., Any] | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.before_forward = before_forward
        self.block_size = spec.block_size
        self.vocab_size = vocab_size
        max_blocks_per_req = -(-max_model_len // spec.block_size)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, max_blocks_per_req)
        self.kv_caches = self._bind_attention(backend, spec, num_blocks)
        self.builder = backend.get_builder_cls()(spec, device)
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def _bind_attention(
        self, backend: type[AttentionBackend], spec: AttentionSpec, num_blocks: int
    ) -> list[torch.Tensor]:
        layers = sorted(
            (m for m in self.model.modules() if isinstance(m, Attention)),
            key=lambda m: m.layer_index,
        )
        impl_cls = backend.get_impl_cls()
        caches = []
        for layer in layers:
            shape = backend.get_kv_cache_shape(
                num_blocks, spec.block_size, layer.num_kv_heads, layer.head_size
            )
            cache = torch.zeros(shape, dtype=spec.kv_cache_dtype, device=self.device)
            impl = impl_cls(layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads, spec)
            layer.bind(impl, cache)
            caches.append(cache)
        return caches

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> RunnerOutput:
        """Run the batch; ``block_ids`` maps each scheduled request id to its block list."""
        for rid in sched.released_ids:
            self.input_batch.release(rid)
        for rid in sched.finished_ids:
            self._generators.pop(rid, None)
        if sched.is_empty:
            return RunnerOutput()

        requests = sched.requests
        rows = np.fromiter(
            (self.input_batch.sync(r, block_ids[r.request_id]) for r in requests),
            dtype=np.int64, count=len(requests),
        )
        num_sched = np.asarray(sched.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.fromiter(
            (r.num_computed_tokens for r in requests), dtype=np.int64, count=len(requests)
        )
        common, input_ids, positions = self._prepare_inputs(rows, num_sched, num_computed)
        attn_metadata = self.builder.build(common)
        if self.before_forward is not None:
            self.before_forward(requests=requests, num_scheduled_tokens=sched.num_scheduled_tokens)
        with set_forward_context(attn_metadata):
            hidden = self.model(input_ids, positions)

        prompt_lps = {}
        if any(r.sampling_params.prompt_logprobs is not None for r in requests):
            prompt_lps = compute_prompt_logprobs(
                self.model, hidden, requests, num_computed, common.query_start_loc_cpu.numpy())
        sample_rows = [i for i, s in enumerate(sched.samples) if s]
        if not sample_rows:
            return RunnerOutput(prompt_logprobs=prompt_lps)
        sampling_requests = [requests[i] for i in sample_rows]
        # Each sampling row needs logits at its last token, plus one per draft token before it.
        ends = common.query_start_loc_cpu[1:].numpy()[sample_rows]
        counts = np.fromiter((len(r.spec_token_ids) + 1 for r in sampling_requests),
                             dtype=np.int64, count=len(sampling_requests))
        first = np.repeat(ends - counts, counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_idx = self._to_device(torch.from_numpy(first + within))
        logits = self.model.compute_logits(hidden[logits_idx])
        result = self._sample(sampling_requests, logits)
        result.prompt_logprobs = prompt_lps
        return result

    def _prepare_inputs(
        self, rows: np.ndarray, num_sched: np.ndarray, num_computed: np.ndarray
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        num_reqs = len(rows)
        num_tokens = int(num_sched.sum())
        cu = np.cumsum(num_sched)
        token_req = np.repeat(np.arange(num_reqs), num_sched)
        offsets = np.arange(num_tokens) - (cu - num_sched)[token_req]
        positions = num_computed[token_req] + offsets
        token_rows = rows[token_req]
        input_ids = self.input_batch.token_ids[token_rows, positions]
        block_ids = self.input_batch.block_table[token_rows, positions // self.block_size]
        slot_mapping = block_ids.astype(np.int64) * self.block_size + positions % self.block_size

        seq_lens = (num_computed + num_sched).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        num_block_cols = -(-max_seq_len // self.block_size)
        block_table = self.input_batch.block_table[rows, :num_block_cols]
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        qsl[1:] = cu

        qsl_cpu = torch.from_numpy(qsl)
        seq_lens_cpu = torch.from_numpy(seq_lens)
        common = CommonAttentionMetadata(
            query_start_loc=self._to_device(qsl_cpu),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=self._to_device(seq_lens_cpu),
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=torch.from_numpy(num_computed.astype(np.int32)),
            block_table=self._to_device(torch.from_numpy(np.ascontiguousarray(block_table))),
            slot_mapping=self._to_device(torch.from_numpy(slot_mapping)),
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=int(num_sched.max()),
            max_seq_len=max_seq_len,
        )
        return (
            common,
            self._to_device(torch.from_numpy(input_ids)),
            self._to_device(torch.from_numpy(positions)),
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> RunnerOutput:
        """Sample one token per logits row and verify speculative drafts.

        A request with drafts ``d_0..d_{k-1}`` has ``k + 1`` logits rows (one per draft
        position plus the bonus position); row ``j`` is sampled as if ``d_0..d_{j-1}`` were
        already output. Walking the rows, the sampled token is emitted and the walk goes on only
        while it equals the draft. This is exact rejection sampling for drafts given as tokens:
        a draft is accepted with probability ``p_j(d_j)``, and on rejection the emitted token is
        distributed as ``p_j`` without ``d_j``.
        """
        rows: list[tuple[Request, int]] = [
            (r, j) for r in requests for j in range(len(r.spec_token_ids) + 1)
        ]
        metadata = build_sampling_metadata(
            params=[r.sampling_params for r, _ in rows],
            prompt_token_ids=[r.prompt_token_ids for r, _ in rows],
            # Only draft rows need a copy (their output so far includes earlier drafts).
            output_token_ids=[r.output_token_ids + r.spec_token_ids[:j] if j else
                              r.output_token_ids for r, j in rows],
            eos_token_ids=[r.eos_token_ids for r, _ in rows],
            generators=[self._generator_for(r) for r, _ in rows],
            default_generator=self.default_generator,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        result = self.sampler(logits, metadata)
        # The step's one device-to-host sync: the tokens (and logprobs) go back to the host.
        sampled = result.sampled_token_ids.tolist()
        entries = self._logprob_entries(rows, result) if result.logprobs is not None else None
        out = RunnerOutput()
        i = 0
        for r in requests:
            drafts = r.spec_token_ids
            tokens = []
            for j in range(len(drafts) + 1):
                tokens.append(sampled[i + j])
                if j == len(drafts) or sampled[i + j] != drafts[j]:
                    break
            out.sampled[r.request_id] = tokens
            if entries is not None and r.sampling_params.logprobs is not None:
                out.logprobs[r.request_id] = entries[i : i + len(tokens)]
            i += len(drafts) + 1
        return out

    @staticmethod
    def _logprob_entries(
        rows: list[tuple[Request, int]], result: SamplerOutput
    ) -> list[dict[int, Logprob]]:
        assert result.logprobs is not None
        ids = result.logprobs.token_ids.tolist()
        lps = result.logprobs.logprobs.tolist()
        ranks = result.logprobs.ranks.tolist()
        entries = []
        for i, (r, _) in enumerate(rows):
            k = r.sampling_params.logprobs or 0
            entry = {ids[i][0]: Logprob(lps[i][0], ranks[i])}
            for j in range(1, k + 1):
                entry.setdefault(ids[i][j], Logprob(lps[i][j], j))
            entries.append(entry)
        return entries

    def _generator_for(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen
