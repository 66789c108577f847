"""CUDA-graph support of TRITON_MLA's decode (``CudaGraphSupport.UNIFORM_DECODE``).

CPU (Triton's interpreter, float32): the builder's metadata for a decode batch is views of the
engine's buffers; a padded graph batch (padding requests with context 0 and slot -1, the
length bound ``max_model_len``) gives the float64 reference for its real requests, zeros for
the padding ones, and leaves every real block but the new tokens' slots alone; the decode step
reads no device value back to the host. GPU: a decode step captured into a CUDA graph replays
new batches written into the same buffers correctly, and an engine with graphs generates the
same tokens as an eager one on a tiny DeepSeek-V2 in bf16.
"""

from __future__ import annotations

import pytest
import torch
from mla_checkpoints import CONFIGS, MOE_CONFIGS, build_tiny_deepseek
from test_mla_attention import DIMS, reference_attention
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
pytest.importorskip("hitchllm_attention_mla")

from hitchllm import LLM, SamplingParams
from hitchllm.attention import AttentionSpec, CommonAttentionMetadata, CudaGraphSupport
from hitchllm.attention.torch_backend import TorchAttentionMetadata
from hitchllm.layers import ColumnParallelLinear
from hitchllm_attention_mla import MLAAttention
from hitchllm_attention_mla.triton_mla import (
    DEFAULT_TILES,
    TritonMLABackend,
    TritonMLADecodeMetadata,
    decode_splits,
)

BLOCK, NUM_BLOCKS, COLS = 4, 64, 8
LENGTH_BOUND = 4096  # a graph batch's max_seq_len: the engine's max_model_len


