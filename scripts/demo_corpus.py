"""The demo model's corpus and tokenizer: the Python standard library's sources, split into
train and held-out by file, and a byte-level BPE trained on the train files."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, "<|im_start|>", "<|im_end|>"]
# Pre-tokens: a word, number or punctuation run with at most one trailing space, a newline, or
# a run of other whitespace (indentation). Unlike GPT-2's leading-space pieces, a prompt that
# ends after a space, a newline or an indent ("def ", "):\n    ") ends on a token boundary the
# model saw in training, so its continuation is not conditioned on a never-seen split.
PRE_TOKEN_PATTERN = r"[\p{L}_][\p{L}\p{N}_]* ?|\p{N}{1,3} ?|[^\s\p{L}\p{N}_]+ ?|\n|[^\S\n]+"


@dataclass
class Corpus:
    """The standard library's sources, split by file."""

    root: Path
    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]


def is_held_out(relpath: str, percent: float) -> bool:
    """Stable per-file split: the same path is held out on every machine and Python version."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 10000 < percent * 100


def load_corpus(root: Path, held_out_percent: float, file_fraction: float) -> Corpus:
    """Every decodable ``*.py`` under the stdlib directory ``root``, sorted by path;
    ``file_fraction`` < 1 keeps an evenly spaced subset (for smoke runs)."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if {"site-packages", "dist-packages"} & set(rel.split("/")):
            continue
        try:
            docs.append((rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if file_fraction < 1.0:
        step = round(1 / file_fraction)
        docs = docs[::step]
    train = [d for d in docs if not is_held_out(d[0], held_out_percent)]
    held_out = [d for d in docs if is_held_out(d[0], held_out_percent)]
    return Corpus(root, train, held_out)


def num_bytes(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over ``PRE_TOKEN_PATTERN`` pieces whose encodings start with
    ``<|endoftext|>`` (BOS and document separator)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", special_tokens=[(EOT, tok.token_to_id(EOT))]
    )
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """The documents' encodings (each ``<|endoftext|>`` + text) concatenated, int64."""
    ids = [i for enc in tok.encode_batch(texts) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int64)
