"""vLLM's ``/tokenize`` and ``/detokenize``: the server's own tokenizer and chat template, so
a client counts or builds token ids exactly as the server will see them.

``/tokenize`` takes ``{"prompt"}`` (a text) or ``{"messages"}`` (a conversation, rendered with
the chat template the chat endpoint uses) and returns ``{"count", "max_model_len", "tokens",
"token_strs"}``; ``/detokenize`` takes ``{"tokens"}`` and returns ``{"prompt"}``. ``model`` is
optional in both, as in vLLM (lm-eval's remote tokenizer sends none).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hitchllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from hitchllm.entrypoints.openai.serving import OpenAIServing


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a text prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with a conversation."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not implement."""
        return [name for name in ("continue_final_message", "add_special_tokens")
                if getattr(self, name)]


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def parse_tokenize_request(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The request a ``/tokenize`` body holds: a conversation if it has ``messages``.
    Raises ``pydantic.ValidationError``."""
    if "messages" in body:
        return TokenizeChatRequest.model_validate(body)
    return TokenizeCompletionRequest.model_validate(body)


class OpenAITokenization:
    """Serves ``/tokenize`` and ``/detokenize`` with the generation endpoints' tokenizer."""

    def __init__(self, serving: OpenAIServing, max_model_len: int) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer
        self.max_model_len = max_model_len

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        """Token ids of the prompt or conversation (ValueError for a conversation the chat
        template cannot render, or options this server does not implement)."""
        if isinstance(req, TokenizeChatRequest):
            if bad := req.unsupported():
                raise ValueError(f"not supported by this server: {', '.join(bad)}")
            chat = ChatCompletionRequest(model=req.model or "", messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt)
            tokens = self.serving.chat_prompt(chat)["prompt_token_ids"]
        else:
            tokens = self.tokenizer(req.prompt,
                                    add_special_tokens=req.add_special_tokens).input_ids
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": self.tokenizer.convert_ids_to_tokens(tokens)
            if req.return_token_strs else None,
        }

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """The text of the token ids (ValueError naming ids outside the vocabulary)."""
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"tokens {bad[:5]} are outside the tokenizer's vocabulary (0..{vocab - 1})")
        return {"prompt": self.tokenizer.decode(req.tokens)}
