"""vLLM engine arguments hitchllm does not implement yet, refused by name.

A vLLM script or command line that passes one of these with the value that asks for nothing
(``data_parallel_size=1``) runs unchanged; any other value is an error that names the
argument, never silently ignored. Kept free of torch so the CLI can build its parser before
torch loads.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

_NEVER = object()  # the no-op value of an argument that no value makes harmless

# name -> (the value that asks for nothing, accepted and ignored; what to do instead). A name
# that becomes an EngineConfig field is left to the field.
VLLM_ARGS_NOT_SUPPORTED: dict[str, tuple[Any, str]] = {
    "data_parallel_size": (1, "serve replicas with `hitchllm serve --data-parallel-size N`"),
    "enable_expert_parallel": (False, ""),
    "trust_remote_code": (False, "it runs only its own model classes"),
    "cpu_offload_gb": (0.0, ""),
    "enable_chunked_prefill": (True, "prompts are always chunked"),
    "speculative_config": (None, "use speculative_method and num_speculative_tokens"),
    "tokenizer_mode": ("auto", ""),
    "load_format": ("auto", "it loads *.safetensors"),
    "revision": (None, "it does not download; pass a local checkpoint directory"),
    "download_dir": (None, "it does not download; pass a local checkpoint directory"),
}


def pop_unsupported_vllm_args(data: dict[str, Any], fields: Container[str]) -> list[str]:
    """Pop the vLLM-only arguments from ``data``; a line for each one that asks for
    something (a no-op value is dropped silently)."""
    lines = []
    for name, (no_op, hint) in VLLM_ARGS_NOT_SUPPORTED.items():
        if name not in data or name in fields:
            continue
        value = data.pop(name)
        if no_op is not _NEVER and value == no_op:
            continue
        accepted = "" if no_op is _NEVER else f" (only {name}={no_op!r} is accepted)"
        lines.append(
            f"{name} is not supported yet by hitchllm{accepted}" + (f"; {hint}" if hint else "")
        )
    return lines