class DecodeBatch:
    """A decode batch written into engine-like buffers of ``size`` rows (the first
    ``len(contexts)`` real, the rest padding), its cached latents and new tokens."""

    def __init__(self, contexts: list[int], size: int, device: str, dtype: torch.dtype,
                 cache: torch.Tensor, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        n, d = len(contexts), DIMS
        perm = torch.randperm(NUM_BLOCKS, generator=gen)[: size * COLS].view(size, COLS)
        self.block_table = perm.int().to(device)
        self.latents = [torch.randn(c + 1, d.latent_width, generator=gen) for c in contexts]
        self.slots = [perm[i, torch.arange(c + 1) // BLOCK].long() * BLOCK
                      + torch.arange(c + 1) % BLOCK for i, c in enumerate(contexts)]
        for s, lat in zip(self.slots, self.latents):
            TritonMLABackend.get_impl_cls().write_latents(cache, lat[:-1].to(cache),
                                                          s[:-1].to(device))
        self.contexts = contexts
        self.seq_lens = torch.tensor([c + 1 for c in contexts] + [0] * (size - n),
                                     dtype=torch.int32)
        self.slot_mapping = torch.tensor([s[-1].item() for s in self.slots] + [-1] * (size - n))
        self.query = torch.randn(size, d.num_heads, d.qk_head_dim, generator=gen).to(device,
                                                                                     dtype)
        self.new = torch.stack([lat[-1] for lat in self.latents]
                               + [torch.randn(d.latent_width, generator=gen)] * (size - n))
        self.new = self.new.to(device, dtype)
        self.size, self.device = size, device

    def common(self, cuda_graph: bool) -> CommonAttentionMetadata:
        qsl = torch.arange(self.size + 1, dtype=torch.int32)
        dev = self.device
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl,
            seq_lens=self.seq_lens.to(dev), seq_lens_cpu=self.seq_lens,
            num_computed_tokens_cpu=(self.seq_lens - 1).clamp(min=0),
            block_table=self.block_table, slot_mapping=self.slot_mapping.to(dev),
            num_reqs=self.size, num_actual_tokens=self.size, max_query_len=1,
            max_seq_len=LENGTH_BOUND if cuda_graph else int(self.seq_lens.max()),
            cuda_graph=cuda_graph)

    def expected(self, w_kv: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.cat([reference_attention(self.query[i : i + 1].cpu(), lat, w_kv.cpu(),
                                              c, scale)
                          for i, (lat, c) in enumerate(zip(self.latents, self.contexts))])


def make_layer(device: str, dtype: torch.dtype, scale: float = 0.3):
    """An MLA layer on TRITON_MLA with a random up-projection, its impl, cache and spec."""
    torch.manual_seed(0)
    d = DIMS
    kv_b_proj = ColumnParallelLinear(d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim
                                                                    + d.v_head_dim))
    with torch.no_grad():
        kv_b_proj.weight.normal_(0, 0.3)
    kv_b_proj.to(device, dtype)
    layer = MLAAttention(d, scale, 0, kv_b_proj)
    spec = AttentionSpec.for_device(torch.device(device), dtype=dtype, kv_cache_dtype=dtype,
                                    head_size=d.latent_width, num_heads=d.num_heads,
                                    num_kv_heads=1, block_size=BLOCK, use_mla=True)
    kv_spec = layer.get_kv_cache_spec(BLOCK, dtype)
    cache = torch.zeros(TritonMLABackend.get_kv_cache_shape_for_spec(NUM_BLOCKS, kv_spec),
                        dtype=dtype, device=device)
    impl = TritonMLABackend.get_impl_cls()(d.num_heads, d.latent_width, scale, 1, spec)
    layer.bind(impl, cache)
    return impl, cache, spec, kv_b_proj.weight


def run_impl(impl, cache, batch: DecodeBatch, metadata) -> torch.Tensor:
    return impl.forward(batch.query, batch.new[:, None, :], None, cache, metadata)


def test_backend_declares_uniform_decode_graphs():
    assert TritonMLABackend.cuda_graph_support is CudaGraphSupport.UNIFORM_DECODE


def test_graph_decode_metadata_is_views_of_the_engine_buffers():
    _, cache, spec, _ = make_layer("cpu", torch.float32)
    batch = DecodeBatch([5, 13, 0], size=5, device="cpu", dtype=torch.float32, cache=cache)
    common = batch.common(cuda_graph=True)
    builder = TritonMLABackend.get_builder_cls()(spec, torch.device("cpu"))
    meta = builder.build(common)
    assert isinstance(meta, TritonMLADecodeMetadata)
    for ours, engine in ((meta.seq_lens, common.seq_lens), (meta.block_table, common.block_table),
                         (meta.slot_mapping, common.slot_mapping)):
        assert ours.data_ptr() == engine.data_ptr()
        assert ours.untyped_storage().data_ptr() == engine.untyped_storage().data_ptr()
    assert (meta.num_reqs, meta.max_seq_len) == (5, LENGTH_BOUND)


def test_mixed_batches_stay_eager_and_are_refused_in_a_graph():
    _, _, spec, _ = make_layer("cpu", torch.float32)
    builder = TritonMLABackend.get_builder_cls()(spec, torch.device("cpu"))
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    seq = torch.tensor([3, 6], dtype=torch.int32)

    def common(cuda_graph):
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
            num_computed_tokens_cpu=torch.tensor([0, 5], dtype=torch.int32),
            block_table=torch.arange(4, dtype=torch.int32).view(2, 2),
            slot_mapping=torch.tensor([0, 1, 2, 9]), num_reqs=2, num_actual_tokens=4,
            max_query_len=3, max_seq_len=6, cuda_graph=cuda_graph)

    meta = builder.build(common(False))
    assert isinstance(meta, TorchAttentionMetadata) and len(meta.prefills) == 1
    with pytest.raises(ValueError, match="uniform decode"):
        builder.build(common(True))


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_padded_decode_batch_matches_float64_and_pads_with_zeros(cuda_graph):
    """A graph batch (length bound 4096: many splits past every context) and the same batch
    eager (this step's longest context) both give the reference."""
    impl, cache, spec, w_kv = make_layer("cpu", torch.float32)
    contexts = [5, 30, 0]
    batch = DecodeBatch(contexts, size=6, device="cpu", dtype=torch.float32, cache=cache)
    before = cache.clone()
    meta = TritonMLABackend.get_builder_cls()(spec, torch.device("cpu")).build(
        batch.common(cuda_graph))
    out = run_impl(impl, cache, batch, meta)
    assert out.shape == (6, DIMS.num_heads, DIMS.v_head_dim)
    torch.testing.assert_close(out[:3].double(), batch.expected(w_kv, impl.scale),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))  # padding: zeros, not NaN
    # Only the new tokens' slots and the spare block (padding writes) changed.
    changed = (cache != before).flatten(2).any(-1).flatten().nonzero().flatten()
    spare = set(range(NUM_BLOCKS * BLOCK, (NUM_BLOCKS + 1) * BLOCK))
    assert set(changed.tolist()) - spare == {int(s[-1]) for s in batch.slots}
    assert set(changed.tolist()) & spare  # the padding slots went to the spare block


