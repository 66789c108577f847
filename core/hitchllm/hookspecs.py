"""Hook specifications: the extension API of hitchllm.

A plugin is a module (named by an entry point in the group ``hitchllm.plugins``) holding
functions marked with ``hitchllm.hookimpl`` whose names match the hooks below. pluggy calls
hooks with keyword arguments only; an implementation may accept any subset of a hook's
arguments, and an argument given a default value in an implementation is never passed.
Implementations registered last are called first.

The core registers its own built-ins (the TORCH attention backend and the Llama-family models)
through these same hooks, so built-ins and third-party plugins are treated alike.

Hooks are grouped by the engine's lifecycle:

1. Discovery (when an engine is built or backends are listed): what a plugin provides
   (attention backends, models, quantization methods, proposers, KV connectors).
2. Model load (once per engine): after the weights are in place, the fp8 KV-cache scales, the
   logits processors, and the LoRA adapters' manager.
3. Per request: validation when a request is added, admission to the running requests,
   per-step state before the forward pass, identity that must enter prefix-cache keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Collection

    import torch

    from hitchllm.attention.backend import AttentionBackend
    from hitchllm.config import EngineConfig, ModelConfig
    from hitchllm.engine.input_batch import RequestState
    from hitchllm.kv_transfer import KVConnector
    from hitchllm.logits_processor import LogitsProcessor
    from hitchllm.lora import LoRAAdapters
    from hitchllm.request import Request
    from hitchllm.scheduler.admission import AdmissionGate
    from hitchllm.speculative import Proposer

hookspec = pluggy.HookspecMarker("hitchllm")
# The marker for implementations (``from hitchllm import hookimpl``); defined here, beside the
# specs, so that the built-ins can use it without importing the plugin registry.
hookimpl = pluggy.HookimplMarker("hitchllm")


# --------------------------------------------------------------------------------------------
# 1. Discovery
# --------------------------------------------------------------------------------------------


@hookspec
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """Return the attention backend classes this plugin provides.

    Called whenever backends are ranked (at engine start-up, by ``hitchllm backends``); it may
    be called more than once and should return the same list each time. Return a list of
    ``hitchllm.attention.AttentionBackend`` subclasses (classes, not instances). Importing
    heavy kernel libraries should happen lazily (in ``validate`` or the impl), so that a
    machine without them can still list the backend and say why it is not valid.
    """


@hookspec
def hitchllm_model_architectures() -> dict[str, type[torch.nn.Module]]:
    """Return a mapping of Hugging Face architecture name to model class.

    Called once per engine when the model is built. Keys are the names found in a checkpoint's
    ``config.json`` ``architectures`` list (e.g. ``"DeepseekV3ForCausalLM"``). A model class is
    constructed as ``cls(model_config, quant_config=...)`` (a ``hitchllm.config.ModelConfig``;
    the active quantization method or None, to pass to its ``hitchllm.layers`` linear layers
    with each layer's parameter-name prefix), must route its attention through
    ``hitchllm.attention.Attention`` layers, and provide
    ``forward(input_ids, positions) -> hidden_states``, ``compute_logits(hidden_states)`` and
    ``load_weights(weights: Iterable[tuple[str, torch.Tensor]])``. When two plugins provide the
    same name, the one registered last wins (so a plugin can override a built-in).
    """


@hookspec
def hitchllm_quantization_methods() -> dict[str, type[Any]]:
    """Return a mapping of quantization method name to quantization class.

    Called once per engine when ``quantization=NAME`` is requested (or the checkpoint's
    ``quantization_config.quant_method`` names one). The class is constructed as
    ``cls(model_config)`` (the checkpoint's ``quantization_config`` dict is in
    ``model_config.hf_config``) and passed to the model as ``quant_config``. While the model is
    built, every linear layer of ``hitchllm.layers`` (and the LM head unless it is tied) calls
    ``get_linear_method(layer, prefix) -> hitchllm.layers.LinearMethod | None`` once, with the
    layer (its ``input_size``, ``output_size``, ``output_partition_sizes``) and its parameter
    name prefix (``"model.layers.0.self_attn.qkv_proj"``; stacked layers carry our stacked
    name, not the checkpoint's ``q_proj``); ``None`` leaves the layer unquantized.

    The linear method's ``create_weights`` registers the layer's parameters, extra checkpoint
    tensors included (``weight_scale``, zero points), each with the layer's ``weight_loader``
    and its ``output_dim`` / ``input_dim``, so they load, slot by slot and shard by shard, like
    the weight. After every tensor is loaded the core calls its
    ``process_weights_after_loading(layer)``; ``apply(layer, x, bias)`` then runs each
    forward. An unknown method name is an error listing the installed ones.
    """


@hookspec
def hitchllm_speculative_proposers() -> dict[str, type[Proposer]]:
    """Return a mapping of speculative method name to proposer class.

    Called once per engine when ``speculative_method=NAME`` is requested. A proposer class
    subclasses ``hitchllm.speculative.Proposer`` and is constructed as ``cls(engine_config)``
    (``engine_config.num_speculative_tokens`` says how many drafts to make), then given the
    loaded target model once through ``bind_target_model(model)``. After each step its
    ``propose(batch: ProposalBatch) -> Proposal`` is called with the requests that sampled a
    token in that step and keep decoding: each one's id, token ids (prompt then output), the
    most drafts it may use and its ``SamplingParams``, and, when the class sets
    ``needs_hidden_states = True``, the target model's final hidden states at the positions
    that produced the newest tokens. Requests that finish (stop, abort, error) are passed to
    ``remove_requests(ids)`` so that per-request state is freed. The returned ``Draft`` per
    request id holds draft token ids and optionally ``probs``, the ``[k, vocab_size]``
    distribution they were sampled from.
    The next step computes ``1 + len(drafts)`` tokens for the request and the core verifies the
    drafts by rejection sampling (with ``probs`` when given), so the output distribution is the
    target model's whatever the drafts are; ``probs`` raise the acceptance rate of sampled
    drafts.
    """


@hookspec
def hitchllm_kv_connectors() -> dict[str, type[KVConnector]]:
    """Return a mapping of KV connector name to connector class (disaggregated serving).

    Called when an engine starts with ``kv_transfer_config`` (``--kv-role producer|consumer
    --kv-connector NAME``): the core picks the class its ``kv_connector`` names (an unknown
    name is an error listing the installed ones), calls its ``check_config(config)`` (a bad
    ``kv_connector_extra_config`` fails start-up with the connector's message), asks a
    producer's class for ``transfer_params(config, engine_id)`` (the addressing a consumer
    needs, returned to the client with each finished request), and constructs one instance
    per model runner (per tensor-parallel rank, in its worker process) as
    ``cls(config, engine_id, rank, world_size)``. A class subclasses
    ``hitchllm.kv_transfer.KVConnector``; ``hitchllm.kv_transfer.connector`` says when the
    runner calls it in a step: ``save`` copies a finished prompt's blocks out and sends them
    asynchronously, ``start_load`` receives into staging memory, ``poll`` reports arrivals
    (the scheduler then lets the request decode), ``finish_load`` copies the KV into the
    blocks the scheduler reserved, ``cancel_load`` drops a load (abort, timeout). When two
    plugins provide the same name, the one registered last wins.
    """


# --------------------------------------------------------------------------------------------
# 2. Model load
# --------------------------------------------------------------------------------------------


@hookspec
def hitchllm_model_loaded(model: torch.nn.Module, engine_config: EngineConfig) -> None:
    """Called once per engine right after the model's weights are loaded, before the KV cache
    is allocated. With tensor parallelism it is called in every worker process, with that
    rank's shard of the model (``hitchllm.distributed.tp_rank()`` tells which) and a copy of
    the engine's config.

    Use it to wrap layers (e.g. the LoRA plugin replaces linear layers with adapter-aware ones).
    Changes are made in place; the return value is ignored.
    """


@hookspec
def hitchllm_kv_cache_scales(
    model: torch.nn.Module, model_config: ModelConfig, engine_config: EngineConfig,
    kv_cache_dtype: torch.dtype,
) -> None:
    """Settle the fp8 KV-cache scales: called once per engine after ``hitchllm_model_loaded``,
    before the KV cache is allocated and before any forward pass, with the dtype the cache
    will store (the model's, or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``).

    Every ``hitchllm.attention.Attention`` layer of ``model`` holds float32 scalar parameters
    ``k_scale`` and ``v_scale`` (stored value = K / k_scale). The core has loaded them from the
    checkpoint where it has them (``*.self_attn.k_scale`` / ``v_scale``, or
    ``*.self_attn.k_proj.output_scale`` / ``v_proj.output_scale``; ``layer.k_scale
    .from_checkpoint`` tells which) and left 1.0 elsewhere. With an fp8 ``kv_cache_dtype`` an
    implementation decides every layer's final scales (keep the checkpoint's, check them
    against ``model_config.hf_config``'s ``quantization_config``, or compute them from served
    prompts when ``engine_config.calculate_kv_scales`` is set) and writes them in place
    (``layer.k_scale.copy_(s)``, never rebinding). With any other dtype the scales are unused;
    an implementation may only report. The return value is ignored.

    The core refuses an fp8 ``kv_cache_dtype`` when no installed plugin implements this hook
    (the ``hitchllm-quantization`` plugin does), so calibrated scales are never silently
    ignored.
    """


@hookspec
def hitchllm_logits_processors(
    engine_config: EngineConfig, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> list[LogitsProcessor]:
    """Return the logits processors this plugin provides for one engine.

    Called once per engine (with tensor parallelism, also once in every worker process, whose
    runner applies its own processors alike). ``tokenizer`` is the engine's Hugging
    Face tokenizer, ``vocab_size`` the width of the logits (the model's vocabulary, which may
    exceed the tokenizer's), ``eos_token_ids`` the ids that end a sequence. Return instances
    of ``hitchllm.logits_processor.LogitsProcessor``; build nothing expensive here (a grammar
    library's tokenizer index, say) until a request uses the processor, because every engine
    pays this hook whether or not a request ever does.

    Each step, every processor that some request uses edits the logits of that request's rows
    before the sampler applies min_tokens, penalties, temperature and the top-k / top-p / min-p
    filters (reported logprobs stay the model's raw ones). The core's ``logit_bias``,
    ``allowed_token_ids`` and ``bad_words`` are processors registered through this hook; the
    structured-output plugin adds its grammar's token mask. See ``hitchllm.logits_processor``
    for the contract (batched, no device reads, speculative rows).
    """


@hookspec
def hitchllm_lora_adapters(engine_config: EngineConfig) -> LoRAAdapters | None:
    """Return the object that loads, unloads and lists this engine's LoRA adapters, or None.

    Called (after ``hitchllm_model_loaded``) when the engine is asked to load, unload or list
    adapters (``LLMEngine.add_lora`` / ``remove_lora`` / ``list_loras``, which the server's
    ``--lora-modules``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` and
    ``/v1/models`` use) or for its LoRA counters (``/metrics``). Return a
    ``hitchllm.lora.LoRAAdapters`` for an engine whose adapters this plugin serves (the LoRA
    plugin does when ``engine_config.enable_lora`` is set), else None; the first non-None
    answer is used.
    """


# --------------------------------------------------------------------------------------------
# 3. Per request
# --------------------------------------------------------------------------------------------


@hookspec
def hitchllm_request_added(request: Request, engine_config: EngineConfig) -> None:
    """Called when a request is added to the engine, after the core validated it and before it
    is queued.

    Raise ``ValueError`` with a message saying what to change to reject the request (for
    example the LoRA plugin rejects an adapter it cannot load); the request is then not queued
    and nothing else is affected. ``request.lora_request`` holds whatever the caller passed as
    ``lora_request`` (``None`` if nothing); the core refuses one unless ``enable_lora`` is set,
    and the LoRA plugin replaces it with the adapter's full ``LoRARequest`` (a request may
    name a loaded adapter without its path). The return value is ignored.
    """


@hookspec
def hitchllm_admission_gates(engine_config: EngineConfig) -> list[AdmissionGate]:
    """Return the admission gates this plugin provides for one engine.

    Called once per engine, after ``hitchllm_model_loaded``, when the scheduler is built.
    Each step the scheduler asks every gate's ``may_admit(request)`` before it moves a
    waiting request to the running ones; a request any gate refuses stays waiting, keeps its
    place in the queue, and is asked about again next step, while the requests behind it may
    be admitted. Gates are told of every request that joins (``admitted``) and leaves
    (``released``: finished, aborted, preempted) the running set, so they can keep counts.
    A gate must only delay: with no request running it must admit, and a request it could
    never admit must be refused in ``hitchllm_request_added`` instead. See
    ``hitchllm.scheduler.admission.AdmissionGate``. The LoRA plugin's gate holds a request
    back while every adapter slot serves running requests of other adapters.
    """


@hookspec
def hitchllm_before_forward(
    requests: list[RequestState], num_scheduled_tokens: list[int], model: torch.nn.Module,
    running_requests: Collection[RequestState],
) -> None:
    """Called by the model runner once per step, right before the model's forward pass.

    Only steps that serve requests call it: the forwards the engine runs while it starts up
    (measuring memory, capturing CUDA graphs) do not. ``model`` is the model about to run
    (the one ``hitchllm_model_loaded`` received), for plugins that act on its layers.

    ``requests`` are the step's batch rows in order, as the runner knows them
    (``hitchllm.engine.input_batch.RequestState``: ``request_id``, ``sampling_params``,
    ``lora_request`` and ``lora_name``, ``prompt_token_ids``, ``output_token_ids``), never the
    scheduler's ``Request`` objects: the runner may run in a worker process. Row ``i``
    contributes ``num_scheduled_tokens[i]`` consecutive tokens to the packed batch.
    ``running_requests`` are all the requests the runner holds state for, scheduled in this
    step or not (the scheduler's running requests; finished and preempted ones are gone), so
    that state a running request will need again is not given away. Use it to
    set up per-token state a wrapped layer needs (the LoRA plugin maps each token to its
    request's adapter). Must not synchronize with the device. On CUDA, decode steps replay a
    CUDA graph captured at start-up (padded to a capture size), so state the forward reads
    must sit in device tensors allocated once and updated in place. The return value is
    ignored.
    """


@hookspec
def hitchllm_block_hash_extra_keys(request: Request) -> tuple[Any, ...] | None:
    """Return extra values that must enter every KV block hash of ``request``.

    Called when a request's block hashes are computed for prefix caching. Two requests share
    cached blocks only if every plugin returns equal keys for both. (The core already keys
    every block by ``request.lora_name``; the LoRA plugin adds the adapter's directory and
    which load of it the request runs with, so a name unloaded and loaded again never reuses
    the old blocks.) Return
    ``None`` when the plugin has nothing to add. Values must be str, int or None so hashes stay
    deterministic across processes.
    """
