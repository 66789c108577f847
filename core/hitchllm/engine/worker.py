"""One rank of an engine: its device, its shard of the model, its runner and its KV cache.

The engine describes what to build in a ``WorkerSetup`` (plain, picklable data); a ``Worker``
is the one place where a model is loaded and its ``ModelRunner`` built. The in-process
executor runs one worker in the engine's own process; the multiprocess executor runs one per
rank (tensor-parallel rank of a pipeline stage) in a worker process (a Ray actor would host
the same class). Each rank builds its layers after joining the process group, so the layers' weight
loaders keep only the rank's slice of every checkpoint tensor: its query heads, its KV heads
(replicated when there are fewer KV heads than ranks), its vocabulary rows.

Every rank runs the same step plans, computes the same gathered logits and samples with the
same seeded generators, so every rank holds the same request states and the same sampled
tokens on its device (a next step's inputs, under async scheduling, come from there). Only
rank 0's output goes back to the engine; the other ranks send a digest of theirs, which the
executor compares to rank 0's so that ranks that drift apart fail loudly.

With pipeline stages only the last stage samples: its tensor-parallel rank 0 answers and its
other ranks send digests; the earlier stages run their layers, hand the hidden state on and
learn each step's tokens from the driver with the next plan (``launch_step``'s
``fed_tokens``).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from hitchllm import distributed, timeline
from hitchllm.attention import FP8_DTYPES, Attention, AttentionBackend, AttentionSpec
from hitchllm.attention.triton_support import pin_triton_cache_dir
from hitchllm.config import EngineConfig, ModelConfig
from hitchllm.distributed import ParallelRank
from hitchllm.engine.cuda_graphs import default_capture_sizes
from hitchllm.engine.kv_sizing import MemorySnapshot, cuda_kv_cache_bytes
from hitchllm.engine.model_runner import ModelRunner
from hitchllm.engine.piecewise_graphs import default_token_sizes
from hitchllm.engine.runner_output import PendingOutput, RunnerOutput
from hitchllm.kv_transfer.connector import KVConnector, connector_class
from hitchllm.logits_processor import LogitsProcessor
from hitchllm.models import fused
from hitchllm.models.loader import load_model
from hitchllm.plugins import PluginRegistry, get_plugin_registry
from hitchllm.scheduler.step_plan import StepPlan
from hitchllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class WorkerSetup:
    """Everything a worker needs to build its rank of the engine (picklable).

    ``spec`` describes one rank's attention: its share of the query and KV heads.
    ``device`` is the engine's; with tensor parallelism on CUDA, rank ``r`` runs on
    ``cuda:r`` (of the cards ``CUDA_VISIBLE_DEVICES`` shows).
    """

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    spec: AttentionSpec
    attention_backend: type[AttentionBackend]
    max_model_len: int
    max_num_tokens: int
    eos_token_ids: tuple[int, ...]
    graph_query_lens: tuple[int, ...] = (1,)
    # Disaggregated serving: the engine's id, which its KV connectors name their transfers by.
    kv_engine_id: str = ""

    def device_for(self, rank: ParallelRank) -> torch.device:
        if self.device.type == "cuda" and rank.world_size > 1:
            return torch.device("cuda", rank.global_rank)
        return self.device


def plugin_logits_processors(
    registry: PluginRegistry, config: EngineConfig, tokenizer: object, vocab_size: int,
    eos_token_ids: tuple[int, ...],
) -> list[LogitsProcessor]:
    """The logits processors every installed plugin provides for an engine."""
    return [
        processor
        for result in registry.hook.hitchllm_logits_processors(
            engine_config=config, tokenizer=tokenizer, vocab_size=vocab_size,
            eos_token_ids=eos_token_ids)
        for processor in result or []
    ]


class Worker:
    """One rank: ``load_model``, ``build_runner`` (or ``load`` for both), then the runner's
    set-up calls and one ``launch_step`` per step.

    ``logits_processors`` are the engine's own when the worker runs in its process; a worker
    in another process builds its own from the plugins (with its own tokenizer), so that
    each rank edits its logits alike. ``device`` overrides ``setup.device_for(rank)`` where
    the rank's card is known otherwise (a Ray actor sees only its own card, as ``cuda:0``).
    """

    def __init__(
        self, setup: WorkerSetup, rank: ParallelRank | None = None,
        logits_processors: list[LogitsProcessor] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.setup = setup
        self.rank = rank or ParallelRank()
        self.device = device or setup.device_for(self.rank)
        if self.device.type == "cuda":
            pin_triton_cache_dir()  # before this rank compiles anything
        self.registry = get_plugin_registry()
        self._logits_processors = logits_processors
        self.memory_at_start: MemorySnapshot | None = None
        self.model: nn.Module | None = None
        self._runner: ModelRunner | None = None

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the worker has no model runner yet: call load() first")
        return self._runner

    # ---- start-up ----------------------------------------------------------------------

    def init_distributed(self, store: torch.distributed.Store, timeout_s: float) -> None:
        """Join the process group as this worker's rank (before ``load_model``, whose layers
        read the rank)."""
        distributed.init_distributed(self.rank, self.device, store, timeout_s)

    def load(self) -> ModelRunner:
        """``load_model`` then ``build_runner``."""
        self.load_model()
        return self.build_runner()

    def load_model(self) -> nn.Module:
        """Build this rank's shard of the model and load its weights; plugins then see the
        model (``hitchllm_model_loaded``, ``hitchllm_kv_cache_scales``)."""
        s, config = self.setup, self.setup.config
        if self.device.type == "cuda":
            self.memory_at_start = MemorySnapshot.take(self.device)
        fused.set_fusion(config.enable_fusion)
        model = load_model(s.model_config, self.registry, self.device, s.dtype,
                           config.quantization)
        self.registry.hook.hitchllm_model_loaded(model=model, engine_config=config)
        self.registry.hook.hitchllm_kv_cache_scales(
            model=model, model_config=s.model_config, engine_config=config,
            kv_cache_dtype=s.kv_cache_dtype)
        if self.rank.global_rank == 0:
            _report_unused_kv_scales(model, s.kv_cache_dtype, config.kv_cache_dtype)
        self.model = model
        return model

    def build_runner(self, keep_hidden_states: bool = False) -> ModelRunner:
        """The model runner of the loaded model (``keep_hidden_states`` for a proposer that
        drafts from the target's hidden states)."""
        if self.model is None:
            raise RuntimeError("build_runner needs the model: call load_model() first")
        s, config = self.setup, self.setup.config
        processors = self._logits_processors
        if processors is None:
            tokenizer = load_tokenizer(config.tokenizer or config.model)
            processors = plugin_logits_processors(
                self.registry, config, tokenizer, s.model_config.vocab_size, s.eos_token_ids)
        self._runner = ModelRunner(
            self.model, s.attention_backend, s.spec, config.max_num_seqs, s.max_num_tokens,
            s.max_model_len, s.model_config.vocab_size, self.device, config.seed,
            before_forward=self.registry.hook.hitchllm_before_forward,
            cuda_graph_sizes=config.cuda_graph_sizes
            or default_capture_sizes(min(config.max_num_seqs, s.max_num_tokens)),
            logits_processors=processors,
            keep_hidden_states=keep_hidden_states,
            graph_query_lens=s.graph_query_lens,
            samples=self.rank.is_last_stage,
            kv_connector=self._kv_connector(),
            piece_token_sizes=default_token_sizes(s.max_num_tokens)
            if config.piecewise_cuda_graphs else None,
        )
        return self._runner

    def _kv_connector(self) -> KVConnector | None:
        """This rank's KV connector, when the engine moves KV (``kv_transfer_config``)."""
        config = self.setup.config.kv_transfer_config
        if config is None:
            return None
        cls = connector_class(config, self.registry)
        return cls(config, self.setup.kv_engine_id, self.rank.tp_rank, self.rank.tp_size)

    def close(self) -> None:
        """Stop what the runner runs in the background (its KV connector's transfers)."""
        if self._runner is not None and self._runner.kv_connector is not None:
            self._runner.kv_connector.close()

    # ---- the runner's set-up and steps -------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> float | None:
        """This rank's KV cache, and its own host pool for its shard of every block (swap
        preemption; see ``ModelRunner.initialize_kv_cache``)."""
        return self.runner.initialize_kv_cache(num_blocks, num_host_blocks)

    def warm_up(self) -> None:
        """The runner's start-up steps (``ModelRunner.warm_up``); every rank runs the same."""
        self.runner.warm_up()

    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs (a pipeline stage's without its transfers: the runner
        receives and sends around each replay) and the pieces of prompt steps."""
        self.runner.capture_cuda_graphs()

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        """CUDA: the bytes this rank's card leaves for its KV cache (see
        ``cuda_kv_cache_bytes``), from a profiled worst-case step."""
        if self.memory_at_start is None:
            raise RuntimeError("kv_cache_bytes profiles CUDA memory; this worker is on "
                               f"{self.device}")
        return cuda_kv_cache_bytes(self.device, self.memory_at_start,
                                   self.runner.measure_peak_memory(), gpu_memory_utilization)

    def launch_step(
        self, plan: StepPlan, fed_tokens: dict[str, list[int]] | None = None
    ) -> PendingOutput:
        """Launch one step; its ``result()`` waits for it and advances this rank's request
        states. A next step may be launched first (its pending tokens are read on the
        device), as the engine does in one process under async scheduling.

        ``fed_tokens``: with pipeline stages, the tokens the last stage sampled since the
        previous plan, per request id; a stage that does not sample records them first."""
        if fed_tokens and not self.rank.is_last_stage:
            self.runner.append_fed_tokens(fed_tokens)
        return self.runner.execute_async(plan)


    def timeline_marks(self) -> list[timeline.Mark]:
        """This process's step-timeline marks so far (``HITCHLLM_STEP_TIMELINE``; empty
        without)."""
        return timeline.drain()


def output_digest(output: RunnerOutput) -> int:
    """A checksum of a step's sampled tokens, equal on ranks that sampled alike."""
    return zlib.crc32(repr(sorted(output.sampled.items())).encode())


def _report_unused_kv_scales(
    model: nn.Module, kv_cache_dtype: torch.dtype, kv_cache_dtype_name: str
) -> None:
    """Checkpoint KV-cache scales are loaded whatever the cache dtype; say so when they go
    unused rather than ignoring them silently."""
    if kv_cache_dtype in FP8_DTYPES:
        return
    layers = [m for m in model.modules()
              if isinstance(m, Attention) and m.kv_scales_from_checkpoint]
    if layers:
        logger.info(
            "the checkpoint has fp8 KV-cache scales (k_scale/v_scale) for %d attention "
            "layers; they are unused with kv_cache_dtype=%s (use --kv-cache-dtype fp8 to "
            "serve an fp8 KV cache with them)", len(layers), kv_cache_dtype_name)
