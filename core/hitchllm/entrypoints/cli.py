"""The ``hitchllm`` command: ``generate``, ``chat``, ``serve``, ``serve-disagg``, ``bench``,
``backends``, ``tiny-model``. Without ``--model`` they use the bundled default model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hitchllm.bundled_model import DEFAULT_SERVED_MODEL_NAME, default_model_path
from hitchllm.entrypoints.startup import collector_paused, freeze_startup_objects
from hitchllm.lora import LoRARequest
from hitchllm.sampling_params import SamplingParams
from hitchllm.unsupported_args import VLLM_ARGS_NOT_SUPPORTED

# Torch (and the OpenMP runtime it loads) is imported only once ``main`` has chosen OpenMP's
# settings: see ``hitchllm.cpu_threads``.


def add_engine_args(
    parser: argparse.ArgumentParser, model_default: str | None = default_model_path(),
    own_flags: tuple[str, ...] = (),
) -> None:
    """Flags that become ``EngineConfig`` fields; ``own_flags`` are the vLLM arguments the
    command defines itself (``serve``'s ``data_parallel_size``)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=model_default,
                   help="checkpoint directory (default: the bundled code model)")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="auto (the model's dtype, default) or fp8 (fp8_e4m3; also fp8_e5m2); "
                        "fp8 needs the hitchllm-quantization plugin")
    g.add_argument("--calculate-kv-scales", action="store_true", default=None,
                   help="fp8 KV cache: compute each layer's k_scale/v_scale from the first "
                        "prompts served (default: the checkpoint's scales, else 1.0)")
    g.add_argument("--quantization", help="a weight quantization method from a plugin, e.g. "
                   "fp8 or awq (default: the checkpoint's quant_method, if any)")
    g.add_argument("--speculative-method",
                   help="speculative decoding proposer from a plugin, e.g. ngram, draft_model "
                        "or eagle (hitchllm-specdec); needs --num-speculative-tokens")
    g.add_argument("--num-speculative-tokens", type=int,
                   help="draft tokens proposed per request and step")
    g.add_argument("--speculative-model",
                   help="checkpoint directory of the draft model or EAGLE head")
    g.add_argument("--prompt-lookup-min", type=int,
                   help="ngram: shortest context suffix to match (default 1)")
    g.add_argument("--prompt-lookup-max", type=int,
                   help="ngram: longest context suffix to match (default 4)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters named by requests (needs the hitchllm-lora plugin)")
    g.add_argument("--max-loras", type=int,
                   help="LoRA adapters active on the device at once (default 1)")
    g.add_argument("--max-lora-rank", type=int, help="largest LoRA rank served (default 16)")
    g.add_argument("--max-cpu-loras", type=int,
                   help="LoRA adapters kept in host memory (default: --max-loras)")
    g.add_argument("--device", help="auto (default), cpu or cuda[:N]")
    g.add_argument("-tp", "--tensor-parallel-size", type=int,
                   help="split the model over this many ranks, one worker process each (one "
                        "GPU each on CUDA; default 1)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int,
                   help="split the decoder layers into this many stages, each its own "
                        "group of --tensor-parallel-size worker processes (default 1)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"],
                   help="where tensor-parallel workers run: mp (processes on this host, "
                        "default) or ray (actors on a Ray cluster's nodes; needs "
                        "hitchllm[ray])")
    g.add_argument("--ray-placement-strategy",
                   choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
                   help="ray: how ranks spread over the cluster's nodes (default STRICT_PACK: "
                        "all on one node)")
    g.add_argument("--ray-placement-timeout-s", type=float,
                   help="ray: seconds to wait for the cluster to place every rank (default 60)")
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
    g.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"],
                   help="what a preempted request gives up: recompute (default), swap (its "
                        "KV blocks go to host memory and back), auto (the cheaper by "
                        "estimate)")
    g.add_argument("--swap-space", type=float,
                   help="GiB of host memory per worker for swapped-out KV blocks (default 4; "
                        "used with --preemption-mode swap or auto)")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's sampling RNG")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: no CUDA graphs, every step runs eagerly")
    g.add_argument("--no-piecewise-cuda-graphs", dest="piecewise_cuda_graphs",
                   action="store_false", default=None,
                   help="CUDA: steps with prompt chunks run eagerly instead of replaying "
                        "graphs of everything but attention")
    g.add_argument("--no-enable-fusion", dest="enable_fusion", action="store_false",
                   default=None, help="CUDA: run norms, rotary and activations unfused")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   default=None, help="wait for each step's tokens before scheduling the next")
    g.add_argument("--cpu-threads", type=int,
                   help="CPU: torch threads for the model (default: the cores this process "
                        "may use, from its CPU affinity and cgroup CPU quota)")
    g.add_argument("--kv-role", choices=["producer", "consumer"],
                   help="disaggregated serving: producer (computes prompts, ships their KV) "
                        "or consumer (loads it, decodes); needs --kv-connector")
    g.add_argument("--kv-connector",
                   help="KV connector from a plugin: shared_memory (one host) or "
                        "torch_distributed (GPU to GPU), from hitchllm-kv-transfer")
    g.add_argument("--kv-connector-extra-config", metavar="JSON",
                   help="the connector's options as JSON, e.g. '{\"port\": 14579}'")
    g.add_argument("--kv-load-timeout-s", type=float,
                   help="consumer: seconds to wait for a request's KV before computing its "
                        "prompt itself (default 30)")
    # vLLM's flags for what hitchllm does not implement yet: accepted so that EngineConfig
    # refuses them by name (or ignores a no-op value) instead of argparse calling them unknown.
    for name, (no_op, _) in VLLM_ARGS_NOT_SUPPORTED.items():
        if name in own_flags:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(no_op, bool):
            g.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
        else:
            kind = type(no_op) if isinstance(no_op, (int, float)) else str
            g.add_argument(flag, type=kind, help=argparse.SUPPRESS)


