"""Request bodies of the OpenAI-compatible API, validated with pydantic, and their mapping to
``SamplingParams``. A field this server does not implement (an unknown one, or a known OpenAI
field set to something other than its default) is rejected with a 400 naming it, never
silently ignored; only fields that change nothing here (``user``, ``metadata``, ...) pass."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hitchllm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI fields that ask nothing of generation (bookkeeping, hints); accepted and ignored.
_IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key",
                             "safety_identifier", "parallel_tool_calls"})


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    # Extra fields are kept so that ``unsupported`` can name them.
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra body fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not implement."""
        bad = sorted(set(self.model_extra or {}) - _IGNORED_FIELDS)
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises ``ValueError`` for out-of-range values."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: the prompt (and its logprobs) is the whole answer,
        as lm-eval asks to score a text."""
        return self.echo and self.max_tokens == 0

    def completion_params(self) -> SamplingParams:
        """The engine's parameters. An echo-only request generates one token that is never
        returned (the engine samples at least one); echo with logprobs scores the prompt with
        as many top tokens as the completion."""
        params = self.sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs
        return params

    def prompts(self) -> list[str | dict[str, Any]]:
        """The batch of prompts: strings or token-id lists, as the engine takes them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        return [{"prompt_token_ids": ids} for ids in p]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it, with text parts joined."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise ValueError(
                        f"message content part of type {part.get('type')!r} is not supported; "
                        "only text parts are"
                    )
                texts.append(part.get("text", ""))
            content = "".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    functions: list[Any] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                bad.append(name)
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            bad.append("response_format")
        return bad

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0

