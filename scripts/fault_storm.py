"""A bounded load-and-fault run against ``hitchllm serve`` on loopback.

Starts a server on a tiny random model, records the greedy tokens of a fixed prompt, then sends,
all at once, normal requests (streaming and not, both endpoints) mixed with every kind of bad
request found so far: parameters the sampler cannot compute, random field values (a seeded
fuzzer), bodies over the size limit, prompts far over max_model_len, lone surrogates, too
large ``n``, unknown fields, broken JSON, and clients that disconnect mid-request. Afterwards it
checks that the engine is alive, the KV cache is empty and the greedy tokens are unchanged, and
prints a table (requests by outcome) to paste into docs/serving.md.

    python scripts/fault_storm.py [--rounds 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

try:  # the openai client's HTTP library (httpx's successor in current releases)
    import httpx2 as httpx
except ImportError:
    import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import running_server, scrape

from hitchllm.tiny_model import build_tiny_checkpoint

MODEL = "tiny"
MAX_BYTES = 1_000_000
KILLERS = [
    {"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 2**64 - 1, "n": 2},
    {"top_p": 1e-300, "temperature": 1.0}, {"repetition_penalty": 1e-46, "top_p": 0.5},
    {"temperature": 1e39}, {"top_k": 2**70, "temperature": 1.0}, {"logprobs": 10**6},
]
FUZZ_VALUES = [None, True, -1, 0, 1, 2**63, 2**64, -(2**70), 1e-300, 1e-45, 3.5e38, -0.0, 0.5,
               "", "x", "\u00e9\u4e2d", [], [1, 2], ["a"], {}, {"a": 1}]
FUZZ_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens", "stop",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
               "min_tokens", "stop_token_ids", "ignore_eos", "echo", "logit_bias",
               "prompt_logprobs", "truncate_prompt_tokens", "stream", "prompt",
               "skip_special_tokens", "include_stop_str_in_output", "best_of"]


def fuzz_body(rng: random.Random) -> dict:
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4}
    for field in rng.sample(FUZZ_FIELDS, rng.randint(1, 4)):
        body[field] = rng.choice(FUZZ_VALUES)
    return body


async def send(http: httpx.AsyncClient, kind: str, path: str, content: bytes,
               outcomes: collections.Counter, disconnect_after: float | None = None) -> None:
    headers = {"Content-Type": "application/json"}
    try:
        if disconnect_after is not None:
            try:
                await asyncio.wait_for(http.post(path, content=content, headers=headers),
                                       disconnect_after)
            except asyncio.TimeoutError:
                outcomes[(kind, "client left")] += 1
                return
        if b'"stream": true' in content:
            async with http.stream("POST", path, content=content, headers=headers) as r:
                async for _ in r.aiter_bytes():
                    pass
                outcomes[(kind, r.status_code)] += 1
                return
        r = await http.post(path, content=content, headers=headers)
        outcomes[(kind, r.status_code)] += 1
    except httpx.HTTPError as exc:
        outcomes[(kind, type(exc).__name__)] += 1


def greedy_ids(base: str) -> list[int]:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["tokens"]


async def storm(base: str, rounds: int, seed: int) -> collections.Counter:
    rng = random.Random(seed)
    outcomes: collections.Counter = collections.Counter()
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        for _ in range(rounds):
            jobs = []
            for i in range(24):
                stream = i % 2 == 0
                body = {"model": MODEL, "prompt": f"request {i} " * (1 + i % 5),
                        "max_tokens": 8 + i % 9, "temperature": 0.8, "seed": i,
                        "ignore_eos": True, "stream": stream}
                jobs.append(send(http, "normal completion", "/v1/completions",
                                 json.dumps(body).encode(), outcomes))
            for i in range(8):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                        "max_tokens": 8, "stream": i % 2 == 0}
                jobs.append(send(http, "normal chat", "/v1/chat/completions",
                                 json.dumps(body).encode(), outcomes))
            for extra in KILLERS:
                body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 4, **extra}
                jobs.append(send(http, "killer parameters", "/v1/completions",
                                 json.dumps(body).encode(), outcomes))
            for _ in range(40):
                jobs.append(send(http, "fuzzed fields", "/v1/completions",
                                 json.dumps(fuzz_body(rng)).encode(), outcomes))
            big = {"model": MODEL, "prompt": "a" * (MAX_BYTES + 10), "max_tokens": 1}
            jobs.append(send(http, "body over limit", "/v1/completions",
                             json.dumps(big).encode(), outcomes))
            long_prompt = {"model": MODEL, "prompt": "ab " * 300_000, "max_tokens": 1}
            jobs.append(send(http, "prompt over max_model_len", "/v1/completions",
                             json.dumps(long_prompt).encode(), outcomes))
            jobs.append(send(http, "lone surrogate", "/v1/completions",
                             b'{"model": "tiny", "prompt": "a\\ud800", "max_tokens": 2}',
                             outcomes))
            jobs.append(send(http, "n over limit", "/v1/completions",
                             b'{"model": "tiny", "prompt": "a", "n": 100000}', outcomes))
            jobs.append(send(http, "unknown field", "/v1/completions",
                             b'{"model": "tiny", "prompt": "a", "use_beam_search": true}',
                             outcomes))
            jobs.append(send(http, "broken JSON", "/v1/completions", b'{"model": "tiny", ',
                             outcomes))
            for i in range(4):
                body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 400, "n": 4,
                        "ignore_eos": True, "stream": i % 2 == 0}
                jobs.append(send(http, "client disconnects", "/v1/completions",
                                 json.dumps(body).encode(), outcomes, disconnect_after=0.5))
            rng.shuffle(jobs)
            await asyncio.gather(*jobs)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "llama", "LlamaForCausalLM")
        server_args = ["--model", str(model), "--served-model-name", MODEL, "--max-model-len",
                       "512", "--max-n", "8", "--max-request-bytes", str(MAX_BYTES),
                       "--chat-template", str(write_template(Path(tmp)))]
        with running_server(server_args) as base:
            before = greedy_ids(base)
            start = time.monotonic()
            outcomes = asyncio.run(storm(base, args.rounds, args.seed))
            seconds = time.monotonic() - start
            time.sleep(1.0)  # let aborted requests' blocks be freed
            health = httpx.get(f"{base}/health", timeout=10).status_code
            after = greedy_ids(base)
            kv = scrape(base, "hitchllm:kv_cache_usage_perc")
            running = scrape(base, "hitchllm:num_requests_running")
    print(f"\n{sum(outcomes.values())} requests in {seconds:.1f} s ({args.rounds} rounds)\n")
    print("| requests | sent | outcome |\n|---|---|---|")
    by_kind: dict[str, list[str]] = collections.defaultdict(list)
    for (kind, outcome), count in sorted(outcomes.items(), key=str):
        by_kind[kind].append(f"{count} x {outcome}")
    for kind, parts in by_kind.items():
        total = sum(int(p.split(" x ")[0]) for p in parts)
        print(f"| {kind} | {total} | {', '.join(parts)} |")
    server_errors = sum(c for (_, o), c in outcomes.items() if isinstance(o, int) and o >= 500)
    print(f"\n5xx responses: {server_errors}; /health after: {health}; KV cache in use after: "
          f"{kv:.0%}; requests running after: {running:.0f}; greedy tokens unchanged: "
          f"{after == before}")
    if server_errors or health != 200 or kv or running or after != before:
        raise SystemExit(1)


def write_template(folder: Path) -> Path:
    path = folder / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "assistant:")
    return path


if __name__ == "__main__":
    main()