def test_split_count_depends_on_batch_shape_and_length_bound_only():
    assert decode_splits(8, 128, LENGTH_BOUND) == decode_splits(8, 128, LENGTH_BOUND)
    assert decode_splits(1, 16, LENGTH_BOUND) == 128  # one program per split
    assert decode_splits(64, 128, LENGTH_BOUND) == 1  # 512 programs without splitting
    assert decode_splits(1, 16, 20) == 2  # no more splits than tiles of 16 tokens


HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_assert_async"}


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_decode_step_reads_nothing_back_to_the_host(monkeypatch):
    """The impl's own torch ops for a graph batch (the Triton launch replaced by a recorder:
    the interpreter itself copies to the host) contain no op that syncs with the host."""
    import hitchllm_attention_mla.triton_mla_kernel as kernel_module

    impl, cache, spec, _ = make_layer("cpu", torch.float32)
    batch = DecodeBatch([5, 30], size=4, device="cpu", dtype=torch.float32, cache=cache)
    meta = TritonMLABackend.get_builder_cls()(spec, torch.device("cpu")).build(
        batch.common(True))
    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(kernel_module, "mla_decode_partials", FakeKernel())
    with OpRecorder() as recorder:
        run_impl(impl, cache, batch, meta)
    head_blocks = -(-DIMS.num_heads // DEFAULT_TILES.block_h)
    assert launches == [(head_blocks, decode_splits(4, DIMS.num_heads, LENGTH_BOUND), 4)]
    assert {"index_copy_", "bmm"} <= recorder.ops  # the recorder sees the impl's ops
    assert not recorder.ops & HOST_READS, recorder.ops & HOST_READS


# --- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_captured_decode_replays_new_batches_in_the_same_buffers():
    """One decode step captured into a CUDA graph, then replayed after other batches (other
    contexts, padding, blocks) were copied into the same buffers: the reference each time."""
    impl, cache, spec, w_kv = make_layer("cuda", torch.float32)
    first = DecodeBatch([7, 30, 2], size=4, device="cuda", dtype=torch.float32, cache=cache)
    common = first.common(cuda_graph=True)
    builder = TritonMLABackend.get_builder_cls()(spec, torch.device("cuda"))
    meta = builder.build(common)
    query, new = first.query.clone(), first.new.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        impl.forward(query, new[:, None], None, cache, meta)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(query, new[:, None], None, cache, meta)
    for seed, contexts in enumerate(([7, 30, 2], [25, 1], [3, 9, 17, 11]), start=1):
        cache.zero_()
        batch = DecodeBatch(contexts, size=4, device="cuda", dtype=torch.float32, cache=cache,
                            seed=seed)
        fresh = batch.common(cuda_graph=True)
        common.seq_lens.copy_(fresh.seq_lens)
        common.block_table.copy_(fresh.block_table)
        common.slot_mapping.copy_(fresh.slot_mapping)
        query.copy_(batch.query)
        new.copy_(batch.new)
        graph.replay()
        torch.cuda.synchronize()
        n = len(contexts)
        # float32 through tl.dot: TF32 products on the GPU.
        torch.testing.assert_close(out[:n].double().cpu(), batch.expected(w_kv, impl.scale),
                                   rtol=1e-2, atol=1e-2)
        assert not out[n:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["v2-yarn", "v2-lite-moe"])
def test_gpu_engine_with_graphs_equals_eager_on_deepseek_v2_bf16(tmp_path, config):
    """Dense layers only (MLA alone), and with MoE layers (whose experts run densely inside
    a graph, grouped by expert eagerly)."""
    arch, overrides = {**CONFIGS, **MOE_CONFIGS}[config]
    path = build_tiny_deepseek(tmp_path / "v2", arch, seed=3, **overrides)
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(n)]
               for i, n in enumerate((1, 3, 7, 16, 29, 45, 5, 12, 33))]
    lens = (40, 3, 17, 25, 9, 33, 1, 12, 28)  # the batch shrinks through several graph sizes
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lens]

    def generate(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    kwargs = dict(device="cuda", dtype="bfloat16", block_size=16,
                  attention_backend="TRITON_MLA")
    graphs = LLM(path, **kwargs)
    runner = graphs.engine.executor.runner
    assert runner.graphs.captured
    replays = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda size, query_len=1: replays.append(size) or replay(size,
                                                                                     query_len)
    got = generate(graphs)
    assert {1, 2, 4, 8} <= set(replays)
    eager = LLM(path, enforce_eager=True, **kwargs)
    assert not eager.engine.executor.runner.graphs.captured
    assert got == generate(eager)
