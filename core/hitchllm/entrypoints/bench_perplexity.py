"""``hitchllm bench perplexity``: a model's loss on text files, scored through the engine.

Each file is one document, encoded by the model's tokenizer with its special tokens (a BOS,
when the tokenizer adds one) and concatenated in the order given, as causal-LM training packs
documents. The token stream is cut into windows of ``--max-len`` tokens that overlap by one
token, so every token but the first is scored exactly once, given the tokens before it in its
window. Each window is one prompt asking for ``prompt_logprobs``: the engine's log-softmax of
the logits that predict each prompt token. Reported: tokens scored, UTF-8 bytes of the files,
loss (mean nats per token), perplexity (``exp(loss)``) and bits per byte (summed nats / ln 2 /
bytes, comparable across tokenizers).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hitchllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    """Summed negative log-likelihood over the scored tokens of a text."""

    tokens: int
    bytes: int
    nats: float

    @property
    def loss(self) -> float:
        """Mean nats per scored token."""
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", type=Path, nargs="+", required=True, metavar="FILE",
                        help="text files, each one document, scored in the order given")
    parser.add_argument("--max-len", type=int,
                        help="tokens per window (default: max_model_len, the longest prompt)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction,
                        help="a progress bar on stderr (default: when stderr is a terminal)")


def token_windows(stream: list[int], max_len: int) -> list[list[int]]:
    """Windows of ``max_len`` tokens overlapping by one: together they score each token of
    ``stream`` after the first exactly once (the last window may be shorter)."""
    if max_len < 2:
        raise ValueError(f"--max-len must be at least 2 (one token of context), got {max_len}")
    return [stream[s : s + max_len] for s in range(0, max(1, len(stream) - 1), max_len - 1)]


def score_windows(llm, windows: list[list[int]], progress: bool = False) -> tuple[float, int]:
    """Summed nats and number of scored tokens, from the engine's prompt logprobs."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params,
                           use_tqdm=progress)
    nats, count = 0.0, 0
    for window, out in zip(windows, outputs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            nats -= entry[token].logprob
            count += 1
    return nats, count


def measure(llm, texts: list[str], max_len: int, progress: bool = False) -> PerplexityResult:
    """Score ``texts`` (one document each) in windows of ``max_len`` tokens."""
    tokenizer = llm.get_tokenizer()
    stream = [t for text in texts for t in tokenizer(text, verbose=False).input_ids]
    if len(stream) < 2:
        raise ValueError("the text has fewer than two tokens; nothing to score")
    nats, count = score_windows(llm, token_windows(stream, max_len), progress)
    return PerplexityResult(count, sum(len(t.encode("utf-8")) for t in texts), nats)


def read_text(path: Path) -> str:
    """A ``--text`` file's contents; a missing or non-UTF-8 file is a one-line ValueError."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--text {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from hitchllm.entrypoints.llm import LLM

    texts = [read_text(path) for path in args.text]
    llm = LLM(args.model, **engine_kwargs)
    limit = llm.engine.max_model_len
    max_len = args.max_len or limit
    if max_len > limit:
        raise ValueError(f"--max-len {max_len} exceeds max_model_len={limit}; lower it")
    start = time.perf_counter()
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    r = measure(llm, texts, max_len, progress)
    seconds = time.perf_counter() - start
    print(f"| files | tokens | bytes | loss (nats/token) | perplexity | bits/byte | seconds |\n"
          f"|---|---|---|---|---|---|---|\n"
          f"| {len(texts)} | {r.tokens} | {r.bytes} | {r.loss:.4f} | {r.perplexity:.3f} | "
          f"{r.bits_per_byte:.4f} | {seconds:.1f} |")
    print(f"loss={r.loss:.4f}")
    return 0
