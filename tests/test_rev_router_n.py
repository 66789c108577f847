"""Review: ``hitchllm serve-disagg`` with a request for several completions (``n=2``). The
router asked the prefill instance for it with ``kv_transfer_params``, which engines take for
one sequence only, so the client got a 400 about ``kv_transfer_params`` (a field it never
sent). Such a request now goes to the decode instance alone, which computes its prompt."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi.testclient import TestClient
from server_process import free_port

from hitchllm.config import EngineConfig
from hitchllm.engine.async_engine import AsyncLLMEngine
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.entrypoints.disagg_router import build_router_app
from hitchllm.entrypoints.openai.metrics import ServerMetrics
from hitchllm.entrypoints.openai.server import build_app

ENGINE = dict(block_size=4, max_model_len=128)


@contextmanager
def serving(model: str, **kv) -> Iterator[str]:
    """An instance (the server's app on its engine) on a local port, in a thread."""
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, **ENGINE, **kv)))
    app = build_app(engine, ["tiny"], engine.engine.tokenizer, ServerMetrics("tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the instance did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()


def test_a_request_for_two_completions_is_served(llama_path, tmp_path):
    role = dict(kv_connector="shared_memory", kv_connector_extra_config={"path": str(tmp_path)})
    with serving(llama_path, kv_transfer_config={**role, "kv_role": "producer"}) as prefill, \
            serving(llama_path, kv_transfer_config={**role, "kv_role": "consumer"}) as decode, \
            TestClient(build_router_app(prefill, decode, timeout_s=60)) as router:
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 6,
                "temperature": 0, "n": 2}
        answer = router.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert len(choices) == 2 and choices[0]["text"] == choices[1]["text"] != ""
        # One completion still goes through the producer.
        one = router.post("/v1/completions", json={**body, "n": 1})
        assert one.status_code == 200 and one.json()["choices"][0]["text"] == choices[0]["text"]
