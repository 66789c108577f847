"""Per-request sampling parameters, named and defaulted like vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

_GREEDY_EPS = 1e-5
# The sampler computes in float32: a value must keep its meaning after the cast.
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32
# torch.Generator.manual_seed takes a signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Beyond any vocabulary and context length; keeps ints within int64 on their way to tensors.
_INT_LIMIT = 2**62


@dataclass
class SamplingParams:
    """How to sample one request's output tokens.

    Validation happens at construction and raises ``ValueError`` saying what to change.
    ``verify_vocab`` checks the token ids against a model's vocabulary when the request is
    added to an engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Keep only the last k prompt tokens (-1: the last max_model_len); None keeps them all.
    truncate_prompt_tokens: int | None = None
    # Token id -> bias added to its logit before sampling (OpenAI's logit_bias, in [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words whose token sequence may not be completed (each tokenized with and without a
    # leading space; the last token is banned when the output ends with the ones before it).
    bad_words: list[str] | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (needs the plugin
    # hitchllm-structured-output).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by __post_init__ from ``stop``: always a list.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._validate()
        self._validate_logits_fields()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}.")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                bad(f"{name} must be an integer or None, got {value!r}.")
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")
        for name in floats:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                bad(f"{name} must be a number, got {value!r}.")
            if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                bad(f"{name} must be a finite number within float32 range, got {value}.")
        if self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_p < _FLOAT32_TINY:
            bad(f"top_p={self.top_p} rounds to 0 in float32; use at least 1e-30.")
        if self.top_k < 0:
            bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}.")
        if self.repetition_penalty < _FLOAT32_TINY:
            bad(f"repetition_penalty={self.repetition_penalty} is below float32's normal range; "
                "use at least 1e-30.")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > _INT_LIMIT:
                bad(f"{name}={value} is too large; use at most {_INT_LIMIT}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be >= 0 (the number of top tokens to return), got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}.")
        if any(not isinstance(s, str) for s in self.stop_strings):
            bad("stop must be a string or a list of strings.")
        if any(not s for s in self.stop_strings):
            bad("stop strings must be non-empty.")
        if any(t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}.")
        if self.stop_strings and not self.detokenize:
            bad("stop strings need detokenize=True (use stop_token_ids to stop without text).")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or (k < 1 and k != -1)):
            bad(f"truncate_prompt_tokens must be an integer >= 1 (keep the last k prompt tokens) "
                f"or -1 (keep the last max_model_len), got {k!r}.")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            # Sequence i of an n > 1 request uses seed + i.
            bad(f"seed must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] "
                f"(a 64-bit integer; with n={self.n}, seed + n - 1 must fit too), "
                f"got {self.seed}.")

    def _validate_logits_fields(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a dict of token id -> bias.")
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    "logit_bias keys must be token ids (integers) and values numbers."
                ) from exc
            wrong = [(t, b) for t, b in self.logit_bias.items()
                     if t < 0 or not -100.0 <= b <= 100.0]
            if wrong:
                raise ValueError(
                    f"logit_bias {dict(wrong[:5])} is invalid: keys must be token ids >= 0 "
                    "and biases numbers in [-100, 100]."
                )
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not self.allowed_token_ids:
                raise ValueError(
                    "allowed_token_ids must be a non-empty list of token ids (leave it unset "
                    "to allow every token)."
                )
            try:
                self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    "allowed_token_ids must be a list of token ids (integers)."
                ) from exc
            if min(self.allowed_token_ids) < 0:
                raise ValueError(
                    "allowed_token_ids must be token ids >= 0, got "
                    f"{[t for t in self.allowed_token_ids if t < 0][:5]}."
                )
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                raise ValueError("bad_words must be a list of strings, not one string.")
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings.")
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {f.name for f in fields(
                StructuredOutputsParams)}
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown fields {sorted(unknown)}; use json, "
                    "json_object, regex, choice or grammar."
                )
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its fields)."
            )

    @property
    def uses_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty is set."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature < _GREEDY_EPS

    def verify_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if a token id in these params lies outside the vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids {bad} are outside the model's vocabulary "
                f"(valid ids are 0..{vocab_size - 1})."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name}={value} asks for more tokens than the vocabulary "
                                 f"holds; use at most {vocab_size}.")
        for name, ids in (("logit_bias", self.logit_bias or {}),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name} has token ids {bad[:5]} outside the model's vocabulary "
                    f"(valid ids are 0..{vocab_size - 1})."
                )


@dataclass
class StructuredOutputsParams:
    """What the output must match; exactly one field is set (vLLM's ``StructuredOutputsParams``).

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: the output is one of
    these strings; ``grammar``: a context-free grammar (Lark syntax, or GBNF when it uses
    ``::=``). Enforced by the plugin hitchllm-structured-output.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}."
            )
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")

    @property
    def kind(self) -> str:
        """The name of the field that is set (``"json"``, ``"regex"``, ...)."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))