ENGINE_FLAGS = ["tokenizer", "dtype", "kv_cache_dtype", "calculate_kv_scales", "quantization",
                "speculative_method", "num_speculative_tokens", "speculative_model",
                "prompt_lookup_min", "prompt_lookup_max", "enable_lora", "max_loras",
                "max_lora_rank", "max_cpu_loras", "device", "tensor_parallel_size",
                "pipeline_parallel_size", "distributed_executor_backend", "ray_placement_strategy",
                "ray_placement_timeout_s", "attention_backend",
                "block_size", "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization",
                "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "enable_prefix_caching", "scheduling_policy", "preemption_mode", "swap_space",
                "seed", "enforce_eager", "piecewise_cuda_graphs",
                "enable_fusion", "async_scheduling", "cpu_threads", *VLLM_ARGS_NOT_SUPPORTED]


# vLLM engine arguments that ``serve`` implements itself rather than the engine.
SERVE_FLAGS = ("data_parallel_size",)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields given on the command line (unset ones left out)."""
    kwargs = {n: getattr(args, n) for n in ENGINE_FLAGS if getattr(args, n) is not None}
    kv_transfer = kv_transfer_config(args)
    if kv_transfer is not None:
        kwargs["kv_transfer_config"] = kv_transfer
    return kwargs


def kv_transfer_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """``kv_transfer_config`` from the --kv-* flags (None when none is given)."""
    role, name = getattr(args, "kv_role", None), getattr(args, "kv_connector", None)
    extra, timeout = (getattr(args, "kv_connector_extra_config", None),
                      getattr(args, "kv_load_timeout_s", None))
    if role is None and name is None and extra is None and timeout is None:
        return None
    if role is None or name is None:
        raise ValueError("disaggregated serving needs both --kv-role (producer or consumer) "
                         "and --kv-connector (e.g. shared_memory)")
    config: dict[str, Any] = {"kv_role": role, "kv_connector": name}
    if extra is not None:
        try:
            config["kv_connector_extra_config"] = json.loads(extra)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-connector-extra-config is not JSON ({exc}); write e.g. "
                             "'{\"path\": \"/dev/shm/kv\"}'") from exc
    if timeout is not None:
        config["kv_load_timeout_s"] = timeout
    return config


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
    from hitchllm.entrypoints.token_stream import print_stream, stream_request

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    freeze_startup_objects(collect=False)  # the command exits when its prompts are done
    prompts = args.prompt or [sys.stdin.read()]
    if len(prompts) == 1 and params.n == 1:  # one sequence: print its tokens as they come
        sys.stdout.write(prompts[0])
        out = print_stream(stream_request(llm.engine, prompts[0], params), params, sys.stdout)
        print()
        print_logprobs(llm, out.outputs[0])
        return 0
    for out in llm.generate(prompts, params, use_tqdm=sys.stderr.isatty()):
        for seq in out.outputs:
            print(f"--- prompt {out.request_id}, sequence {seq.index} "
                  f"(finish_reason={seq.finish_reason})")
            print(f"{out.prompt or ''}{seq.text}")
            print_logprobs(llm, seq)
    return 0


def print_logprobs(llm: Any, seq: Any) -> None:
    """Each generated token with its top-N logprobs, when ``--logprobs`` asked for them."""
    if seq.logprobs is None:
        return
    tok = llm.get_tokenizer()
    for token_id, entry in zip(seq.token_ids, seq.logprobs):
        top = ", ".join(f"{tok.decode([t])!r}:{lp.logprob:.3f}" for t, lp in entry.items())
        print(f"  {tok.decode([token_id])!r} -> {top}")


def cmd_chat(args: argparse.Namespace) -> int:
    from hitchllm.entrypoints.chat_history import fit_conversation, reply_room
    from hitchllm.entrypoints.llm import LLM, chat_prompt_token_ids
    from hitchllm.entrypoints.token_stream import print_stream, stream_request

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    freeze_startup_objects()
    limit = llm.engine.max_model_len
    budget = limit - reply_room(params.max_tokens, limit)

    def count_tokens(conversation: list[dict[str, str]]) -> int:
        return len(chat_prompt_token_ids(llm.get_tokenizer(), conversation))

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
        try:
            kept, dropped = fit_conversation(
                [*messages, {"role": "user", "content": line.rstrip("\n")}], count_tokens, budget)
        except ValueError as exc:  # this message alone is too long: skip it, keep chatting
            print(f"error: {exc}", file=sys.stderr)
            continue
        if dropped:
            print(f"note: dropped the {dropped} oldest message(s) to stay within "
                  f"max_model_len={limit}", file=sys.stderr)
        ids = chat_prompt_token_ids(llm.get_tokenizer(), kept)
        out = print_stream(stream_request(llm.engine, {"prompt_token_ids": ids}, params),
                           params, sys.stdout)
        print(flush=True)
        messages = [*kept, {"role": "assistant", "content": out.outputs[0].text}]


def served_model(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``hitchllm serve``'s checkpoint and the names clients use for it.

    The model comes as ``MODEL`` (like ``vllm serve MODEL``) or ``--model``; clients name it as
    it was given, vLLM's convention, unless ``--served-model-name`` says otherwise. The bundled
    model, served when none is given, answers to ``hitchllm-default`` (reported first) and to
    its path.
    """
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"the model is given twice, as {args.model_tag!r} and as --model "
                         f"{args.model!r}; give it once")
    model = args.model_tag or args.model
    if model:
        return model, args.served_model_name or [model]
    path = default_model_path()
    return path, args.served_model_name or [DEFAULT_SERVED_MODEL_NAME, path]


