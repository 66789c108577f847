"""Multi-LoRA serving throughput against the base model (issue 17, point 5).

The workload of ``hitchllm bench throughput`` (nano-vllm's: ``--num-prompts`` prompts of random
token ids, input and output lengths uniform in ``--input-len`` / ``--output-len``, EOS ignored,
greedy, seed 0; its ``make_workload`` and ``run_hitchllm`` are reused), run in one process in
three configurations, each in its own engine (built, timed, deleted before the next):

- **no LoRA**: ``enable_lora`` off, the baseline;
- **8 adapters**: ``enable_lora`` with ``--num-adapters`` adapters of rank ``--rank``, request
  ``i`` running adapter ``i % 8``, ``max_loras`` 8 (every adapter stays in a device slot);
- **64 adapters**: ``--swap-adapters`` distinct adapters round-robin with ``max_loras``
  ``--swap-max-loras`` (16), so adapters are swapped through the device slots and requests
  wait for a slot.

The adapters are random PEFT LoRA adapters written directly in PEFT's format
(``write_random_adapter``; tests/test_lora_bench_adapters.py checks that PEFT loads them and
that the engine's output with one equals PEFT's), targeting every projection by default
(``--targets``). They are loaded into the engine's host cache before the timed run. Per
configuration the table shows output tokens per second, the ratio to no LoRA, the adapter
activations into device slots during the timed run (``swaps``; adapter 0 is already in a slot
after the warm-up) and the host cache's adapter reads from disk and evictions in that run.
Issue 17's goal: the 8-adapter configuration reaches at least 75% of no LoRA.

    python benchmarks/lora_throughput.py [--results benchmarks/RESULTS.md]   # on the GPU
    python benchmarks/lora_throughput.py --device cpu --model TINY_MODEL --num-prompts 8 \
        --input-len 16 32 --output-len 8 16                                # a smoke run

Without ``--model`` it uses a Qwen3-0.6B-shaped random model at /tmp/qwen3-0.6b, building it
first (benchmarks/build_model.py) when missing, as benchmarks/throughput_gpu.sh does.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from results_md import append_results, entry_heading
from safetensors.torch import save_file

from hitchllm import LLM, LoRARequest
from hitchllm.entrypoints.bench_throughput import Workload, make_workload, run_hitchllm

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = Path("/tmp/qwen3-0.6b")
MODEL_CONFIG = BENCH_DIR / "configs" / "qwen3-0.6b.json"
SECTION = "## Multi-LoRA throughput (issue 17)"
ABOUT = ("nano-vllm's throughput workload without LoRA, with 8 rank-16 adapters round-robin "
         "(all in device slots) and with 64 adapters swapped through 16 slots, each in its own "
         "engine in one process; benchmarks/lora_throughput.py. Goal: 8 adapters reach at "
         "least 75% of no LoRA.")
GOAL_RATIO = 0.75
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


# ---- random PEFT adapters ------------------------------------------------------------------

def projection_shapes(model_config: dict) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each projection of a Llama/Qwen decoder layer, from the
    model's ``config.json``."""
    hidden = model_config["hidden_size"]
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or hidden // heads
    inter = model_config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapter(
    out: Path, model_config: dict, rank: int, targets: Sequence[str] = ALL_TARGETS,
    alpha: float | None = None, seed: int = 0, std: float = 0.02,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a PEFT LoRA adapter of rank ``rank`` on ``targets`` of every decoder layer of the
    model described by ``model_config`` (its ``config.json`` as a dict) to ``out``:
    ``adapter_config.json`` and ``adapter_model.safetensors`` with ``lora_A`` ``[r, in]`` and
    ``lora_B`` ``[out, r]`` drawn from a normal distribution of standard deviation ``std``
    (``lora_alpha`` defaults to ``2 * rank``). Returns ``out``."""
    shapes = projection_shapes(model_config)
    unknown = sorted(set(targets) - set(shapes))
    if unknown or not targets:
        raise ValueError(f"targets {unknown or '(none)'}: choose among {', '.join(ALL_TARGETS)}")
    if rank < 1:
        raise ValueError(f"rank must be positive, got {rank}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config["num_hidden_layers"]):
        for target in targets:
            fan_in, fan_out = shapes[target]
            module = f"base_model.model.model.layers.{layer}.{_PARENT[target]}.{target}"
            for kind, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                weight = torch.randn(shape, generator=generator) * std
                tensors[f"{module}.{kind}.weight"] = weight.to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": 2 * rank if alpha is None else alpha, "lora_dropout": 0.0,
              "target_modules": list(targets), "bias": "none", "use_rslora": False,
              "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


# ---- the runs ------------------------------------------------------------------------------

@dataclass
class Counters:
    """The LoRA manager's counters: device slot activations, host cache reads and evictions."""

    swaps: int = 0
    reads: int = 0
    evictions: int = 0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.swaps - other.swaps, self.reads - other.reads,
                        self.evictions - other.evictions)


