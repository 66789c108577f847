"""Typed configuration: the user-facing ``EngineConfig`` (pydantic, validated once at the
edge) and ``ModelConfig``, what the engine reads from a checkpoint's ``config.json``."""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from hitchllm.bundled_model import default_model_path
from hitchllm.kv_transfer.config import KVTransferConfig
from hitchllm.unsupported_args import pop_unsupported_vllm_args

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# kv_cache_dtype names (vLLM's) -> the fp8 format the cache stores; "fp8" means e4m3.
_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
_SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3,
               "mb": 10**6, "gb": 10**9}

# The most of the machine's memory the host pools of swap preemption may take together.
MAX_SWAP_SHARE = 0.7


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or a torch dtype) to a torch dtype, with an error listing valid names."""
    if isinstance(name, torch.dtype):
        return name
    key = name.lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of float32, float16, bfloat16, auto")
    return _DTYPES[key]


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """A ``kv_cache_dtype`` name to the dtype the cache stores (``auto``: ``model_dtype``)."""
    if name == "auto":
        return model_dtype
    if name not in _KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; use auto, fp8, fp8_e4m3 or fp8_e5m2")
    return _KV_CACHE_DTYPES[name]


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"4GiB"`` or ``"512 MiB"``."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {value!r}; write e.g. 2GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


class EngineConfigError(ValueError):
    """Invalid engine arguments: one line per problem, each naming its field."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def _error_line(error: Any, fields: Any) -> str:
    """One pydantic error as ``field: problem (got value)``, without pydantic's URLs."""
    loc = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc, list(fields), n=1)
        return f"{loc}: unknown engine argument" + (f"; did you mean {close[0]}?" if close else "")
    message = error["msg"].removeprefix("Value error, ")
    if not loc:
        return message
    if error["type"] == "value_error":  # our own validators already quote the value
        return f"{loc}: {message}"
    got = repr(error["input"])
    return f"{loc}: {message} (got {got[:60] + '...' if len(got) > 60 else got})"