def parse_lora_modules(specs: list[str]) -> list[LoRARequest]:
    """``--lora-modules`` entries, ``NAME=PATH`` or vLLM's JSON form
    ``{"name": NAME, "path": PATH}``, as adapters numbered from 1."""
    adapters = []
    for i, spec in enumerate(specs, start=1):
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: {spec!r} is not valid JSON ({exc})") from exc
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("path"), str)):
                raise ValueError(f"--lora-modules: {spec!r} must hold string fields "
                                 "\"name\" and \"path\"")
            name, path = entry["name"], entry["path"]
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
        if not name or not path:
            raise ValueError(f"--lora-modules: {spec!r} needs both a name and a path")
        adapters.append(LoRARequest(name, i, path))
    return adapters


def cmd_serve(args: argparse.Namespace) -> int:
    from hitchllm.config import EngineConfig
    from hitchllm.entrypoints.openai.api_server import serve
    from hitchllm.entrypoints.openai.server import ServerLimits

    model, names = served_model(args)
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k not in SERVE_FLAGS}
    serve(
        EngineConfig(model=model, **kwargs),
        host=args.host, port=args.port, served_model_name=names,
        api_key=args.api_key, chat_template=args.chat_template,
        limits=ServerLimits(max_n=args.max_n, max_request_bytes=args.max_request_bytes),
        lora_modules=parse_lora_modules(args.lora_modules or []),
        data_parallel_size=args.data_parallel_size,
        engine_process=args.engine_process,
    )
    return 0