def lora_counters(llm: LLM) -> Counters:
    from hitchllm_lora import manager_for  # only where LoRA is on

    manager = manager_for(llm.engine.config)
    return Counters(manager.slots.num_activations, manager.cache.num_reads,
                    manager.cache.num_evictions)


class RoundRobinAdapters:
    """``llm`` for ``run_hitchllm``: prompt ``i`` of each ``generate`` call runs adapter
    ``i % len(adapters)``, and each call's LoRA counters are kept (the last call is the
    timed run)."""

    def __init__(self, llm: LLM, adapters: Sequence[LoRARequest]) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.adapters = list(adapters)
        self.calls: list[Counters] = []

    def generate(self, prompts, params, use_tqdm: bool = False):
        loras = [self.adapters[i % len(self.adapters)] for i in range(len(prompts))]
        before = lora_counters(self.llm)
        outs = self.llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=loras)
        self.calls.append(lora_counters(self.llm) - before)
        return outs


@dataclass
class Variant:
    """One configuration: its name, extra engine arguments and adapters (none: no LoRA)."""

    name: str
    engine_args: dict = field(default_factory=dict)
    adapters: list[LoRARequest] = field(default_factory=list)


@dataclass
class Outcome:
    name: str
    seconds: float
    counters: Counters | None  # None without LoRA


def run_variant(model: str, variant: Variant, args: argparse.Namespace, engine_args: dict,
                progress: bool) -> tuple[Outcome, Workload]:
    """Build the engine, time the workload, delete the engine."""
    llm = LLM(model, **engine_args, **variant.engine_args)
    work = make_workload(args, llm.engine.model_config.vocab_size, llm.engine.max_model_len)
    runner = llm
    if variant.adapters:
        from hitchllm_lora import manager_for

        manager = manager_for(llm.engine.config)
        for adapter in variant.adapters:  # known (and as many as fit read) before timing
            manager.add_adapter(adapter)
        runner = RoundRobinAdapters(llm, variant.adapters)
    seconds, _ = run_hitchllm(runner, work, None, args.repeat, progress)
    counters = runner.calls[-1] if variant.adapters else None
    del runner, llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Outcome(variant.name, seconds, counters), work


HEADER = ("| config | requests | output tokens | seconds | output tok/s | vs no LoRA | "
          "adapter swaps | host reads / evictions |\n|---|---|---|---|---|---|---|---|")


def table_row(outcome: Outcome, work: Workload, baseline: Outcome) -> str:
    c = outcome.counters
    swaps = "-" if c is None else str(c.swaps)
    host = "-" if c is None else f"{c.reads} / {c.evictions}"
    return (f"| {outcome.name} | {len(work.prompts)} | {work.output_tokens} | "
            f"{outcome.seconds:.2f} | {work.output_tokens / outcome.seconds:.1f} | "
            f"{baseline.seconds / outcome.seconds:.2f} | {swaps} | {host} |")


