"""The engine loop: ``add_request``, then ``step()`` until done. One step is
schedule -> run the model -> fold the sampled tokens back into requests and outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hitchllm import timeline
from hitchllm.attention import FP8_DTYPES, AttentionSpec, bytes_per_shared_block
from hitchllm.attention.selector import select_attention_backend
from hitchllm.config import EngineConfig, ModelConfig, parse_size
from hitchllm.cpu_threads import apply_cpu_threads
from hitchllm.engine.drafting import Drafter
from hitchllm.engine.executor import (
    Executor,
    InProcessExecutor,
    RunnerOutputFuture,
    WorkerFailedError,
)
from hitchllm.engine.kv_swap import host_pool_blocks, host_pool_bytes
from hitchllm.engine.mp_executor import MultiprocExecutor
from hitchllm.engine.output_processor import OutputProcessor
from hitchllm.engine.pipeline_parallel import check_pipeline_parallel
from hitchllm.engine.ray_executor import RayExecutor
from hitchllm.engine.runner_output import RunnerOutput
from hitchllm.engine.startup_clock import StartupClock
from hitchllm.engine.tensor_parallel import check_tensor_parallel, heads_per_rank
from hitchllm.engine.worker import Worker, WorkerSetup, plugin_logits_processors
from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.kv_transfer.connector import KVTransferStats, connector_class
from hitchllm.kv_transfer.params import KVTransferParams
from hitchllm.kv_transfer.scheduling import KVTransferScheduling
from hitchllm.logger import init_logging
from hitchllm.logits_processor import LogitsProcessor
from hitchllm.lora import LORA_PLUGIN, LoRAAdapters, LoRACounters, LoRARequest
from hitchllm.outputs import RequestOutput
from hitchllm.plugins import get_plugin_registry
from hitchllm.request import Request, RequestStatus
from hitchllm.sampling_params import SamplingParams
from hitchllm.scheduler.policy import PreemptionPolicy
from hitchllm.scheduler.preemption import PreemptionMode, SwapCostModel
from hitchllm.scheduler.scheduler import Scheduler, SchedulerConfig
from hitchllm.scheduler.step_plan import StepPlan
from hitchllm.speculative import Proposer
from hitchllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Failed steps in a row after which the engine gives up (a broken device fails every step;
# isolating one bad request among B takes about log2(B) + 2).
MAX_CONSECUTIVE_STEP_FAILURES = 32
# Errors after which the device's (or a worker's) state cannot be trusted: the engine stops
# at once.
_DEVICE_ERRORS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "AcceleratorError", None), torch.OutOfMemoryError,
                WorkerFailedError) if t)

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 2**30
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# A consumer with nothing to compute while KV is on its way polls its connector this often.
KV_POLL_INTERVAL_S = 0.002
# SamplingParams fields that only a plugin's logits processor implements -> that plugin.
PLUGIN_SAMPLING_FIELDS = {"structured_outputs": "hitchllm-structured-output"}

Prompt = str | dict[str, Any]


@dataclass
class _Launched:
    """A step handed to the executor: its plan, the requests of its rows (as scheduled) and
    its output to come."""

    plan: StepPlan
    requests: list[Request]
    output: RunnerOutputFuture
    # The executor's index of the step (its launches counted from 0).
    index: int = 0
    launched_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Folded:
    """A completed step whose tokens the scheduler has; its outputs are still to build."""

    launched: _Launched
    result: RunnerOutput
    updated: list[Request]


@dataclass
class _StepWork:
    """What a step has under way, so that a failure can be tied to requests: ``running``
    are the requests of the phase now running (launch or completion of one batch),
    ``launched`` those of a batch launched but not yet completed."""

    running: list[Request] = field(default_factory=list)
    launched: list[Request] = field(default_factory=list)
    #: The plans of ``running`` and ``launched``: the blocks a failed or dropped plan was to
    #: write are suspect.
    plan: StepPlan | None = None
    launched_plan: StepPlan | None = None
    #: False while ``launched_plan`` waits for the step in flight before its launch (its
    #: requests need that step's tokens): dropped then, the runner never sees it.
    sent: bool = True


@dataclass
class EngineStats:
    """A snapshot of the engine's counters."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Speculative decoding (see ``SchedulerStats``); all 0 without a proposer.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # LoRA (``enable_lora``): the adapters of the running and of the waiting requests (sorted
    # names), and the adapter manager's totals (all empty / 0 without LoRA).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    lora: LoRACounters = field(default_factory=LoRACounters)
    # Prompt tokens computed (not served by the prefix cache or a producer's KV).
    num_prompt_tokens_computed: int = 0
    # Disaggregated serving: the KV connector's totals (tensor-parallel rank 0's), and the
    # requests that computed their prompt because their KV did not come.
    kv_transfer: KVTransferStats = field(default_factory=KVTransferStats)
    kv_load_fallbacks: int = 0
    # The most steps (of at least one request) the engine has had in flight at once: up to
    # pipeline_parallel_size with pipeline stages (micro-batches), else 1 or 2 (async
    # scheduling launches a step before the previous one completes).
    max_steps_in_flight: int = 0
    # Swap preemption (all 0 with preemption_mode=recompute): requests swapped out and back
    # in, requests recomputed instead (see ``SchedulerStats``), and the host pool's blocks
    # (per worker) held by swapped-out requests and in all.
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swap_fallbacks: int = 0
    host_blocks_used: int = 0
    num_host_blocks: int = 0


