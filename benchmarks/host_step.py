"""Host time of one decode step, by phase, at several batch sizes, with a model whose forward
is nearly free (a 1-layer Llama of hidden 64, built here), so what is measured is the engine's
own Python: scheduling, input preparation, sampling metadata, the sampled tokens folded back
into requests, and outputs.

Each batch size runs in one engine on the CPU with one torch thread and without overlapped
steps (``async_scheduling=False``: every phase runs on the engine's thread, one after the
other, and the phases add up to the step). ``--batch-size`` requests of ``--prompt-len``
random tokens, greedy, ``ignore_eos``, outputs longer than the run: after they are all
decoding (with outputs only at the end, as ``LLM.generate``; ``--stream``: every step, as the
server), ``--steps`` steps are timed, every phase with ``time.thread_time`` (the engine
thread's CPU time, which another process taking the core does not inflate) around the engine's
own methods, ``--rounds`` times; the fastest round is reported (the machine may be shared).
Then ``--steps`` more steps run under cProfile for the Python function calls per step (which
the machine's load does not change); ``--cprofile N`` prints the N functions with the most
own time there at the largest batch. ``--generate N`` also times ``LLM.generate`` of each
batch (N output tokens per request) with the engine's defaults, overlapped steps included.
``--results`` appends the tables to a Markdown file.

    python benchmarks/host_step.py --batch-size 32 128 256 --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hitchllm import LLM, SamplingParams
from hitchllm.engine import model_runner
from hitchllm.tiny_model import build_tiny_checkpoint

try:
    from results_md import append_results, entry_heading
except ImportError:  # run from another directory
    from benchmarks.results_md import append_results, entry_heading

# Phases in step order; "other" is the step's time outside them (the engine's glue).
PHASES = ("schedule", "prepare inputs", "forward", "sampling metadata", "logits + sample",
          "update requests", "outputs", "other")


class PhaseClock:
    """Accumulates the thread's CPU time per phase; phases may nest (the outer one is charged
    only its own time)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []

    def wrap(self, obj: object, attr: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [phase, 0.0]
            self._stack.append(frame)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.thread_time() - start
                self._stack.pop()
                self.total[phase] += elapsed - frame[1]
                if self._stack:
                    self._stack[-1][1] += elapsed

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.total.clear()


def instrument(llm: LLM, clock: PhaseClock) -> None:
    engine = llm.engine
    runner = engine.executor.runner
    clock.wrap(engine, "step", "other")
    clock.wrap(engine, "_schedule", "schedule")
    # The runner's launch less what is charged below is input preparation (request states,
    # token ids, block tables, positions, slots, attention metadata).
    clock.wrap(runner, "execute_async", "prepare inputs")
    clock.wrap(runner, "_eager_forward", "forward")
    clock.wrap(runner, "_sample_step", "logits + sample")
    clock.wrap(model_runner, "build_sampling_metadata", "sampling metadata")
    # Reading the sampled tokens back, appending them to the runner's and the scheduler's
    # requests, stop checks.
    clock.wrap(engine, "_fold", "update requests")
    clock.wrap(engine.output_processor, "process", "outputs")


def build_model(directory: Path, vocab_size: int) -> Path:
    return build_tiny_checkpoint(directory / "llama-1x64", "LlamaForCausalLM",
                                 num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=4096, vocab_size=vocab_size)


def fill(llm: LLM, batch: int, prompt_len: int, seed: int, stream: bool) -> None:
    """Queue ``batch`` requests and step until every one of them is decoding. Without
    ``stream`` a request has an output only when it finishes (as ``LLM.generate``); with it,
    one per step (as the server streams)."""
    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(vocab)
                                                 for _ in range(prompt_len)]}, params,
                           final_only=not stream)
    while engine.scheduler.waiting or any(
            r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()


def measure(model: Path, batch: int, args: argparse.Namespace,
            profile: cProfile.Profile) -> tuple[dict[str, float], float]:
    """Per-phase ms per step and the step's ms, of the fastest round; ``profile`` then sees
    ``--steps`` more steps (after the timed rounds: the profiler slows what it sees)."""
    llm = LLM(str(model), device="cpu", cpu_threads=1, async_scheduling=False,
              max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * args.prompt_len),
              seed=args.seed)
    try:
        fill(llm, batch, args.prompt_len, args.seed, args.stream)
        clock = PhaseClock()
        instrument(llm, clock)
        for _ in range(5):
            llm.engine.step()
        rounds = []
        for _ in range(args.rounds):
            clock.reset()
            for _ in range(args.steps):
                llm.engine.step()
            rounds.append({p: clock.total[p] / args.steps * 1e3 for p in PHASES})
        profile.enable()
        for _ in range(args.steps):
            llm.engine.step()
        profile.disable()
        fastest = min(rounds, key=lambda r: sum(r.values()))
        return fastest, sum(fastest.values())
    finally:
        llm.close()


