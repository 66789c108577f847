"""Start-up checks of a draft model checkpoint against the target (it must exist, share the
target's vocabulary, and reach the engine's ``max_model_len``), and a writer of drafts cut
from the target's own first layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hitchllm.config import EngineConfig, ModelConfig


def read_draft_config(engine_config: EngineConfig, max_model_len: int) -> ModelConfig:
    """The draft checkpoint's config, or ``ValueError`` saying what to change."""
    path = engine_config.speculative_model
    if not path:
        raise ValueError(
            "speculative_method='draft_model' needs speculative_model (--speculative-model): "
            "the checkpoint directory of a smaller model with the target's tokenizer")
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"speculative_model={path!r} is not a checkpoint directory (no config.json); give "
            "the directory of a Hugging Face checkpoint")
    draft = ModelConfig.from_pretrained(path)
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_model {path} handles {draft.max_position_embeddings} positions, fewer "
            f"than max_model_len={max_model_len}; lower max_model_len to at most "
            f"{draft.max_position_embeddings} or use a draft model with a longer context")
    return draft


def check_same_vocabulary(engine_config: EngineConfig, target: ModelConfig,
                          draft: ModelConfig) -> None:
    """``ValueError`` unless the draft's tokens mean what the target's mean: equal tokenizer
    vocabularies when both checkpoints have a tokenizer (the embedding sizes may then differ
    by padding), else equal ``vocab_size``."""
    target_path = engine_config.tokenizer or engine_config.model
    target_vocab = _tokenizer_vocabulary(target_path)
    draft_vocab = _tokenizer_vocabulary(str(draft.path))
    if target_vocab is not None and draft_vocab is not None:
        if target_vocab == draft_vocab:
            return
        differing = sum(draft_vocab.get(token) != i for token, i in target_vocab.items())
        raise ValueError(
            f"speculative_model {draft.path} has a different vocabulary from the target "
            f"{target_path}: its tokenizer has {len(draft_vocab)} tokens, the target's "
            f"{len(target_vocab)}, and {differing} of the target's tokens have another id "
            "in it; a draft model must use the target's tokenizer (pick one of the same "
            "model family)")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"speculative_model {draft.path} has vocab_size {draft.vocab_size} but the target "
            f"{engine_config.model} has {target.vocab_size}; a draft model must use the "
            "target's vocabulary (pick one of the same model family)")


def _tokenizer_vocabulary(path: str) -> dict[str, int] | None:
    """Token -> id of the tokenizer saved at ``path`` (None when there is none)."""
    if not any((Path(path) / name).is_file()
               for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                            "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(path).get_vocab())


def write_truncated_checkpoint(source: str | Path, destination: str | Path,
                               num_layers: int) -> Path:
    """Write a draft made of ``source``'s first ``num_layers`` decoder layers (with its
    embedding, final norm and LM head; tokenizer files copied) to ``destination``.

    Such a draft shares the target's vocabulary and often agrees with it, which makes it a
    draft "of another size" for tests and benchmarks where no smaller trained model of the
    family exists. Weights are read with the core's ``iterate_weights`` (any shard layout)
    and written as one ``model.safetensors``.
    """
    from hitchllm.models.loader import iterate_weights

    config = json.loads((Path(source) / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers={num_layers} is not in 1..{config['num_hidden_layers']}")
    kept = {name: tensor.contiguous() for name, tensor in iterate_weights(Path(source))
            if _layer_index(name) is None or _layer_index(name) < num_layers}
    return _write_derived(source, destination, num_layers, kept)


def write_deepened_checkpoint(source: str | Path, destination: str | Path,
                              num_layers: int, seed: int = 0) -> Path:
    """Write ``source`` grown to ``num_layers`` decoder layers that compute the same function:
    each added layer has random query/key/value and gate/up projections (the work of a real
    layer) but zero output and down projections, so it adds nothing to the residual stream.

    The pair (``source`` drafting for its deepened copy) stands for a target that costs more
    per step than its draft while agreeing with it, the situation speculative decoding is
    for, where no larger trained model of the family exists.
    """
    import torch

    from hitchllm.models.loader import iterate_weights

    config = json.loads((Path(source) / "config.json").read_text())
    have = config["num_hidden_layers"]
    if num_layers < have:
        raise ValueError(f"num_layers={num_layers} is below the checkpoint's {have} layers")
    weights = {name: tensor.contiguous() for name, tensor in iterate_weights(Path(source))}
    generator = torch.Generator().manual_seed(seed)
    template = {name.split(".layers.0.", 1)[1]: tensor for name, tensor in weights.items()
                if _layer_index(name) == 0}
    prefix = next(name.split(".layers.0.", 1)[0] for name in weights if _layer_index(name) == 0)
    for layer in range(have, num_layers):
        for suffix, like in template.items():
            if "o_proj" in suffix or "down_proj" in suffix or suffix.endswith("bias"):
                tensor = torch.zeros_like(like)
            elif "norm" in suffix:
                tensor = torch.ones_like(like)
            else:
                tensor = (torch.randn(like.shape, generator=generator) * 0.02).to(like.dtype)
            weights[f"{prefix}.layers.{layer}.{suffix}"] = tensor
    return _write_derived(source, destination, num_layers, weights)


def _write_derived(source: str | Path, destination: str | Path, num_layers: int,
                   weights: dict) -> Path:
    """``source``'s files (tokenizer, generation config) and config with ``num_layers``
    layers, and ``weights`` as one ``model.safetensors``, in ``destination``."""
    from safetensors.torch import save_file

    from hitchllm.models.loader import weight_files

    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    skipped = set(weight_files(source)) | {source / "config.json"}
    for file in source.iterdir():
        if file.is_file() and file not in skipped and not file.name.endswith(".index.json"):
            shutil.copy(file, destination / file.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(destination / "model.safetensors"))
    return destination


def _layer_index(name: str) -> int | None:
    """The decoder layer a weight belongs to (``model.layers.3.mlp...`` -> 3), or None."""
    _, found, rest = name.partition(".layers.")
    return int(rest.split(".", 1)[0]) if found and rest.split(".", 1)[0].isdigit() else None
