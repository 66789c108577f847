"""``hitchllm serve``: build the engine, wrap it for asyncio, serve it with uvicorn.

If the engine loop dies, ``/health`` answers 503 at once and the process shuts down and exits
with status 1, so that an orchestrator (systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hitchllm.config import EngineConfig
from hitchllm.lora import LoRARequest

if TYPE_CHECKING:
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
) -> None:
    """Start the engine and serve it until interrupted (or until the engine dies: then exit
    with status 1). Binds 127.0.0.1 unless told otherwise. ``lora_modules`` are LoRA adapters
    loaded at start-up (needs ``enable_lora``), each served as a model of its name."""
    try:
        import uvicorn
        from transformers import AutoTokenizer

        from hitchllm.engine.async_engine import AsyncLLMEngine
        from hitchllm.engine.llm_engine import LLMEngine
        from hitchllm.entrypoints.openai.metrics import ServerMetrics
        from hitchllm.entrypoints.openai.models import runtime_lora_updating_allowed
        from hitchllm.entrypoints.openai.server import build_app
    except ImportError as exc:
        raise SystemExit(
            f"the server needs extra packages ({exc.name} is missing): "
            "pip install 'hitchllm[serve]'"
        ) from exc

    template = Path(chat_template).read_text() if chat_template else None
    names = served_model_name or [engine_config.model]
    _check_lora_modules(engine_config, names, lora_modules or [])
    engine = LLMEngine(engine_config)
    for lora in lora_modules or []:
        engine.add_lora(lora)
    allow_lora_updating = engine_config.enable_lora and runtime_lora_updating_allowed()
    if allow_lora_updating:
        logger.warning("LoRA adapters may be loaded at run time (/v1/load_lora_adapter): any "
                       "client can make the server read a directory it can reach")
    # /metrics is open to scrapers: a name that is a local path is labelled by its last part.
    metrics = ServerMetrics(Path(names[0]).name if Path(names[0]).exists() else names[0],
                            engine_config.max_loras if engine_config.enable_lora else None)
    server: uvicorn.Server | None = None

    def on_dead(_: BaseException) -> None:
        logger.error("the engine loop died; shutting the server down (exit status 1)")
        if server is not None:
            server.should_exit = True

    async_engine = AsyncLLMEngine(engine, on_step=metrics.observe, on_dead=on_dead)
    tokenizer: Any = AutoTokenizer.from_pretrained(engine_config.tokenizer or engine_config.model)
    app = build_app(async_engine, names, tokenizer, metrics, api_key, template, limits,
                    allow_lora_updating)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", host)
    logger.info("serving %s on http://%s:%d/v1 (OpenAI-compatible)", ", ".join(names), host, port)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    # uvicorn re-raises SIGTERM once it has shut down gracefully: with the default handler the
    # process would die there, before ``shutdown`` stops the engine (and its worker processes).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        server.run()
    finally:
        async_engine.shutdown()
    if async_engine.dead_reason is not None:
        raise SystemExit(1)


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