def generate_tok_s(model: Path, batch: int, args: argparse.Namespace) -> tuple[float, float]:
    """Output tok/s and process CPU seconds of ``LLM.generate`` over the batch with the
    engine's defaults (async scheduling: on the CPU the model runs on a thread of its own)."""
    llm = LLM(str(model), device="cpu", max_num_seqs=batch, seed=args.seed)
    try:
        rng = random.Random(args.seed)
        vocab = llm.engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}
                   for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.generate, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return sum(len(o.outputs[0].token_ids) for o in outs) / wall, cpu
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true",
                        help="an output per request and step (as the server), not only at the "
                             "end (as LLM.generate)")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="also time LLM.generate of each batch, N output tokens per "
                             "request, with the engine's defaults (overlapped steps)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--label", default="", help="a note for the results entry")
    parser.add_argument("--results", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab_size)
        for batch in args.batch_size:
            profile = cProfile.Profile()
            phases, step_ms = measure(model, batch, args, profile)
            stats = pstats.Stats(profile)
            # Python function calls per step: the machine's load does not change them.
            rows.append((batch, phases, step_ms, stats.total_calls / args.steps))
            if args.cprofile and batch == max(args.batch_size):
                print(f"\ncProfile, batch {batch}, {args.steps} steps:")
                stats.sort_stats("tottime").print_stats(args.cprofile)

    lines = ["| batch | step ms | " + " | ".join(PHASES) + " | host ms (all but forward) "
             "| host us per request | Python calls per step |",
             "|---" * (len(PHASES) + 5) + "|"]
    for batch, phases, step_ms, calls in rows:
        host = step_ms - phases["forward"]
        lines.append(f"| {batch} | {step_ms:.3f} | "
                     + " | ".join(f"{phases[p]:.3f}" for p in PHASES)
                     + f" | {host:.3f} | {host / batch * 1e3:.1f} | {calls:,.0f} |")
    if args.generate:
        lines += ["", f"`LLM.generate`, {args.generate} output tokens per request, engine "
                  "defaults (async scheduling, model on its own thread):", "",
                  "| batch | output tok/s | process CPU s |", "|---|---|---|"]
        with tempfile.TemporaryDirectory() as tmp:
            model = build_model(Path(tmp), args.vocab_size)
            for batch in args.batch_size:
                tok_s, cpu = generate_tok_s(model, batch, args)
                lines.append(f"| {batch} | {tok_s:,.0f} | {cpu:.2f} |")
    print("\n" + "\n".join(lines))
    if args.results:
        command = ("python benchmarks/host_step.py --batch-size "
                   + " ".join(map(str, args.batch_size))
                   + f" --steps {args.steps} --rounds {args.rounds}"
                   + (" --stream" if args.stream else "")
                   + (f" --generate {args.generate}" if args.generate else ""))
        note = (f"1-layer Llama, hidden 64, vocab {args.vocab_size}, CPU, 1 torch thread, "
                "no overlap; CPU ms of the engine thread per decode step, fastest round. "
                + args.label)
        append_results(args.results,
                       entry_heading("Host time per decode step", command, note) + lines,
                       section="## Host time per step (benchmarks/host_step.py)",
                       about="Engine host time per decode step by phase, with a model whose "
                             "forward is nearly free (issue 21 point 2, issue 22 point 5).")


if __name__ == "__main__":
    main()
