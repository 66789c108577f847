"""Train an EAGLE draft head for a hitchllm target model (by default the bundled model).

    python scripts/train_eagle_head.py --out DIR [--model PATH] [--minutes 6] [--threads 2]

Data is the bundled model's own corpus (``scripts/demo_corpus.py``): the ``*.py`` files of the
running interpreter's standard library, or of ``--stdlib DIR``, split into train and held-out
by the same stable hash of their relative path (so held-out files stay unseen by the target and
the head). The train files are tokenized with the target's tokenizer into one stream;
``--windows`` windows of ``--seq-len`` tokens are cut from it at random and the target (through
Hugging Face transformers, the reference implementation, in float32) computes its final hidden
states ``h`` (the LM head's input) once, up front. ``--held-out-windows`` windows of the
held-out files are prepared the same way for evaluation.

The head (``hitchllm_specdec.eagle_head.EagleHead``, the very module the proposer runs; the
target's embedding and LM head are shared and frozen) reads ``(token[t+1], h[t])`` for every
position ``t`` of a window with causal attention over the window and is trained with AdamW
(warmup, cosine decay) on two losses, as EAGLE does: cross-entropy of the target's LM head on
its output ``g[t]`` against the target's own distribution at ``t+1`` (what it would sample
next: acceptance rewards agreeing with the target, not with the corpus), plus
``--feature-weight`` times a smooth L1 regression of ``g[t]`` on ``h[t+1]`` (the draft loop
feeds ``g`` back in place of ``h``).
A ``--short-context`` fraction of the windows hide from each position the keys before a random
start: the proposer's head has no entries for prompt positions, so at drafting time its context
starts where decoding started. ``--feature-noise`` adds uniform noise to the input ``h``
(robustness to the head's own, less exact features at later draft steps). Training stops after
``--steps`` steps or ``--minutes`` minutes, whichever comes first.

The script prints and records on the held-out windows how often the first draft is the
target's argmax (the greedy acceptance of a first draft, with teacher-forced context), and
writes DIR: config.json,
model.safetensors (bfloat16 unless ``--dtype float32``) and train_run.json (command, settings,
results). Serve it with ``speculative_method="eagle", speculative_model=DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from demo_corpus import load_corpus, token_stream
from hitchllm_specdec.eagle_head import (
    CausalSequences,
    EagleHead,
    head_config_json,
    read_head_config,
)
from safetensors.torch import save_file

from hitchllm.bundled_model import default_model_path
from hitchllm.config import ModelConfig


@dataclass(frozen=True)
class HeadTrainConfig:
    seq_len: int = 256
    windows: int = 768
    held_out_windows: int = 48
    batch_size: int = 16
    steps: int = 3000
    minutes: float = 6.0
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.0
    feature_weight: float = 1.0
    feature_noise: float = 0.0
    short_context: float = 0.5
    intermediate_size: int = 0  # 0: the target's
    held_out_percent: float = 5.0
    seed: int = 0


class Features:
    """Windows of token ids and the target's final hidden states at every position."""

    def __init__(self, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        self.ids, self.hidden = ids, hidden

    @classmethod
    def compute(cls, target, stream: torch.Tensor, count: int, seq_len: int,
                gen: torch.Generator) -> Features:
        starts = torch.randint(0, len(stream) - seq_len, (count,), generator=gen)
        ids = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
        hidden = torch.empty(count, seq_len, target.config.hidden_size)
        with torch.no_grad():
            for i in range(0, count, 32):
                hidden[i : i + 32] = target.model(ids[i : i + 32]).last_hidden_state
        return cls(ids, hidden)


def head_outputs(head: EagleHead, ids: torch.Tensor, hidden: torch.Tensor, noise: float,
                 first_visible: torch.Tensor | None) -> torch.Tensor:
    """``g[t]`` for t = 0 .. T-3 of each window: the head's guess of ``h[t+1]``."""
    batch, length = ids.shape
    inputs = hidden[:, : length - 2]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    positions = torch.arange(length - 2).repeat(batch)
    out = head(ids[:, 1 : length - 1].reshape(-1), inputs.reshape(-1, inputs.shape[-1]),
               positions, CausalSequences(batch, first_visible))
    return out.view(batch, length - 2, -1)


def losses(head: EagleHead, lm_head: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
           noise: float = 0.0, first_visible: torch.Tensor | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-entropy against the target's own next-token distribution, smooth L1 on
    features, how often the head's argmax is the target's) over every position. Distilling
    the target, not the corpus, is what acceptance rewards: a draft is accepted when the
    target would have produced it."""
    g = head_outputs(head, ids, hidden, noise, first_visible)
    logits = g @ lm_head.T
    with torch.no_grad():
        target_logits = hidden[:, 1:-1] @ lm_head.T
    ce = F.cross_entropy(logits.flatten(0, 1), target_logits.flatten(0, 1).softmax(-1))
    reg = F.smooth_l1_loss(g, hidden[:, 1:-1])
    hits = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return ce, reg, hits


def learning_rate(step: int, cfg: HeadTrainConfig, total: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(head: EagleHead, lm_head: torch.Tensor, data: Features) -> dict[str, float]:
    """Held-out losses and ``draft_is_target_argmax``: how often the first draft would be
    accepted by a greedy target (teacher-forced context); ``..._from_midpoint``: the same when
    the head sees nothing before the middle of the window, as when decoding starts there."""
    with torch.no_grad():
        ce, reg, hits = losses(head, lm_head, data.ids, data.hidden)
        middle = torch.full((len(data.ids),), data.ids.shape[1] // 2)
        short_hits = losses(head, lm_head, data.ids, data.hidden, 0.0, middle)[2]
    return {"cross_entropy": round(float(ce), 4), "feature_l1": round(float(reg), 5),
            "draft_is_target_argmax": round(float(hits), 4),
            "draft_is_target_argmax_from_midpoint": round(float(short_hits), 4)}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, HeadTrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="head directory to write")
    parser.add_argument("--model", default=default_model_path(), help="target checkpoint")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="precision of the saved weights")
    defaults = HeadTrainConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = HeadTrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    import transformers
    from tokenizers import Tokenizer

    args, cfg = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    began = time.perf_counter()

    target_config = ModelConfig.from_pretrained(args.model)
    target = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    corpus = load_corpus(args.stdlib, cfg.held_out_percent, 1.0)
    train = Features.compute(target, token_stream(tok, [t for _, t in corpus.train]),
                             cfg.windows, cfg.seq_len, gen)
    held_out = Features.compute(target, token_stream(tok, [t for _, t in corpus.held_out]),
                                cfg.held_out_windows, cfg.seq_len, gen)
    print(f"target hidden states: {cfg.windows} train and {cfg.held_out_windows} held-out "
          f"windows of {cfg.seq_len} tokens ({time.perf_counter() - began:.0f}s)", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    head_json = head_config_json(target_config, cfg.intermediate_size or None)
    (args.out / "config.json").write_text(json.dumps(head_json, indent=2) + "\n")
    embedding = target.get_input_embeddings().weight.detach()
    head = EagleHead(read_head_config(args.out), embed=lambda ids: F.embedding(ids, embedding))
    for param in head.parameters():
        if param.dim() == 2:
            torch.nn.init.normal_(param, std=0.02)
        param.requires_grad_(True)
    lm_head = target.get_output_embeddings().weight.detach()
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    train_began = time.perf_counter()
    step = 0
    while step < cfg.steps and time.perf_counter() - train_began < cfg.minutes * 60:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg, cfg.steps)
        rows = torch.randint(0, cfg.windows, (cfg.batch_size,), generator=gen)
        # Some windows see only what follows a random start (see CausalSequences).
        first_visible = torch.randint(0, cfg.seq_len - 2, (cfg.batch_size,), generator=gen)
        first_visible *= torch.rand(cfg.batch_size, generator=gen) < cfg.short_context
        ce, reg, hits = losses(head, lm_head, train.ids[rows], train.hidden[rows],
                               cfg.feature_noise, first_visible)
        loss = ce + cfg.feature_weight * reg
        ce, reg, hits = ce.detach(), reg.detach(), hits.detach()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 100 == 0:
            elapsed = time.perf_counter() - train_began
            print(f"step {step}: cross-entropy {float(ce):.3f}, feature L1 {float(reg):.4f}, "
                  f"draft is target argmax {float(hits):.3f} ({elapsed:.0f}s)", flush=True)
    head.eval()
    results = evaluate(head, lm_head, held_out)
    print(f"held-out after {step} steps: {results}", flush=True)

    dtype = getattr(torch, args.dtype)
    save_file({k: v.to(dtype) for k, v in head.checkpoint_tensors().items()},
              args.out / "model.safetensors")
    run = {
        "command": shlex.join(["python", "scripts/train_eagle_head.py", *(argv or sys.argv[1:])]),
        "target": str(args.model),
        "stdlib": str(args.stdlib),
        "config": asdict(cfg),
        "steps_run": step,
        "train_seconds": round(time.perf_counter() - train_began, 1),
        "total_seconds": round(time.perf_counter() - began, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "held_out": results,
        "safetensors_bytes": (args.out / "model.safetensors").stat().st_size,
    }
    (args.out / "train_run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"wrote {args.out} ({run['safetensors_bytes']:,} bytes of weights)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