class LLMEngine:
    """Owns the tokenizer, the scheduler (with the KV cache manager) and the executor that
    runs the model runner(s)."""

    def __init__(self, config: EngineConfig) -> None:
        init_logging()
        self._startup = StartupClock()
        # The engine's own copy: hooks are handed ``engine_config`` as the engine's identity
        # (the LoRA plugin finds its adapters by it), so engines built from one (frozen,
        # shareable) config must not share it.
        self.config = config = config.model_copy()
        self.registry = get_plugin_registry()
        self.device = config.resolve_device()
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.dtype = config.resolve_dtype(mc.checkpoint_dtype, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        eos = self.tokenizer.eos_token_id
        # generation_config.json may name extra end-of-turn ids (Llama 3 <|eot_id|>, Qwen).
        eos_ids = dict.fromkeys(([] if eos is None else [eos]) + list(mc.eos_token_ids))
        # An end-of-sequence id outside the vocabulary can never be sampled (DeepSeek-V2's
        # config names 100001 in a 102400 vocabulary, but a shrunk copy may not have it).
        outside = [i for i in eos_ids if not 0 <= i < mc.vocab_size]
        if outside:
            logger.warning("end-of-sequence id(s) %s of %s are outside the model's vocabulary "
                           "of %d and can never be generated; they are not used", outside,
                           config.model, mc.vocab_size)
        self.eos_token_ids = tuple(i for i in eos_ids if i not in outside)
        self._startup.lap("config and tokenizer")

        self.kv_cache_dtype = config.resolve_kv_cache_dtype(self.dtype)
        self._check_fp8_kv_cache_support()
        self._check_lora_support()
        check_pipeline_parallel(config, mc, self.device, self.registry)
        self.kv_params = self._kv_transfer_params()
        check_tensor_parallel(config, mc, self.device)
        num_heads, num_kv_heads = heads_per_rank(mc, config.tensor_parallel_size)
        spec = AttentionSpec.for_device(
            self.device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            # An MLA model caches one latent vector per token: its width is the "head size".
            head_size=mc.mla_latent_width or mc.head_dim,
            num_heads=num_heads,
            num_kv_heads=1 if mc.use_mla else num_kv_heads,
            block_size=config.block_size,
            use_mla=mc.use_mla,
            sliding_window=mc.sliding_window,
        )
        self.attention_backend = select_attention_backend(
            spec, config.attention_backend, self.registry
        )
        logger.info("Using attention backend %s", self.attention_backend.name)

        max_num_tokens = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.logits_processors: list[LogitsProcessor] = plugin_logits_processors(
            self.registry, config, self.tokenizer, mc.vocab_size, self.eos_token_ids)
        setup = WorkerSetup(
            config=config, model_config=mc, device=self.device, dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype, spec=spec,
            attention_backend=self.attention_backend, max_model_len=self.max_model_len,
            max_num_tokens=max_num_tokens, eos_token_ids=self.eos_token_ids,
            # Verification steps where every request has K drafts run from graphs too.
            graph_query_lens=(1,) if config.speculative_method is None
            else (1, 1 + config.num_speculative_tokens),
            kv_engine_id="" if self.kv_params is None else self.kv_params.engine_id,
        )
        if self.device.type == "cpu":
            # Overlapped steps run the model on a thread of its own (below): a core is left
            # to the engine loop. With tensor parallelism the workers share the threads out.
            apply_cpu_threads(config.cpu_threads, overlap=self._overlaps(config)
                              and config.speculative_method is None)
        self.proposer: Proposer | None = None
        if config.distributed_executor_backend == "ray":
            # The model lives in Ray actors (at any tensor_parallel_size: Ray was asked for).
            self.executor: Executor = RayExecutor(setup)
        elif config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            # The model lives in the workers; this process keeps the scheduler.
            self.executor = MultiprocExecutor(setup)
        else:
            worker = Worker(setup, logits_processors=self.logits_processors)
            self.proposer = self._build_proposer(worker.load_model())
            worker.build_runner(keep_hidden_states=self.proposer is not None
                                and self.proposer.needs_hidden_states)
            # On the CPU a step computes as it is launched: overlapping the host's work
            # with it takes a thread of its own (see ``_overlap``).
            self.executor = InProcessExecutor(
                worker, forward_thread=(self.device.type == "cpu" and self._overlaps(config)
                                        and self.proposer is None))
        self._startup.lap("model")
        try:
            self._initialize_kv_cache()
        except BaseException:
            self.executor.close()  # no worker process outlives a failed start
            raise
        self.kv_cache = KVCacheManager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            extra_keys_fn=self._block_hash_extra_keys, num_host_blocks=self.num_host_blocks,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_num_tokens,
                max_model_len=self.max_model_len,
                policy=PreemptionPolicy(config.scheduling_policy),
                num_micro_batches=config.pipeline_parallel_size,
                preemption_mode=PreemptionMode(config.preemption_mode),
            ),
            self.kv_cache,
            on_finish=None if self.proposer is None else self.proposer.remove_requests,
            gates=[gate for result in self.registry.hook.hitchllm_admission_gates(
                engine_config=config) for gate in result or []],
            kv_transfer=None if config.kv_transfer_config is None
            else KVTransferScheduling(config.kv_transfer_config, self.kv_cache),
            swap_cost=SwapCostModel(swap_seconds_per_block=self._swap_seconds_per_block),
        )
        self.kv_transfer_stats = KVTransferStats()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = mc.vocab_size
        self.drafter: Drafter | None = None
        if self.proposer is not None:
            self.drafter = Drafter(self.proposer, config.num_speculative_tokens,
                                   self.max_model_len, mc.vocab_size, self.device)
        self._request_counter = itertools.count()
        # Overlap: the launched step whose tokens are not folded in yet (see ``step``).
        self._overlap = self._overlaps(config) and self.proposer is None
        # Pipeline stages: up to this many steps in flight, over disjoint requests.
        self._micro_batches = config.pipeline_parallel_size
        # Launched steps whose tokens are not folded in yet, oldest first.
        self._in_flight: deque[_Launched] = deque()
        self._max_steps_in_flight = 0
        self._num_launched = 0
        self._consecutive_failures = 0
        # HITCHLLM_STEP_TIMELINE=1: marks of every step (``hitchllm.timeline``). The runner's
        # device marks need the device when it runs in this process.
        timeline.start("driver", self.device if isinstance(self.executor, InProcessExecutor)
                       else None)
        self._startup.lap("scheduler")
        logger.info("%s", self._startup.summary())

    @property
    def startup_times(self) -> dict[str, float]:
        """Seconds each start-up phase took, in order (the first, where the platform tells a
        process's age: from the process's start to the engine's creation)."""
        return dict(self._startup.phases)

    @staticmethod
    def _overlaps(config: EngineConfig) -> bool:
        """Whether steps may overlap (async scheduling; also never with a proposer, which
        needs each step's tokens to propose the next drafts). Not with pipeline stages: the
        first stage needs each step's tokens on the host (the driver sends them with the
        next plan); they overlap micro-batches instead."""
        return config.async_scheduling and config.pipeline_parallel_size == 1

    def close(self) -> None:
        """Stop the executor's worker processes (tensor parallelism); the engine cannot run
        steps afterwards. Safe to call more than once; also runs when the engine is garbage
        collected and at interpreter exit."""
        executor = getattr(self, "executor", None)  # absent when __init__ failed early
        if executor is not None:
            executor.close()

    def __del__(self) -> None:
        self.close()

    # ---- set-up ------------------------------------------------------------------------

    def _initialize_kv_cache(self) -> None:
        """Size the KV cache, allocate it on every runner and capture the CUDA graphs."""
        config = self.config
        self.num_kv_blocks = self._num_kv_blocks()
        self.num_host_blocks = self._num_host_blocks()
        self._startup.lap("KV cache sizing")
        self._swap_seconds_per_block = self.executor.initialize_kv_cache(
            self.num_kv_blocks, self.num_host_blocks)
        self._startup.lap("KV cache allocation")
        if self.device.type == "cuda":
            self.executor.warm_up()
            self._startup.lap("warm-up")
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d, so at most %.2f "
            "requests of full length at once; device %s, %s, KV cache %s",
            self.num_kv_blocks, config.block_size, self.kv_capacity_tokens, self.max_model_len,
            self.kv_capacity_tokens / self.max_model_len, self.device,
            str(self.dtype).removeprefix("torch."),
            str(self.kv_cache_dtype).removeprefix("torch."),
        )
        if self.num_host_blocks:
            pool = host_pool_bytes(self.attention_backend, self.executor.kv_cache_specs,
                                   self.num_host_blocks)
            logger.info("Swap space: %d host blocks (%.2f GiB per worker, swap_space %.2f); a "
                        "block's round trip to host memory measured %.1f us",
                        self.num_host_blocks, pool / 2**30, config.swap_space,
                        1e6 * (self._swap_seconds_per_block or 0.0))
        if not config.enforce_eager:
            self.executor.capture_cuda_graphs()
            if self.device.type == "cuda":
                self._startup.lap("CUDA graphs")

    def _kv_transfer_params(self) -> KVTransferParams | None:
        """Disaggregated serving: check the connector (before the model loads, so a bad name
        or option costs no load time) and set up the transfer params."""
        kv_config = self.config.kv_transfer_config
        if kv_config is None:
            return None
        if self.config.pipeline_parallel_size > 1:
            raise ValueError("kv_transfer_config cannot be combined with pipeline stages yet; "
                             "use pipeline_parallel_size=1 (tensor parallelism is supported)")
        if self.config.speculative_method is not None and kv_config.kv_role == "consumer":
            raise ValueError("a consumer engine (kv_role=consumer) cannot run speculative "
                             "decoding yet; drop speculative_method")
        cls = connector_class(kv_config, self.registry)
        return KVTransferParams(kv_config, cls, self.config.block_size)

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ValueError(
                f"max_model_len={asked} exceeds the model's max_position_embeddings ({limit}); "
                f"lower max_model_len to at most {limit}"
            )
        return asked

    def _check_fp8_kv_cache_support(self) -> None:
        """An fp8 cache needs a plugin that settles its scales (``hitchllm_kv_cache_scales``);
        checked before the model loads, so a missing plugin costs no load time."""
        if self.kv_cache_dtype not in FP8_DTYPES:
            return
        if not self.registry.pm.hook.hitchllm_kv_cache_scales.get_hookimpls():
            raise ValueError(
                f"kv_cache_dtype={self.config.kv_cache_dtype!r} needs the hitchllm-quantization "
                "plugin, which provides the fp8 KV-cache scales (pip install "
                "hitchllm-quantization); or use kv_cache_dtype=auto"
            )

    def _check_lora_support(self) -> None:
        """``enable_lora`` needs the plugin that serves adapters; checked before the model
        loads, so a missing plugin costs no load time."""
        if not self.config.enable_lora:
            return
        if any(p.distribution == LORA_PLUGIN for p in self.registry.loaded.values()):
            return
        if any(p.distribution == LORA_PLUGIN for p in self.registry.failed):
            raise ValueError(f"enable_lora needs the plugin {LORA_PLUGIN}, which is installed "
                             "but failed to load (the log says why)")
        raise ValueError(f"enable_lora needs the plugin {LORA_PLUGIN}, which is not "
                         f"installed: pip install {LORA_PLUGIN}")

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        # One block of the shared pool holds a page in every layer's cache.
        per_block = bytes_per_shared_block(self.executor.kv_cache_specs)
        if cfg.kv_cache_memory is not None:
            budget = parse_size(cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            budget = self.executor.kv_cache_bytes(cfg.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        # More blocks than every sequence at full length could use only costs memory.
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        num_blocks = min(budget // per_block, useful)
        if num_blocks * cfg.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache fits {num_blocks * cfg.block_size} tokens, fewer than one "
                f"max_model_len={self.max_model_len} request; lower max_model_len, or raise "
                "gpu_memory_utilization (CUDA) or kv_cache_memory"
            )
        return int(num_blocks)

    def _num_host_blocks(self) -> int:
        """Blocks of the host pool for swap preemption: ``swap_space`` GiB per worker over a
        block's bytes on one worker (0 with preemption_mode=recompute)."""
        cfg = self.config
        if cfg.preemption_mode == "recompute":
            return 0
        specs = self.executor.kv_cache_specs
        num_blocks = host_pool_blocks(self.attention_backend, specs,
                                      int(cfg.swap_space * 2**30), self.device)
        if num_blocks < 1:
            raise ValueError(
                f"swap_space={cfg.swap_space} GiB holds no KV block (one block takes "
                f"{bytes_per_shared_block(specs)} bytes per worker); raise swap_space or use "
                "preemption_mode=recompute")
        return num_blocks

    def _build_proposer(self, model: torch.nn.Module) -> Proposer | None:
        name = self.config.speculative_method
        if name is None:
            return None
        proposers: dict[str, type[Proposer]] = {}
        for result in reversed(self.registry.hook.hitchllm_speculative_proposers()):
            proposers.update(result or {})
        if name not in proposers:
            raise ValueError(
                f"speculative method {name!r} is not provided by any installed plugin; "
                f"installed: {', '.join(sorted(proposers)) or 'none'} (speculative decoding "
                "comes from a plugin that implements hitchllm_speculative_proposers)"
            )
        cls = proposers[name]
        if not (isinstance(cls, type) and issubclass(cls, Proposer)):
            raise TypeError(
                f"speculative method {name!r} maps to {cls!r}, which is not a subclass of "
                "hitchllm.speculative.Proposer; its plugin predates the proposer protocol")
        proposer = cls(self.config)
        proposer.bind_target_model(model)
        return proposer

    def _block_hash_extra_keys(self, request: Request) -> tuple:
        results = self.registry.hook.hitchllm_block_hash_extra_keys(request=request)
        return tuple(itertools.chain.from_iterable(r for r in results if r))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.config.block_size

    # ---- requests ----------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Split a prompt (a string or ``{"prompt_token_ids": [...]}``) into text and ids."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
        raise TypeError(
            "a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'), "
            f"got {type(prompt).__name__}"
        )

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
        final_only: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ``ValueError`` for a request
        that can never be served (nothing is queued then). With ``final_only`` the request
        appears in ``step()``'s outputs only once, finished (offline generation).
        ``lora_request`` (a ``hitchllm.LoRARequest``) names the adapter to run with; it
        needs ``enable_lora`` and the LoRA plugin, and is refused otherwise.
        ``kv_transfer_params`` (disaggregated serving, ``kv_transfer_config`` set): on a
        producer ``{"do_remote_decode": True}`` saves the prompt's KV and puts the params a
        consumer needs in the finished output's ``kv_transfer_params``; on a consumer, those
        params load the prompt's KV instead of computing it."""
        params = params or SamplingParams()
        if lora_request is not None and not self.config.enable_lora:
            name = getattr(lora_request, "lora_name", lora_request)
            raise ValueError(
                f"lora_request names adapter {name!r} but LoRA is off; start the engine with "
                f"enable_lora=True (--enable-lora), which needs the {LORA_PLUGIN} plugin "
                f"(pip install {LORA_PLUGIN})")
        if request_id is None:
            request_id = self.new_request_id(params.n)
        elif self._id_in_use(request_id, params.n):
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        token_ids = self._truncate_prompt(token_ids, params)
        self._validate(token_ids, params)
        processors = self.logits_processors_for(params)
        self.compile_logits_processors(params, processors)
        self._check_kv_transfer_params(kv_transfer_params, params)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = replace(params, n=1, seed=seed)
            children.append(Request(
                request_id=self._child_id(request_id, i, params.n),
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                cache_salt=cache_salt,
                prefix_share_key=request_id if params.n > 1 else None,
                lora_request=lora_request,
                logits_processors=processors,
            ))
        if self.kv_params is not None:
            self.kv_params.attach(children[0], kv_transfer_params)
        for child in children:
            self.registry.hook.hitchllm_request_added(request=child, engine_config=self.config)
        self.output_processor.add(request_id, text, children, final_only)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def new_request_id(self, n: int = 1) -> str:
        """An id that no live request uses, nor any of the ``n`` sequences' ids a request of
        ``n`` samples takes: for ``add_request``'s ``request_id``, so that a caller who records
        the id before queuing can abort the request whatever interrupts it after."""
        request_id = str(next(self._request_counter))
        while self._id_in_use(request_id, n):
            request_id = str(next(self._request_counter))
        return request_id

    def _check_kv_transfer_params(
        self, kv_transfer_params: dict[str, Any] | None, params: SamplingParams
    ) -> None:
        if kv_transfer_params is None:
            return
        if self.kv_params is None:
            raise ValueError("kv_transfer_params needs an engine started for disaggregated "
                             "serving (kv_transfer_config; hitchllm serve --kv-role "
                             "producer|consumer --kv-connector NAME)")
        if params.n > 1:
            raise ValueError(f"kv_transfer_params works with n=1 only (got n={params.n})")

    @staticmethod
    def _child_id(request_id: str, index: int, n: int) -> str:
        return request_id if n == 1 else f"{index}_{request_id}"

    def _id_in_use(self, request_id: str, n: int) -> bool:
        """True if the request or any of its children's ids belongs to a live request."""
        ids = {request_id} | {self._child_id(request_id, i, n) for i in range(n)}
        return any(rid in self.output_processor.parents or rid in self.scheduler.requests
                   for rid in ids)

    def _truncate_prompt(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The last ``params.truncate_prompt_tokens`` prompt tokens (-1: the last
        max_model_len), or all of them when it is None."""
        k = params.truncate_prompt_tokens
        if k is None:
            return token_ids
        if k > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={k} exceeds max_model_len={self.max_model_len}; "
                "use a smaller value, or -1 to keep the last max_model_len tokens"
            )
        return token_ids[-(self.max_model_len if k == -1 else k):]

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})"
            )
        params.verify_vocab(vocab)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                f"{self.max_model_len}; shorten it or raise max_model_len"
            )
        longest = self.max_model_len
        if params.max_tokens is not None:
            longest = min(longest, len(token_ids) + params.max_tokens)
        # The last sampled token is never fed back, so it needs no KV slot.
        if longest - 1 > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens needs {longest - 1} KV slots "
                f"but the whole KV cache holds {self.kv_capacity_tokens}; lower max_tokens or "
                "give the cache more memory (kv_cache_memory / num_kv_blocks)"
            )

    def logits_processors_for(self, params: SamplingParams) -> list[LogitsProcessor]:
        """The logits processors a request with ``params`` uses; ``ValueError`` when it sets
        a field that only a plugin implements and that plugin is not installed."""
        for name, distribution in PLUGIN_SAMPLING_FIELDS.items():
            if getattr(params, name) is not None and not any(
                name in p.provides for p in self.logits_processors
            ):
                if any(f.distribution == distribution for f in self.registry.failed):
                    # The load error (logged at start-up) may name paths: not for clients.
                    raise ValueError(f"{name} needs the plugin {distribution}, which is "
                                     "installed but failed to load (the log says why)")
                raise ValueError(
                    f"{name} needs the plugin {distribution}, which is not installed: "
                    f"pip install {distribution}"
                )
        return [p for p in self.logits_processors if p.is_used_by(params)]

    def compile_logits_processors(
        self, params: SamplingParams, processors: list[LogitsProcessor] | None = None
    ) -> None:
        """Let the processors check ``params`` and do their slow preparation (compile a
        grammar). Thread-safe: ``AsyncLLMEngine`` calls it in a worker thread so that
        ``add_request`` on the engine loop finds the work done; raises ``ValueError``."""
        for processor in self.logits_processors_for(params) if processors is None else processors:
            processor.compile(params)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            self.scheduler.finish_requests(
                self.output_processor.child_ids(rid), RequestStatus.FINISHED_ABORTED
            )
            out = self.output_processor.abort(rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that made progress.

        With overlap (``async_scheduling``), the step launched here completes in the next
        call: this call returns the outputs of the previous step, after launching the
        new one so that the device is never idle while the host schedules, prepares inputs
        and detokenizes. A request that stops is then computed one step too many; that
        token is dropped.

        With pipeline stages (``pipeline_parallel_size=M``) up to M steps are in flight, each
        over requests the others do not hold (micro-batches, ``_step_pipelined``): a call
        launches a step of the requests that are free and returns the outputs of the oldest
        step once M are in flight (or once nothing is free).

        A step that raises does not end the engine: its requests are run apart until the
        one that fails alone is found and finished with ``finish_reason="error"`` (see
        ``Scheduler.quarantine``); every other request goes on. Only when steps keep failing
        (a broken device) or the failure cannot be tied to requests does ``step`` raise.
        """
        outputs: list[RequestOutput] = []
        work = _StepWork()
        try:
            self._step(outputs, work)
        except Exception as exc:
            outputs += self._recover(exc, work)
        else:
            self._consecutive_failures = 0
        return outputs

    def _step(self, outputs: list[RequestOutput], work: _StepWork) -> None:
        """One step; fills ``outputs`` as they complete and ``work`` with what is under way."""
        if self._micro_batches > 1:
            self._step_pipelined(outputs, work)
            return
        plan = self._schedule()
        requests = [self.scheduler.requests[rid] for rid in plan.request_ids]
        if self._in_flight and not self._may_overlap(requests):
            # Should the step in flight fail, this plan is dropped unsent: its requests are
            # recomputed like those of a dropped launch and its ids requeued (``_recover``).
            work.launched, work.launched_plan, work.sent = requests, plan, False
            outputs += self._complete_in_flight(work)
        if plan.is_empty and not self._in_flight and self.scheduler.has_unfinished_requests():
            if not self._waits_for_kv():
                raise RuntimeError("scheduler made no progress with unfinished requests queued")
            if not plan.has_kv_transfers:
                time.sleep(KV_POLL_INTERVAL_S)  # nothing to run until KV arrives
        work.running, work.plan = requests, plan
        # From here the runner may act on the plan (its KV transfers first), even should the
        # launch fail: it is not requeued as unsent then.
        work.sent = True
        launched = self._launch(plan, requests)
        work.launched, work.launched_plan = requests, plan
        if self._in_flight:
            outputs += self._complete_in_flight(work)
        work.running, work.plan = requests, plan
        if self._overlap and not plan.is_empty:
            self._in_flight.append(launched)
        else:
            outputs += self._complete(launched)
        work.launched, work.launched_plan = [], None

    def _waits_for_kv(self) -> bool:
        transfers = self.scheduler.kv_transfer
        return transfers is not None and transfers.has_work()

    def _step_pipelined(self, outputs: list[RequestOutput], work: _StepWork) -> None:
        """One step with pipeline stages: fold the oldest step's tokens into the scheduler
        while M steps are in flight (and plans that only carry ids lead), launch a
        micro-batch of the requests no step in flight holds (their tokens are known, so the
        driver can feed them to the earlier stages), and only then build the folded steps'
        outputs (detokenizing, stop strings): the stages wait for the next micro-batch no
        longer than scheduling it takes. When nothing is free to launch, the oldest step of
        requests is folded and the scheduler asked again. A request that a stop string ends
        may thus be in the micro-batch just launched: it finishes in flight (its blocks are
        freed at once, its extra token dropped), as under async scheduling."""
        folded: list[_Folded] = []
        try:
            while True:
                while self._in_flight and (self._in_flight[0].plan.is_empty
                                           or self._num_in_flight() >= self._micro_batches):
                    folded.append(self._fold_in_flight(work))
                busy = {r for launched in self._in_flight for r in launched.requests}
                plan = self._schedule(busy)
                requests = [self.scheduler.requests[rid] for rid in plan.request_ids]
                if plan.is_empty and not self._in_flight and (
                        self.scheduler.has_unfinished_requests()):
                    raise RuntimeError("scheduler made no progress with unfinished requests "
                                       "queued")
                work.running, work.plan = requests, plan
                # An empty plan still tells the stages of finished and preempted requests; it
                # queues behind the steps in flight (steps complete in launch order).
                self._in_flight.append(self._launch(plan, requests))
                work.running, work.plan = [], None
                if not plan.is_empty or not self._num_in_flight():
                    break
                # Nothing was free: fold up to the oldest step of requests (one is in flight),
                # whose requests are free then.
                while True:
                    folded.append(self._fold_in_flight(work))
                    if not folded[-1].launched.plan.is_empty:
                        break
            while self._in_flight and self._in_flight[0].plan.is_empty:
                folded.append(self._fold_in_flight(work))
        finally:
            # Also when a step failed: the tokens folded before it reach their outputs.
            for done in folded:
                outputs += self._emit(done)

    def _schedule(self, busy: set[Request] | None = None) -> StepPlan:
        """The scheduler's next plan (``busy``: the requests of steps in flight, with
        micro-batches)."""
        tl = timeline.ACTIVE
        if tl is not None:
            tl.mark("schedule_start", self._num_launched)
        plan = self.scheduler.schedule() if busy is None else self.scheduler.schedule(busy)
        if tl is not None:
            tl.mark("schedule_end", self._num_launched)
        return plan

    def _launch(self, plan: StepPlan, requests: list[Request]) -> _Launched:
        launched = _Launched(plan, requests, self.executor.execute_model(plan),
                             self._num_launched)
        self._num_launched += 1
        if not plan.is_empty:
            self._max_steps_in_flight = max(self._max_steps_in_flight,
                                            self._num_in_flight() + 1)
        if timeline.ACTIVE is not None:
            timeline.ACTIVE.mark("launched", launched.index, requests=len(requests),
                                 tokens=plan.total_num_scheduled_tokens,
                                 decodes=plan.num_scheduled_tokens.count(1),
                                 in_flight=self._num_in_flight() + (not plan.is_empty))
        return launched

    def _num_in_flight(self) -> int:
        """Steps in flight that compute something (an empty plan only carries ids)."""
        return sum(not launched.plan.is_empty for launched in self._in_flight)

    def _complete_in_flight(self, work: _StepWork) -> list[RequestOutput]:
        return self._emit(self._fold_in_flight(work))

    def _fold_in_flight(self, work: _StepWork) -> _Folded:
        in_flight = self._in_flight.popleft()
        work.running, work.plan = in_flight.requests, in_flight.plan
        return self._fold(in_flight)

    def _recover(self, exc: Exception, work: _StepWork) -> list[RequestOutput]:
        """Contain a failed step (see ``step``); returns the outputs it still produced."""
        outputs: list[RequestOutput] = []
        suspects = list(work.running)
        failed = [work.plan]
        # Work launched before the failure and not part of it: the steps in flight complete
        # (their tokens are good); a step launched here and not queued is dropped, its
        # requests recomputed.
        while self._in_flight:
            try:
                outputs += self._complete_in_flight(work)
            except Exception:
                suspects += work.running
                failed.append(work.plan)
        bystanders = [r for r in work.launched if r not in suspects]
        for plan in (*failed, work.launched_plan):
            if plan is not None:
                self.scheduler.uncache_unwritten(plan)
        if work.launched_plan is not None and not work.sent:
            self.scheduler.requeue_unsent(work.launched_plan)
        suspects = [r for r in dict.fromkeys(suspects) if not r.finished]
        self._consecutive_failures += 1
        fatal = isinstance(exc, _DEVICE_ERRORS) or not suspects
        if fatal or self._consecutive_failures > MAX_CONSECUTIVE_STEP_FAILURES:
            raise exc
        if len(suspects) > 1:
            logger.warning("a step of %d requests failed (%s); running them apart to find the "
                           "request that fails", len(suspects), type(exc).__name__)
            self.scheduler.quarantine(suspects, bystanders)
            return outputs
        [request] = suspects
        self.scheduler.quarantine([], bystanders)
        logger.error("request %s failed alone; ending it with an error", request.request_id,
                     exc_info=exc)
        # The whole user request ends (all n sequences), as one API call fails as a whole.
        parent_id = self.output_processor.parent_id(request.request_id)
        children = [request.request_id] if parent_id is None else (
            self.output_processor.child_ids(parent_id))
        self.scheduler.finish_requests(children, RequestStatus.FINISHED_ERROR)
        if parent_id is not None:
            message = (f"the engine failed while computing this request "
                       f"({type(exc).__name__}); other requests were not affected")
            outputs.append(self.output_processor.abort(parent_id, error=message))
        return outputs

    def _may_overlap(self, requests: list[Request]) -> bool:
        """Whether a step of ``requests`` may launch before the step in flight completes: not
        when a request's sampling depends on output tokens the host has not seen (penalties,
        min_tokens still counting, and logits processors such as a grammar or bad words)."""
        # A plain loop: it runs for every request and step.
        for r in requests:
            params = r.sampling_params
            if (len(r.output_token_ids) < params.min_tokens or params.uses_penalties
                    or (r.logits_processors and any(p.needs_output_tokens
                                                    for p in r.logits_processors))):
                return False
        return True

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens and fold them into requests and outputs."""
        return self._emit(self._fold(launched))

    def _fold(self, launched: _Launched) -> _Folded:
        """Wait for a launched step's tokens and fold them into the scheduler's requests
        (token stops end requests here)."""
        result = launched.output.result()
        tl = timeline.ACTIVE
        if tl is not None:
            tl.mark("answer_read", launched.index)
        if result.kv_events is not None:
            self.scheduler.update_kv_transfers(result.kv_events)
            self.kv_transfer_stats = result.kv_events.stats
        self.scheduler.swap_cost.observe_step(launched.plan.total_num_scheduled_tokens,
                                              time.perf_counter() - launched.launched_at)
        updated = self.scheduler.update_from_output(
            launched.plan, launched.requests, result.sampled)
        return _Folded(launched, result, updated)

    def _emit(self, folded: _Folded) -> list[RequestOutput]:
        """The outputs of a folded step (detokenized; stop strings end requests here)."""
        result = folded.result
        outputs, stopped = self.output_processor.process(
            folded.updated, result.logprobs, result.prompt_logprobs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, result)
        if timeline.ACTIVE is not None:
            timeline.ACTIVE.mark("outputs_done", folded.launched.index)
        return outputs

    def stats(self) -> EngineStats:
        s = self.scheduler
        lora: dict[str, Any] = {}
        if self.config.enable_lora:
            lora = dict(
                running_lora_adapters=_adapter_names(s.running),
                waiting_lora_adapters=_adapter_names(s.waiting),
                lora=self.lora_adapters().counters(),
            )
        return EngineStats(
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=s.stats.num_preemptions,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            spec_decode_num_drafts=s.stats.num_spec_drafts,
            spec_decode_num_draft_tokens=s.stats.num_spec_draft_tokens,
            spec_decode_num_accepted_tokens=s.stats.num_spec_accepted_tokens,
            num_prompt_tokens_computed=s.stats.num_prompt_tokens_computed,
            kv_transfer=self.kv_transfer_stats,
            kv_load_fallbacks=0 if s.kv_transfer is None else s.kv_transfer.num_fallbacks,
            max_steps_in_flight=self._max_steps_in_flight,
            num_swap_outs=s.stats.num_swap_outs,
            num_swap_ins=s.stats.num_swap_ins,
            num_swap_fallbacks=s.stats.num_swap_fallbacks,
            host_blocks_used=self.kv_cache.num_host_blocks - self.kv_cache.num_free_host_blocks,
            num_host_blocks=self.kv_cache.num_host_blocks,
            **lora,
        )

    # ---- LoRA adapters at run time (vLLM's add_lora / remove_lora / list_loras) --------

    def lora_adapters(self) -> LoRAAdapters:
        """The plugin object that manages this engine's adapters (``ValueError`` when LoRA
        is off)."""
        if not self.config.enable_lora:
            raise ValueError(f"LoRA is off: start the engine with enable_lora=True "
                             f"(--enable-lora), which needs the {LORA_PLUGIN} plugin")
        found = [a for a in self.registry.hook.hitchllm_lora_adapters(engine_config=self.config)
                 if a is not None]
        if not found:
            raise ValueError(f"no installed plugin manages LoRA adapters; install {LORA_PLUGIN}")
        return found[0]

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Load an adapter so that requests may name it by ``lora_name`` alone; returns the
        bound ``LoRARequest``. ``ValueError`` says what is wrong with it or its directory.
        Safe to call from another thread than the engine loop's."""
        return self.lora_adapters().add_adapter(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter (requests already accepted finish with it); ``ValueError`` if
        none has that name. Safe to call from another thread."""
        self.lora_adapters().remove_adapter(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters, oldest first (empty when LoRA is off)."""
        return self.lora_adapters().list_adapters() if self.config.enable_lora else []


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The sorted, distinct adapter names of ``requests`` (base-model requests name none)."""
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))
