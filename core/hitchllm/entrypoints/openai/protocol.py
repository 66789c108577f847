"""Request bodies of the OpenAI-compatible API, validated with pydantic, and their mapping to
``SamplingParams``. A field this server does not implement (an unknown one, or a known OpenAI
field set to something other than its default) is rejected with a 400 naming it, never
silently ignored; only fields that change nothing here (``user``, ``metadata``, ...) pass."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hitchllm.beam_search import BeamSearchParams
from hitchllm.sampling_params import SamplingParams, StructuredOutputsParams

# vLLM's legacy extra-body aliases -> the StructuredOutputsParams field each one sets.
_GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "grammar"}


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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Output constraints (enforced by the plugin hitchllm-structured-output): OpenAI's
    # response_format, vLLM's structured_outputs and its legacy guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Disaggregated serving (vLLM's field): to a producer ``{"do_remote_decode": true}``; to a
    # consumer, the ``kv_transfer_params`` the producer's response carried.
    kv_transfer_params: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not implement."""
        return sorted(set(self.model_extra or {}) - _IGNORED_FIELDS)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint, from whichever one field gives it; ``ValueError`` naming
        the field when it is malformed or when several fields give one."""
        given: dict[str, dict[str, Any]] = {}
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            schema = ((self.response_format or {}).get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema "
                                 "object")
            given["response_format"] = {"json": schema}
        elif kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported; use text, "
                             "json_object or json_schema")
        if self.structured_outputs:
            given["structured_outputs"] = dict(self.structured_outputs)
        for alias, field in _GUIDED_ALIASES.items():
            if getattr(self, alias) is not None:
                given[alias] = {field: getattr(self, alias)}
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"{next(iter(given))} and {', '.join(list(given)[1:])} each "
                             "constrain the output; give only one")
        [(name, fields)] = given.items()
        unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{name} has fields this server does not support: "
                             f"{', '.join(unknown)} (use json, json_object, regex, choice or "
                             "grammar)")
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc

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
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params(),
        )


# Fields beam search cannot honour -> the values that mean "not used".
_BEAM_SEARCH_CONFLICTS: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "echo": (False,), "logprobs": (None,), "prompt_logprobs": (None,),
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "seed": (None,),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "stop": (None, [], ""), "stop_token_ids": (None, []),
    "min_tokens": (0,), "logit_bias": (None, {}), "allowed_token_ids": (None,),
    "bad_words": (None, []), "response_format": (None,), "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "truncate_prompt_tokens": (None,),
}


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's beam search: ``n`` is the beam width, the ``n`` best beams are the choices.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            bad.append("length_penalty")  # it ranks beams; sampling has none
        return bad

    def beam_search_params(self, max_model_len: int) -> BeamSearchParams:
        """The beam search of a ``use_beam_search`` request; ``ValueError`` naming a field
        that beam search cannot honour. ``max_tokens`` null means up to max_model_len."""
        conflicts = [name for name, default in _BEAM_SEARCH_CONFLICTS.items()
                     if getattr(self, name) not in default]
        if conflicts:
            raise ValueError(f"{conflicts[0]} cannot be used with use_beam_search (beam search "
                             f"is deterministic and returns whole beams); drop "
                             f"{', '.join(conflicts)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (the beam width with use_beam_search), got "
                             f"{self.n}")
        if self.temperature:
            raise ValueError(f"temperature must be 0 (or unset) with use_beam_search, got "
                             f"{self.temperature}: only deterministic beam search is "
                             "implemented")
        return BeamSearchParams(
            beam_width=self.n, max_tokens=max_model_len if self.max_tokens is None
            else self.max_tokens, ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty)

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
    functions: list[Any] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                bad.append(name)
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        return bad

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0