def cmd_serve_disagg(args: argparse.Namespace) -> int:
    try:
        from hitchllm.entrypoints.disagg_router import serve_router
    except ImportError as exc:
        raise SystemExit(f"the router needs extra packages ({exc.name} is missing): "
                         "pip install 'hitchllm[serve]'") from exc

    serve_router(args.prefill, args.decode, host=args.host, port=args.port,
                 timeout_s=args.timeout_s)
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from hitchllm.entrypoints.backends_table import print_backends

    return print_backends(args.model, args.device, args.dtype, args.block_size,
                          args.kv_cache_dtype)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from hitchllm.tiny_model import build_tiny_checkpoint

    path = build_tiny_checkpoint(args.path, args.architecture, seed=args.seed)
    print(f"wrote a tiny random {args.architecture} checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hitchllm.entrypoints import bench_perplexity, bench_serve, bench_throughput

    parser = argparse.ArgumentParser(prog="hitchllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: stdin)")
    p.set_defaults(func=cmd_generate, builds_engine=True)

    p = sub.add_parser("chat", help="chat on stdin/stdout with the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", help="system message")
    p.set_defaults(func=cmd_chat, builds_engine=True)

    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="checkpoint directory, as --model (default: the bundled code model)")
    add_engine_args(p, model_default=None, own_flags=SERVE_FLAGS)
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1, metavar="N",
                   help="engine replicas, each in its own process (on CUDA: on its own GPUs), "
                        "behind a load balancer (default 1)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own, so that HTTP, SSE and JSON "
                        "work does not hold the GIL the engine's host work needs "
                        "(--no-engine-process: in a thread of the server's process; default: "
                        "a process on CUDA, a thread on the CPU, whose cores the forward uses)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model name(s) clients use (default: MODEL as given; for the bundled "
                        f"model {DEFAULT_SERVED_MODEL_NAME} and its path)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--chat-template", help="Jinja chat template file (overrides the model's)")
    p.add_argument("--max-n", type=int, default=128,
                   help="largest n (sequences per prompt) a request may ask for (default 128)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="largest request body in bytes; larger ones get 413 (default 4 MiB)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters served as models of their names (with --enable-lora): "
                        "NAME=PATH, or JSON '{\"name\": NAME, \"path\": PATH}'")
    p.set_defaults(func=cmd_serve, builds_engine=True)

    p = sub.add_parser("serve-disagg",
                       help="route OpenAI requests over a prefill and a decode instance")
    p.add_argument("--prefill", required=True, metavar="URL",
                   help="base URL of the producer (hitchllm serve --kv-role producer), e.g. "
                        "http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL",
                   help="base URL of the consumer (hitchllm serve --kv-role consumer)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="longest a request to either instance may take (default 600)")
    p.set_defaults(func=cmd_serve_disagg)

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
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("tiny-model", help="write a tiny random checkpoint (for trying things out)")
    p.add_argument("path")
    p.add_argument("--architecture", default="LlamaForCausalLM")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hitchllm.cpu_threads import default_omp_wait_policy

    default_omp_wait_policy()  # before anything imports torch
    # Without argv, this process is the command (run from the shell) and exits after it.
    with collector_paused(process_exits_after=argv is None):  # see hitchllm.entrypoints.startup
        return _run(sys.argv[1:] if argv is None else argv)


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # benchmarks record the command that produced their numbers
    if not getattr(args, "builds_engine", False):
        freeze_startup_objects(collect=False)  # nothing more to build: the collector resumes
    try:
        return args.func(args)
    except ValueError as exc:  # configuration and request errors: say what to change
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except OSError as exc:  # a missing file or directory: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: streamed requests are already aborted
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
