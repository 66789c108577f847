"""The default model bundled with the package: a small Llama trained on Python source code.

``default_model_path()`` is what ``LLM()`` and the CLI load when no model is named. The
checkpoint (config.json, model.safetensors in bfloat16, tokenizer files with a chat template)
and its model card, README.md, sit in ``hitchllm/default_model/``; scripts/train_demo_model.py
reproduces it.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# The name ``hitchllm serve`` gives the bundled model (besides its path) when none is named.
DEFAULT_SERVED_MODEL_NAME = "hitchllm-default"


def default_model_path() -> str:
    """Directory of the bundled default model, a Hugging Face checkpoint (see its README.md)."""
    return str(DEFAULT_MODEL_DIR)