class EngineConfig(BaseModel):
    """Everything that configures one engine. Field names follow vLLM's engine arguments.

    Invalid arguments raise ``EngineConfigError`` (a ``ValueError``) with one line per problem;
    common vLLM arguments hitchllm does not implement yet are refused by name.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        fields = type(self).model_fields
        lines = pop_unsupported_vllm_args(data, fields)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            lines += [_error_line(e, fields) for e in exc.errors()]
        if lines:
            raise EngineConfigError(lines)

    # A checkpoint directory; default: the small code model bundled with the package.
    model: str = Field(default_factory=default_model_path)
    tokenizer: str | None = None
    dtype: str = "auto"
    # auto: the model's dtype; fp8 / fp8_e4m3 / fp8_e5m2: fp8 with per-layer scales (half
    # the bytes of bfloat16), served by backends that accept it; needs the
    # hitchllm-quantization plugin, which settles the scales.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # fp8 KV cache: compute each layer's k_scale / v_scale from the first step that serves
    # prompts (its K/V maximum over the fp8 format's), instead of the checkpoint's or 1.0.
    calculate_kv_scales: bool = False
    # Default from HITCHLLM_DEVICE when set (handy to pin a test run), else "auto".
    device: str = Field(default_factory=lambda: os.environ.get("HITCHLLM_DEVICE", "auto"))
    attention_backend: str | None = None
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    # fcfs: arrival order; priority: lowest ``priority`` value first (vLLM's convention).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # What a request preempted for want of KV blocks gives up: recompute (its blocks are
    # freed, its tokens computed again), swap (its blocks are copied to a host pool of
    # swap_space GiB and back; recomputed when the pool is full), auto (swap when that is
    # estimated faster than recomputing; docs/preemption.md).
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    # GiB of host memory (pinned on CUDA, there rounded down to a power of two) per worker
    # for swapped-out KV blocks; allocated only when preemption_mode is swap or auto.
    swap_space: float = Field(4.0, ge=0)
    seed: int = 0
    # A method from a quantization plugin; default: the checkpoint's quant_method, if any.
    quantization: str | None = None
    # A proposer from a speculative-decoding plugin, and how many draft tokens per step.
    speculative_method: str | None = None
    num_speculative_tokens: int = Field(0, ge=0, le=64)
    # The proposer's checkpoint directory (a draft model, an EAGLE head), for methods that
    # need one.
    speculative_model: str | None = None
    # n-gram (prompt lookup) proposers: the shortest and longest suffix of the context matched
    # against earlier context.
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    # LoRA adapters (served by the hitchllm-lora plugin): requests may name one with
    # ``lora_request``. ``max_loras`` adapters are active in device memory at once (requests
    # of others wait), of rank up to ``max_lora_rank``; ``max_cpu_loras`` (default:
    # ``max_loras``) stay loaded in host memory, least recently used evicted first.
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)
    # CUDA: run every step eagerly instead of replaying captured CUDA graphs for decode.
    enforce_eager: bool = False
    # CUDA: run the model's elementwise ops (norms, residual adds, rotary, activation) as fused
    # Triton kernels (hitchllm.models.fused; applies to every engine in the process).
    enable_fusion: bool = True
    # Schedule and prepare step n+1 while the device runs step n (ignored with speculative
    # decoding, which needs each step's tokens before proposing). On the CPU the model then
    # runs on a worker thread of its own while the engine's thread does the host work.
    async_scheduling: bool = True
    # CPU: torch threads for the model (default: the cores this process may use, from its
    # CPU affinity and cgroup CPU quota; see hitchllm.cpu_threads). Process-wide.
    cpu_threads: int | None = Field(None, ge=1)
    # Decode batch sizes to capture (default: 1, 2, 4, 8, 16, ... up to max_num_seqs).
    cuda_graph_sizes: list[int] | None = None
    # CUDA: steps with prompt chunks replay graphs of everything but attention, captured
    # piece by piece at token counts 16, 32, ... up to the step budget (attention runs
    # eagerly between the pieces); off, they run eagerly. Single-process engines only.
    piecewise_cuda_graphs: bool = True
    # Tensor parallelism: every layer's weights, attention heads and KV cache split over this
    # many ranks, one worker process each (one GPU each on CUDA, gloo processes on the CPU).
    tensor_parallel_size: int = Field(1, ge=1)
    # Pipeline parallelism: the decoder layers split into this many contiguous stages, one
    # group of tensor_parallel_size worker processes each (tensor x pipeline processes).
    pipeline_parallel_size: int = Field(1, ge=1)
    # Where the workers run: "mp", processes on this host (the default); "ray", one Ray actor
    # per rank on the hosts of a Ray cluster (the extra hitchllm[ray]; docs/distributed.md).
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    # Ray: how the ranks' placement-group bundles spread over the cluster's nodes:
    # STRICT_PACK (all on one node), PACK (one node where they fit, else several),
    # SPREAD (over nodes where possible), STRICT_SPREAD (one node each).
    ray_placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = (
        "STRICT_PACK")
    # Ray: seconds to wait for the cluster to grant the placement group before failing.
    ray_placement_timeout_s: float = Field(60.0, gt=0)
    # Tensor parallelism: seconds to wait for a worker's answer to one step before the engine
    # declares it hung and stops (a worker that dies is detected at once).
    worker_step_timeout_s: float = Field(300.0, gt=0)
    # Disaggregated prefill/decode: the KV connector (from a plugin) and this engine's role,
    # producer (computes prompts, ships their KV) or consumer (receives it, decodes); see
    # docs/disaggregation.md. A dict is accepted.
    kv_transfer_config: KVTransferConfig | None = None

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        if v != "auto":
            parse_dtype(v)
        return v

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v != "auto":
            try:
                torch.device(v)
            except RuntimeError as exc:
                raise ValueError(f"unknown device {v!r}; use auto, cpu or cuda[:N]") from exc
        return v

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _check_graph_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 1):
            raise ValueError("cuda_graph_sizes must be a non-empty list of positive batch sizes")
        return v

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_memory(cls, v: int | str | None) -> int | str | None:
        if v is not None and parse_size(v) <= 0:
            raise ValueError("kv_cache_memory must be positive")
        return v

    @model_validator(mode="after")
    def _check_speculation(self) -> EngineConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                f"({self.prompt_lookup_max}); the n-gram sizes to match run from min to max"
            )
        if self.num_speculative_tokens and not self.speculative_method:
            raise ValueError(
                f"num_speculative_tokens is {self.num_speculative_tokens} but no "
                "speculative_method is set; set one (e.g. ngram, draft_model or eagle from "
                "hitchllm-specdec) or drop num_speculative_tokens"
            )
        if self.speculative_method and self.num_speculative_tokens == 0:
            raise ValueError(
                "speculative_method is set but num_speculative_tokens is 0; set it to the "
                "number of draft tokens per step (e.g. 3)"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> EngineConfig:
        lora_fields = sorted({"max_loras", "max_lora_rank", "max_cpu_loras"}
                             & self.model_fields_set)
        if lora_fields and not self.enable_lora:
            raise ValueError(
                f"{', '.join(lora_fields)} set but enable_lora is off; set enable_lora=True "
                f"(--enable-lora) to serve LoRA adapters, or drop {', '.join(lora_fields)}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) is below max_loras ({self.max_loras}): "
                "every adapter active on the device is also kept in host memory; raise "
                "max_cpu_loras or lower max_loras"
            )
        return self

    @property
    def cpu_lora_capacity(self) -> int:
        """How many adapters stay loaded in host memory (``max_cpu_loras``, default
        ``max_loras``)."""
        return self.max_cpu_loras or self.max_loras

    @model_validator(mode="after")
    def _check_swap(self) -> EngineConfig:
        if self.preemption_mode != "recompute" and self.swap_space <= 0:
            raise ValueError(
                f"preemption_mode={self.preemption_mode} swaps KV blocks to host memory but "
                "swap_space is 0; give it some GiB (e.g. swap_space=4) or use "
                "preemption_mode=recompute")
        if self.preemption_mode != "recompute":
            workers = self.tensor_parallel_size * self.pipeline_parallel_size
            wanted = self.swap_space * 2**30 * workers
            ram = host_memory_bytes()
            if wanted > MAX_SWAP_SHARE * ram:
                raise ValueError(
                    f"swap_space={self.swap_space:g} GiB per worker x {workers} worker(s) is "
                    f"{wanted / 2**30:.1f} GiB of host memory, more than "
                    f"{MAX_SWAP_SHARE:.0%} of this machine's {ram / 2**30:.1f} GiB; lower "
                    "swap_space")
        return self

    @model_validator(mode="after")
    def _check_kv_scales(self) -> EngineConfig:
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales computes the scales of an fp8 KV cache, but "
                "kv_cache_dtype is auto; set kv_cache_dtype to fp8 (or fp8_e5m2), or drop "
                "calculate_kv_scales"
            )
        return self

    @model_validator(mode="after")
    def _check_model_path(self) -> EngineConfig:
        path = Path(self.model)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model {self.model!r} is not a directory with a config.json; pass the path of "
                "a Hugging Face checkpoint directory (this engine does not download models)"
            )
        return self

    def resolve_device(self) -> torch.device:
        """The device to run on: ``auto`` is CUDA when available, else CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available")
        return device

    def resolve_dtype(self, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """``auto``: float32 on CPU; on CUDA the checkpoint's 16-bit dtype, else bfloat16."""
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache stores: ``auto`` is the model's ``model_dtype``."""
        return parse_kv_cache_dtype(self.kv_cache_dtype, model_dtype)


@dataclass
class ModelConfig:
    """The parts of a Hugging Face ``config.json`` the engine and models use.

    Reads both styles: ``rope_theta``/``rope_scaling``/``torch_dtype`` (older checkpoints) and
    ``rope_parameters``/``dtype`` (transformers 5).
    """

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    hidden_act: str
    checkpoint_dtype: torch.dtype
    eos_token_ids: list[int]
    sliding_window: int | None = None
    # Multi-head latent attention (DeepSeek V2/V3 configs): the compressed KV width and the
    # rotary part of the key, cached together per token. None for other models.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def use_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def mla_latent_width(self) -> int | None:
        """Width of the latent vector an MLA layer caches per token (None without MLA)."""
        if self.kv_lora_rank is None:
            return None
        return self.kv_lora_rank + (self.qk_rope_head_dim or 0)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json``."""
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{path}/config.json has no 'architectures' entry")
        heads = raw["num_attention_heads"]
        theta, scaling = _read_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        gen_cfg = path / "generation_config.json"
        if gen_cfg.is_file():
            gen_eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            if gen_eos is not None:
                eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            path=path,
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            hidden_act=raw.get("hidden_act", "silu"),
            checkpoint_dtype=parse_dtype(dtype_name),
            eos_token_ids=eos_ids,
            sliding_window=_read_sliding_window(raw),
            kv_lora_rank=raw.get("kv_lora_rank"),
            qk_rope_head_dim=raw.get("qk_rope_head_dim"),
            hf_config=raw,
        )


def _read_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type form
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else None
    if scaling is not None:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
    return float(theta), scaling


def _read_sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        return None  # Qwen2/Qwen3 carry a window size but have it switched off
    if raw.get("use_sliding_window"):
        raise ValueError(
            "per-layer sliding window (use_sliding_window=true with max_window_layers) is not "
            "supported yet; use a checkpoint with use_sliding_window=false"
        )
    return int(window)