def goal_line(baseline: Outcome, few: Outcome) -> str:
    ratio = baseline.seconds / few.seconds
    verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
    return (f"goal (issue 17): {few.name} reaches >= {GOAL_RATIO:.0%} of no LoRA: "
            f"{ratio:.0%}, {verdict}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"checkpoint (default: {DEFAULT_MODEL}, built when "
                        "missing)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[100, 1024],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-adapters", type=int, default=8,
                        help="adapters of the second configuration (max_loras as many)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(ALL_TARGETS),
                        help="comma-separated target modules of every adapter")
    parser.add_argument("--swap-adapters", type=int, default=64,
                        help="adapters of the third configuration")
    parser.add_argument("--swap-max-loras", type=int, default=16)
    parser.add_argument("--swap-max-cpu-loras", type=int,
                        help="host cache of the third configuration (default: max_loras)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed runs per configuration; the fastest counts")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int,
                        help="default: the model's, as benchmarks/throughput_gpu.sh")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--adapter-dir", type=Path,
                        help="write the adapters here (default: a temporary directory)")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    parser.add_argument("--progress", action="store_true", help="progress bars on stderr")
    args = parser.parse_args(argv)
    args.hf_num_prompts = None  # make_workload's Hugging Face subset: all prompts here
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for flag in ("num_adapters", "rank", "swap_adapters", "swap_max_loras", "repeat"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def model_path(args: argparse.Namespace) -> str:
    """``--model``, or the Qwen3-0.6B-shaped random model, built when missing."""
    if args.model:
        return args.model
    if not (DEFAULT_MODEL / "config.json").is_file():
        from build_model import build

        print(f"building {DEFAULT_MODEL} from {MODEL_CONFIG}", file=sys.stderr)
        build(MODEL_CONFIG, DEFAULT_MODEL)
    return str(DEFAULT_MODEL)


def make_adapters(root: Path, model: str, args: argparse.Namespace) -> list[LoRARequest]:
    """``max(--num-adapters, --swap-adapters)`` random adapters under ``root``."""
    model_config = json.loads((Path(model) / "config.json").read_text())
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    count = max(args.num_adapters, args.swap_adapters)
    return [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(
        root / f"adapter-{i}", model_config, args.rank, targets, seed=args.seed + i)))
        for i in range(count)]


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Run the three configurations; print (and with ``--results`` append) the table.
    Returns the table's lines."""
    args = parse_args(argv)
    model = model_path(args)
    engine_args = dict(device=args.device, dtype=args.dtype, block_size=args.block_size,
                       seed=args.seed, max_model_len=args.max_model_len,
                       enforce_eager=args.enforce_eager)
    if args.device == "cuda":
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    lora_args = dict(enable_lora=True, max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(args.adapter_dir or Path(tmp), model, args)
        variants = [
            Variant("no LoRA"),
            Variant(f"{args.num_adapters} adapters, max_loras {args.num_adapters}",
                    dict(lora_args, max_loras=args.num_adapters),
                    adapters[: args.num_adapters]),
            Variant(f"{args.swap_adapters} adapters, max_loras {args.swap_max_loras}",
                    dict(lora_args, max_loras=args.swap_max_loras,
                         max_cpu_loras=args.swap_max_cpu_loras),
                    adapters[: args.swap_adapters]),
        ]
        results = []
        for variant in variants:
            results.append(run_variant(model, variant, args, engine_args, args.progress))
            print(f"{variant.name}: {results[-1][0].seconds:.2f} s", file=sys.stderr)
    baseline = results[0][0]
    lines = [HEADER, *(table_row(outcome, work, baseline) for outcome, work in results), "",
             goal_line(baseline, results[1][0])]
    print("\n".join(lines))
    if args.results:
        note = (f"({Path(model).name}, {args.dtype}, rank {args.rank} on {args.targets}, "
                f"device {args.device}{', eager' if args.enforce_eager else ''})")
        command = "python benchmarks/lora_throughput.py " + " ".join(
            shlex.quote(a) for a in _without_bookkeeping(args.argv))
        append_results(args.results, [*entry_heading("Multi-LoRA throughput", command.strip(),
                                                     note), *lines], SECTION, ABOUT)
    return lines


def _without_bookkeeping(argv: list[str]) -> list[str]:
    """The command line, ``--results`` and ``--adapter-dir`` left out, the model as MODEL."""
    words, i = [], 0
    while i < len(argv):
        if argv[i] in ("--results", "--adapter-dir"):
            i += 2
            continue
        words.append("MODEL" if i > 0 and argv[i - 1] == "--model" else argv[i])
        i += 1
    return words


if __name__ == "__main__":
    main()
