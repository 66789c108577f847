"""``hitchllm serve``: build the engine, wrap it for asyncio, serve it with uvicorn.

If the engine loop dies, ``/health`` answers 503 at once and the process shuts down and exits
with status 1, so that an orchestrator (systemd, Kubernetes) restarts it. With data
parallelism (``data_parallel_size`` > 1) the engines are replicas in processes of their own
(``hitchllm.data_parallel``): one that stops fails its own requests and turns ``/health`` to
503 while the others go on serving; the server exits (status 1) once none is left. One engine
runs the same way, as a single replica in a process of its own (``engine_process``, the
default on CUDA): the server's event loop (HTTP, SSE, JSON) and the engine's host work
(scheduling, input preparation, detokenization) then do not take turns on one GIL.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hitchllm.config import EngineConfig
from hitchllm.entrypoints.startup import freeze_startup_objects
from hitchllm.lora import LoRARequest
from hitchllm.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from hitchllm.engine.engine_client import EngineClient
    from hitchllm.entrypoints.openai.metrics import MetricsSource
    from hitchllm.entrypoints.openai.server import ServerLimits

logger = logging.getLogger(__name__)


def serve(
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: list[str] | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    limits: ServerLimits | None = None,
    lora_modules: list[LoRARequest] | None = None,
    data_parallel_size: int = 1,
    engine_process: bool | None = None,
) -> None:
    """Start the engine and serve it until interrupted (or until the engine dies: then exit
    with status 1). Binds 127.0.0.1 unless told otherwise. ``lora_modules`` are LoRA adapters
    loaded at start-up (needs ``enable_lora``), each served as a model of its name.
    ``data_parallel_size`` engine replicas, each in its own process (on its own GPUs), share
    the requests; one engine runs in a process of its own too if ``engine_process`` (None:
    on CUDA, ``use_engine_process``), else it steps in a thread of this process."""
    missing = [name for name in ("uvicorn", "fastapi", "transformers")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"the server needs extra packages ({missing[0]} is missing): "
                         "pip install 'hitchllm[serve]'")
    template = Path(chat_template).read_text() if chat_template else None
    names = served_model_name or [engine_config.model]
    _check_lora_modules(engine_config, names, lora_modules or [])
    if data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {data_parallel_size}")
    # /metrics is open to scrapers: a name that is a local path is labelled by its last part.
    metrics_name = Path(names[0]).name if Path(names[0]).exists() else names[0]
    server: Any = None

    def stop_serving() -> None:
        logger.error("the engine loop died (every replica's, with data parallelism); "
                     "shutting the server down (exit status 1)")
        if server is not None:
            server.should_exit = True

    # uvicorn stops gracefully on SIGTERM, then raises it again: exit through Python so that
    # the engines (replica processes, workers) are shut down, not left behind; from here on,
    # since a SIGTERM while the replicas (or tensor-parallel workers) load must stop them too.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # Engine processes start first and load (imports, weights) while this process imports
    # the HTTP stack and loads the tokenizer.
    client, metrics = _start_engines(engine_config, data_parallel_size,
                                     use_engine_process(engine_config, engine_process),
                                     metrics_name, lora_modules or [], stop_serving)
    try:
        import uvicorn

        from hitchllm.entrypoints.openai.models import runtime_lora_updating_allowed
        from hitchllm.entrypoints.openai.server import build_app

        allow_lora_updating = engine_config.enable_lora and runtime_lora_updating_allowed()
        if allow_lora_updating:
            logger.warning("LoRA adapters may be loaded at run time (/v1/load_lora_adapter): "
                           "any client can make the server read a directory it can reach")
        tokenizer: Any = load_tokenizer(engine_config.tokenizer or engine_config.model)
        wait_ready = getattr(client, "wait_ready", None)
        if wait_ready is not None:
            wait_ready()
            metrics = client.metrics  # type: ignore[attr-defined]
    except BaseException:
        client.shutdown()
        raise
    app = build_app(client, names, tokenizer, metrics, api_key, template, limits,
                    allow_lora_updating)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", host)
    logger.info("serving %s on http://%s:%d/v1 (OpenAI-compatible)", ", ".join(names), host, port)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    freeze_startup_objects()
    try:
        server.run()
    finally:
        client.shutdown()
    if client.dead_reason is not None:
        raise SystemExit(1)


def use_engine_process(engine_config: EngineConfig, engine_process: bool | None) -> bool:
    """Whether one engine runs in a process of its own: as asked, else on CUDA only. On a GPU
    the server's event loop and the engine's host work are what compete, for the GIL, and a
    process each removes that; on the CPU the forward itself needs the cores, and a second
    process (the pipe, the reader) adds work there without a clear gain (docs/serving.md)."""
    if engine_process is not None:
        return engine_process
    return engine_config.resolve_device().type == "cuda"


def _exit_on_signal(signum: int, _: Any) -> None:
    raise SystemExit(128 + signum)


def _start_engines(
    engine_config: EngineConfig, data_parallel_size: int, engine_process: bool,
    metrics_name: str, lora_modules: list[LoRARequest], stop_serving: Callable[[], None],
) -> tuple[EngineClient, MetricsSource | None]:
    """The engine client the server drives and the metrics it serves: ``data_parallel_size``
    engine processes (one, unless ``engine_process`` is False: then one engine in a thread
    of this process, built here). Engine processes are started, not yet ready: call the
    client's ``wait_ready``, then take its ``metrics`` (None until then). ``stop_serving`` is
    called once no engine is left."""
    max_loras = engine_config.max_loras if engine_config.enable_lora else None
    if data_parallel_size > 1 or engine_process:
        from hitchllm.data_parallel.client import DataParallelEngine

        dp = DataParallelEngine(engine_config, data_parallel_size, metrics_name, lora_modules,
                                on_all_dead=stop_serving, wait=False)
        return dp, None
    from hitchllm.engine.async_engine import AsyncLLMEngine
    from hitchllm.engine.llm_engine import LLMEngine
    from hitchllm.entrypoints.openai.metrics import ServerMetrics

    engine = LLMEngine(engine_config)
    for lora in lora_modules:
        engine.add_lora(lora)
    metrics = ServerMetrics(metrics_name, max_loras)
    return AsyncLLMEngine(engine, on_step=metrics.observe,
                          on_dead=lambda _: stop_serving()), metrics


def _check_lora_modules(engine_config: EngineConfig, names: list[str],
                        lora_modules: list[LoRARequest]) -> None:
    """``--lora-modules`` needs ``--enable-lora`` and names distinct from each other and from
    the base model's."""
    if not lora_modules:
        return
    if not engine_config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    seen = set(names)
    for lora in lora_modules:
        if lora.lora_name in seen:
            raise ValueError(f"--lora-modules: the name {lora.lora_name!r} is used twice (or is "
                             "the base model's); give each adapter its own name")
        seen.add(lora.lora_name)
