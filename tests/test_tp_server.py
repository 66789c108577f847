"""``hitchllm serve -tp 2`` on the CPU: the OpenAI server answers from 2 worker processes what
one process generates, and stopping the server (SIGTERM) stops its workers."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from server_process import running_server
from tp_support import TP_TEST_TIMEOUT_S, alive

from hitchllm import LLM, SamplingParams

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--block-size", "4",
                "--num-kv-blocks", "64", "--max-model-len", "64"]
PROMPT = "def add(a, b):"


def processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, command line) of every live process (Linux /proc)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        found[int(proc.name)] = (ppid, cmdline)
    return found


def worker_pids(url: str) -> list[int]:
    """The worker processes of the server listening at ``url``: children of its engine
    process (the default), or of the server itself under --no-engine-process."""
    port = url.rsplit(":", 1)[1]
    table = processes()
    [server] = [pid for pid, (_, cmd) in table.items()
                if "serve" in cmd and "--port" in cmd and port in cmd]

    def spawned(parent: int) -> list[int]:
        return [pid for pid, (ppid, cmd) in table.items()
                if ppid == parent and any("spawn_main" in part for part in cmd)]

    engine = [pid for pid in spawned(server) if spawned(pid)]
    return spawned(engine[0]) if engine else spawned(server)


def complete(url: str) -> str:
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TP_TEST_TIMEOUT_S) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_a_tp2_server_answers_like_one_process_and_stops_its_workers(llama_path):
    one = LLM(llama_path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = one.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    args = [llama_path, "--served-model-name", "m", "-tp", "2", *ENGINE_FLAGS]
    with running_server(args, timeout=TP_TEST_TIMEOUT_S, env={"HITCHLLM_PLUGINS": ""}) as url:
        workers = worker_pids(url)
        assert len(workers) == 2
        assert complete(url) == expected
    assert not any(alive(pid) for pid in workers)
