"""Forward passes of the draft model over its own paged KV cache.

Built from the core's pieces, as the target's ``ModelRunner`` is: the attention backend's impl
and metadata builder (one of each per layer / per runner, bound to the draft's own cache
tensors), ``StepBuffers`` for the flat per-step inputs, ``CommonAttentionMetadata`` to describe
a batch, and ``DecodeGraphs`` for CUDA graphs. A forward takes any mix of query lengths (the
catch-up over the tokens a request gained) and returns the logits at each request's last
token; batches of one token per request (the draft steps) are padded to a capture size and
replayed from a CUDA graph once ``capture_cuda_graphs`` ran, when the backend allows it.

With a backend that reads the batch from the device (``reads_batch_on_device``), a whole
greedy proposal is also captured as one graph per batch size, a *draft chain*: the catch-up
forward of each request's newest token, then K - 1 draft steps, each fed the argmax of the
step before, with positions, sequence lengths and slots advanced on the device in between. One
replay then replaces K forwards and their host work.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hitchllm.attention import (
    Attention,
    AttentionBackend,
    AttentionSpec,
    KVCacheSpec,
    set_forward_context,
)
from hitchllm.engine.cuda_graphs import graphs_for
from hitchllm.engine.step_buffers import StepBuffers


class DraftRunner:
    """Runs one draft model with one attention backend; ``allocate_kv_cache`` first."""

    def __init__(
        self, model: nn.Module, backend: type[AttentionBackend], spec: AttentionSpec,
        max_num_seqs: int, max_num_tokens: int, max_model_len: int, device: torch.device,
        graph_sizes: list[int],
    ) -> None:
        self.model = model
        self.backend = backend
        self.spec = spec
        self.device = device
        self.block_size = spec.block_size
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self.buffers = StepBuffers(max_num_tokens, max_num_seqs,
                                   -(-max_model_len // spec.block_size), device)
        self.builder = backend.get_builder_cls()(spec, device)
        self.layers = sorted((m for m in model.modules() if isinstance(m, Attention)),
                             key=lambda m: m.layer_index)
        self.kv_cache_specs: list[KVCacheSpec] = [
            layer.get_kv_cache_spec(spec.block_size, spec.kv_cache_dtype) for layer in self.layers
        ]
        self.graphs = graphs_for(backend, device, graph_sizes, max_num_seqs, max_num_tokens)
        self.chains = (graphs_for(backend, device, graph_sizes, max_num_seqs, max_num_tokens)
                       if backend.reads_batch_on_device else None)
        self.chain_drafts = 0
        # Which rows of a chain batch are requests (the others are padding: never written).
        self._real_rows = torch.zeros(max_num_seqs, dtype=torch.bool, device=device)
        self._row_index = torch.arange(max_num_seqs, device=device)
        self.vocab_size: int | None = None
        self._inputs_copied: torch.cuda.Event | None = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate and bind every layer's cache with ``num_blocks`` blocks."""
        impl_cls = self.backend.get_impl_cls()
        for layer, kv_spec in zip(self.layers, self.kv_cache_specs, strict=True):
            shape = self.backend.get_kv_cache_shape_for_spec(num_blocks, kv_spec)
            cache = torch.zeros(shape, dtype=kv_spec.dtype, device=self.device)
            impl = impl_cls(layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads,
                            self.spec)
            layer.bind(impl, cache)

    @torch.inference_mode()
    def capture_cuda_graphs(self, num_drafts: int, vocab_size: int) -> None:
        """Capture the one-token-per-request forward at every graph size, and the draft chain
        of ``num_drafts`` greedy drafts (over the target's ``vocab_size``) where the backend
        allows it (no-op without graphs)."""
        if self.graphs is None:
            return
        b = self.buffers

        def prepare(size: int, query_len: int) -> None:
            b.pad_decode_inputs(0, size)
            b.input_ids.to_device(size)
            b.positions.to_device(size)
            b.slot_mapping.to_device(size)
            common = b.common_metadata(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                                       np.zeros((0, 1), dtype=np.int32), 0, cuda_graph=True,
                                       max_model_len=self.max_model_len, padded_reqs=size)
            self._real_rows[:size] = False
            self._graph_metadata = self.builder.build(common)

        def forward(size: int, query_len: int) -> torch.Tensor:
            with set_forward_context(self._graph_metadata):
                return self.model(b.input_ids.device[:size], b.positions.device[:size])

        self.graphs.capture(prepare, forward)
        if self.chains is not None and num_drafts > 0:
            self.chain_drafts, self.vocab_size = num_drafts, vocab_size
            self.chains.capture(prepare, lambda size, _: self._chain(size))
        del self._graph_metadata

    def _chain(self, size: int) -> torch.Tensor:
        """The draft chain over the batch in the buffers (see the module docstring): the
        ``[size, chain_drafts]`` greedy drafts."""
        b = self.buffers
        ids, positions = b.input_ids.device[:size], b.positions.device[:size]
        seq_lens, slots = b.seq_lens.device[:size], b.slot_mapping.device[:size]
        rows, real = self._row_index[:size], self._real_rows[:size]
        drafts = []
        for step in range(self.chain_drafts):
            if step:
                ids.copy_(drafts[-1])
                positions.add_(1)
                seq_lens.add_(1)
                block = b.block_table[rows, positions // self.block_size].to(torch.int64)
                slot = block * self.block_size + positions % self.block_size
                slots.copy_(torch.where(real, slot, -1))
            with set_forward_context(self._graph_metadata):
                hidden = self.model(ids, positions)
            logits = self.model.compute_logits(hidden)
            drafts.append(logits[:, : self.vocab_size].argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def chain_size(self, num_reqs: int) -> int | None:
        """The chain graph that holds ``num_reqs`` requests (None: none captured)."""
        if self.chains is None or not self.chains.captured:
            return None
        return self.chains.padded_size(num_reqs)

    @torch.inference_mode()
    def run_chain(self, size: int, token_ids: np.ndarray, num_computed: np.ndarray,
                  block_table: np.ndarray) -> torch.Tensor:
        """Replay the draft chain of ``size`` for requests whose newest token
        (``token_ids[i]``, at position ``num_computed[i]``) is the only one their cache
        lacks; ``block_table`` must reach ``chain_drafts - 1`` positions further. Returns the
        ``[n, chain_drafts]`` drafts on the device."""
        b = self.buffers
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        n = len(token_ids)
        last = num_computed + self.chain_drafts - 1
        blocks = block_table[np.arange(n), num_computed // self.block_size].astype(np.int64)
        b.input_ids.np[:n] = token_ids
        b.positions.np[:n] = num_computed
        b.slot_mapping.np[:n] = blocks * self.block_size + num_computed % self.block_size
        b.pad_decode_inputs(n, size)
        num_cols = -(-int(last.max() + 1) // self.block_size)
        b.common_metadata(np.ones(n, dtype=np.int64), num_computed, block_table[:, :num_cols],
                          n, cuda_graph=True, max_model_len=self.max_model_len,
                          padded_reqs=size)
        b.input_ids.to_device(size)
        b.positions.to_device(size)
        self._real_rows[:size].copy_(self._row_index[:size] < n)
        self._inputs_copied = torch.cuda.Event()
        self._inputs_copied.record()
        return self.chains.replay(size)[:n]

    @torch.inference_mode()
    def forward(
        self, query_lens: np.ndarray, num_computed: np.ndarray, block_table: np.ndarray,
        token_ids: np.ndarray | None = None, device_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute ``query_lens[i]`` new tokens of request ``i`` from position
        ``num_computed[i]`` (its cached K/V through ``block_table[i]``) and return the
        ``[num_reqs, vocab]`` logits at each request's last new token.

        The tokens come packed from the host (``token_ids``) or, for one token per request,
        from the device (``device_token_ids``: the previous draft step's samples).
        """
        b = self.buffers
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the last forward's host buffers were copied
        n = len(query_lens)
        num_tokens = int(query_lens.sum())
        ends = np.cumsum(query_lens)
        token_req = np.repeat(np.arange(n), query_lens)
        positions = num_computed[token_req] + np.arange(num_tokens) - (ends - query_lens)[token_req]
        b.positions.np[:num_tokens] = positions
        blocks = block_table[token_req, positions // self.block_size].astype(np.int64)
        b.slot_mapping.np[:num_tokens] = blocks * self.block_size + positions % self.block_size
        # The columns this batch's contexts reach, as the target's runner passes them.
        num_cols = -(-int((num_computed + query_lens).max()) // self.block_size)
        block_table = block_table[:, :num_cols]
        graph_size = None
        if self.graphs is not None and num_tokens == n:
            graph_size = self.graphs.padded_size(n)
        total = num_tokens
        if graph_size is not None:
            b.pad_decode_inputs(num_tokens, graph_size)
            total = graph_size
        if token_ids is not None:
            b.input_ids.np[:num_tokens] = token_ids
            input_ids = b.input_ids.to_device(total)
        else:
            assert device_token_ids is not None and num_tokens == n
            input_ids = b.input_ids.device[:total]
            input_ids[:n].copy_(device_token_ids)
        common = b.common_metadata(query_lens, num_computed, block_table, num_tokens,
                                   cuda_graph=graph_size is not None,
                                   max_model_len=self.max_model_len, padded_reqs=graph_size)
        positions_dev = b.positions.to_device(total)
        b.logits_indices.np[:n] = ends - 1
        last = b.logits_indices.to_device(n)
        if self.device.type == "cuda":
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        metadata = self.builder.build(common)
        if graph_size is not None and self.graphs is not None and self.graphs.captured:
            hidden = self.graphs.replay(graph_size)
        else:
            with set_forward_context(metadata):
                hidden = self.model(input_ids, positions_dev)
        return self.model.compute_logits(hidden[last])
