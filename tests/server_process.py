"""Start ``hitchllm serve`` in a subprocess on a free loopback port, for tests and benches."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(args: list[str], timeout: float = 120.0,
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield the base URL (``http://127.0.0.1:PORT``) of a server started with ``args``
    (and ``env`` added to this process's environment)."""
    with running_server_process(args, timeout, env) as (url, _):
        yield url


@contextmanager
def running_server_process(
    args: list[str], timeout: float = 120.0, env: dict[str, str] | None = None,
    command: str = "serve",
) -> Iterator[tuple[str, subprocess.Popen]]:
    """As ``running_server``, yielding the server's process too; ``command`` is the CLI's
    subcommand that serves (``serve-disagg`` for the disaggregation router)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hitchllm.entrypoints.cli", command, "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=None if env is None else {**os.environ, **env},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def scrape(url: str, name: str, label: str = "") -> float:
    """A metric from ``/metrics``, summed over its series that carry ``label`` (e.g.
    ``finished_reason="abort"``); KeyError if no such series exists."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


def spawned_children(pid: int) -> list[int]:
    """The processes ``pid`` started with multiprocessing's spawn (a server's replicas)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(proc.name))
    return sorted(found)


@contextmanager
def in_process_server(model: str, served_name: str) -> Iterator:
    """A ``TestClient`` of one ordinary engine (block size 4, max_model_len 256) behind the
    server's app, in this process: the reference a multi-process setup must answer like."""
    from fastapi.testclient import TestClient

    from hitchllm.config import EngineConfig
    from hitchllm.engine.async_engine import AsyncLLMEngine
    from hitchllm.engine.llm_engine import LLMEngine
    from hitchllm.entrypoints.openai.metrics import ServerMetrics
    from hitchllm.entrypoints.openai.server import build_app

    engine = LLMEngine(EngineConfig(model=model, block_size=4, max_model_len=256))
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, [served_name], engine.tokenizer, ServerMetrics(served_name))
    with TestClient(app) as http:
        yield http
    async_engine.shutdown()
