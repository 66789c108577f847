"""The ``hitchllm`` command: ``generate``, ``chat``, ``serve``, ``bench``, ``backends``,
``tiny-model``. Without ``--model`` they use the bundled default model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hitchllm.bundled_model import default_model_path
from hitchllm.entrypoints import bench_perplexity, bench_serve, bench_throughput
from hitchllm.entrypoints.backends_table import print_backends
from hitchllm.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that become ``EngineConfig`` fields."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=default_model_path(),
                   help="checkpoint directory (default: the bundled code model)")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    g.add_argument("--device", help="auto (default), cpu or cuda[:N]")
    g.add_argument("--attention-backend", help="force a backend by name (see `hitchllm backends`)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, help="exact number of KV-cache blocks")
    g.add_argument("--kv-cache-memory", help="memory for the KV cache, e.g. 2GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="turn automatic prefix caching off")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"])
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's sampling RNG")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: no CUDA graphs, every step runs eagerly")
    g.add_argument("--no-enable-fusion", dest="enable_fusion", action="store_false",
                   default=None, help="CUDA: run norms, rotary and activations unfused")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   default=None, help="wait for each step's tokens before scheduling the next")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields given on the command line (unset ones left out)."""
    names = ["tokenizer", "dtype", "device", "attention_backend", "block_size", "num_kv_blocks",
             "kv_cache_memory", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
             "max_num_batched_tokens", "enable_prefix_caching", "scheduling_policy", "seed",
             "enforce_eager", "enable_fusion", "async_scheduling"]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Flags that become ``SamplingParams`` fields."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, help="per-request seed")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="+")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1, help="sequences per prompt")
    g.add_argument("--logprobs", type=int, help="also print the top-N logprobs of each token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, stop=args.stop,
        stop_token_ids=args.stop_token_ids, min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from hitchllm.entrypoints.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt or [sys.stdin.read()]
    for out in llm.generate(prompts, params, use_tqdm=len(prompts) > 1):
        for seq in out.outputs:
            if len(prompts) > 1 or len(out.outputs) > 1:
                print(f"--- prompt {out.request_id}, sequence {seq.index} "
                      f"(finish_reason={seq.finish_reason})")
            print(f"{out.prompt or ''}{seq.text}")
            if seq.logprobs is not None:
                tok = llm.get_tokenizer()
                for token_id, entry in zip(seq.token_ids, seq.logprobs):
                    top = ", ".join(f"{tok.decode([t])!r}:{lp.logprob:.3f}"
                                    for t, lp in entry.items())
                    print(f"  {tok.decode([token_id])!r} -> {top}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from hitchllm.entrypoints.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from hitchllm.config import EngineConfig
    from hitchllm.entrypoints.openai.api_server import serve
    from hitchllm.entrypoints.openai.server import ServerLimits

    serve(
        EngineConfig(model=args.model, **engine_kwargs(args)),
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=args.api_key, chat_template=args.chat_template,
        limits=ServerLimits(max_n=args.max_n, max_request_bytes=args.max_request_bytes),
    )
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    return print_backends(args.model, args.device, args.dtype, args.block_size)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from hitchllm.tiny_model import build_tiny_checkpoint

    path = build_tiny_checkpoint(args.path, args.architecture, seed=args.seed)
    print(f"wrote a tiny random {args.architecture} checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hitchllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: stdin)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat on stdin/stdout with the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", help="model name(s) clients use")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--chat-template", help="Jinja chat template file (overrides the model's)")
    p.add_argument("--max-n", type=int, default=128,
                   help="largest n (sequences per prompt) a request may ask for (default 128)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="largest request body in bytes; larger ones get 413 (default 4 MiB)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("serve", help="load-test a running OpenAI-compatible server")
    bench_serve.add_args(p)
    p.set_defaults(func=bench_serve.main)
    p = bench.add_parser("throughput", help="offline generation throughput (vs HF generate)")
    add_engine_args(p)
    bench_throughput.add_args(p)
    p.set_defaults(func=lambda a: bench_throughput.main(a, engine_kwargs(a)))
    p = bench.add_parser("perplexity", help="loss, perplexity and bits per byte on text files")
    add_engine_args(p)
    bench_perplexity.add_args(p)
    p.set_defaults(func=lambda a: bench_perplexity.main(a, engine_kwargs(a)))

    p = sub.add_parser("backends", help="list attention backends and which one auto mode picks")
    p.add_argument("--model", help="checkpoint directory (default: a typical 8B-like shape)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("tiny-model", help="write a tiny random checkpoint (for trying things out)")
    p.add_argument("path")
    p.add_argument("--architecture", default="LlamaForCausalLM")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv  # benchmarks record the command that produced their numbers
    try:
        return args.func(args)
    except ValueError as exc:  # configuration and request errors: say what to change
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
