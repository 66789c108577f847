"""hitchllm: an LLM inference and serving engine, a small core plus installable plugins.

``from hitchllm import LLM, SamplingParams, LoRARequest, hookimpl``; ``LLM()`` with no model
loads the bundled default model (``default_model_path()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hitchllm.bundled_model import default_model_path
from hitchllm.lora import LoRARequest
from hitchllm.outputs import CompletionOutput, Logprob, RequestOutput
from hitchllm.plugins import hookimpl
from hitchllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from hitchllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from hitchllm.config import EngineConfig
    from hitchllm.engine.llm_engine import LLMEngine
    from hitchllm.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
    "default_model_path",
    "hookimpl",
]

_LAZY = {
    "BeamSearchOutput": "hitchllm.beam_search",
    "BeamSearchParams": "hitchllm.beam_search",
    "BeamSearchSequence": "hitchllm.beam_search",
    "LLM": "hitchllm.entrypoints.llm",
    "LLMEngine": "hitchllm.engine.llm_engine",
    "EngineConfig": "hitchllm.config",
}


def __getattr__(name: str) -> Any:
    # The engine pulls in transformers; plugins importing ``hookimpl`` should not pay for it
    # (nor a worker process, which imports the model runner, for the scheduler's side).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hitchllm' has no attribute {name!r}")
