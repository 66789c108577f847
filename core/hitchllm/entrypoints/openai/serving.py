"""The two generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

Each request becomes one engine request per prompt (``n`` sequences each). Non-streaming
responses wait for every prompt; streaming ones send OpenAI's SSE chunks as text arrives and
end with ``data: [DONE]``. Engine-side validation errors surface before the first byte is sent,
so a bad request always gets a 400.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hitchllm.engine.engine_client import EngineClient
from hitchllm.entrypoints.llm import chat_prompt_token_ids
from hitchllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from hitchllm.entrypoints.openai.streaming import merge_latest, sse, stream_safe_length
from hitchllm.lora import LoRARequest
from hitchllm.outputs import CompletionOutput, Logprob, RequestOutput
from hitchllm.sampling_params import SamplingParams


@dataclass
class _SeqCursor:
    """How much of one sequence has been streamed."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass
class _Batch:
    """The engine requests behind one API request. Outputs are cumulative (each carries the
    whole text so far), so only the latest one per prompt matters."""

    latest: list[RequestOutput]
    rest: AsyncIterator[tuple[int, RequestOutput]]
    cursors: dict[tuple[int, int], _SeqCursor] = field(default_factory=dict)


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(
        self, engine: EngineClient, model_name: str, tokenizer: Any,
        chat_template: str | None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        # A separate tokenizer instance: the engine thread uses its own concurrently.
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # Prompts are tokenized here, off the event loop and off the engine thread, one at a
        # time (a tokenizer instance is not safe to share between threads).
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="hitchllm-tokenize")
        # No token covers more characters than its longest vocabulary entry, so a text
        # longer than max_model_len times that cannot fit and is not worth tokenizing.
        longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = engine.max_model_len * max(1, longest_token)

    async def in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the tokenizer thread (tokenizing, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    async def tokenize_prompts(self, prompts: list[Any], params: SamplingParams) -> list[Any]:
        """Text prompts become ``{"prompt", "prompt_token_ids"}`` (ValueError when one cannot
        fit max_model_len and is not to be truncated); token-id prompts pass through."""
        out = []
        for prompt in prompts:
            if not isinstance(prompt, str):
                out.append(prompt)
                continue
            if params.truncate_prompt_tokens is None and len(prompt) > self.max_prompt_chars:
                raise ValueError(
                    f"prompt has {len(prompt)} characters, more than max_model_len="
                    f"{self.engine.max_model_len} tokens can hold; shorten it")
            ids = await self.in_tokenizer_thread(lambda p: self.tokenizer(p).input_ids, prompt)
            out.append({"prompt": prompt, "prompt_token_ids": list(ids)})
        return out

    # ---- shared ------------------------------------------------------------------------

    async def _start(
        self, prompts: list[Any], params: Any, lora_request: LoRARequest | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> _Batch:
        """Submit every prompt (run with ``lora_request``'s adapter, if any) and wait until
        each has produced output (raises ValueError if the engine rejects any of them; the
        others are then aborted). ``kv_transfer_params`` (disaggregated serving) go with a
        single prompt."""
        extra: dict[str, Any] = {}
        if kv_transfer_params is not None:
            if len(prompts) != 1:
                raise ValueError("kv_transfer_params: send one prompt per request in "
                                 f"disaggregated serving (got {len(prompts)})")
            extra["kv_transfer_params"] = kv_transfer_params
        iterators = [self.engine.generate(p, params, lora_request=lora_request, **extra)
                     for p in prompts]
        merged = merge_latest(iterators)
        latest: dict[int, RequestOutput] = {}
        try:
            async for i, out in merged:
                latest[i] = out
                if len(latest) == len(prompts):
                    break
        except BaseException:
            await merged.aclose()
            raise
        return _Batch([latest[i] for i in range(len(prompts))], merged)

    async def _finish_all(self, batch: _Batch) -> list[RequestOutput]:
        async for i, out in batch.rest:
            batch.latest[i] = out
        return batch.latest

    @staticmethod
    def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def _stream_updates(
        self, batch: _Batch, stop: list[str], n: int, with_logprobs: bool
    ) -> AsyncIterator[tuple[int, CompletionOutput, str, list[int], list[Any], bool]]:
        """(choice index, sequence, new text, new token ids, new logprobs, just finished)
        for every sequence with something to send, in arrival order. Tokens that add no
        text yet (part of a multi-byte character) are sent only when logprobs are wanted."""
        for i, out in enumerate(batch.latest):
            for update in self._updates(batch, i, out, stop, n, with_logprobs):
                yield update
        async for i, out in batch.rest:
            for update in self._updates(batch, i, out, stop, n, with_logprobs):
                yield update

    @staticmethod
    def _updates(
        batch: _Batch, i: int, out: RequestOutput, stop: list[str], n: int, with_logprobs: bool,
    ) -> list[tuple[int, CompletionOutput, str, list[int], list[Any], bool]]:
        """``_stream_updates`` of one output of prompt ``i``."""
        updates = []
        for seq in out.outputs:
            cursor = batch.cursors.get((i, seq.index))
            if cursor is None:
                cursor = batch.cursors[(i, seq.index)] = _SeqCursor()
            elif cursor.finished:
                continue
            finished = seq.finish_reason is not None
            safe = stream_safe_length(seq.text, stop, finished)
            new_text = seq.text[cursor.text_len : max(safe, cursor.text_len)]
            new_ids = seq.token_ids[cursor.num_tokens :]
            if not new_text and not finished and not (with_logprobs and new_ids):
                continue
            new_lps = seq.logprobs[cursor.num_tokens :] if seq.logprobs else []
            cursor.text_len += len(new_text)
            cursor.num_tokens = len(seq.token_ids)
            cursor.finished = finished
            updates.append((i * n + seq.index, seq, new_text, new_ids, new_lps, finished))
        return updates

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- /v1/completions ---------------------------------------------------------------

    def _reported_model(self, lora_request: LoRARequest | None) -> str:
        """The ``model`` a response names: the adapter's name, else the base model's."""
        return self.model_name if lora_request is None else lora_request.lora_name

    async def completions(
        self, req: CompletionRequest, lora_request: LoRARequest | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """``/v1/completions``, run with ``lora_request``'s adapter when given."""
        if req.use_beam_search:
            return await self._beam_search_completions(req, lora_request)
        _check_no_streamed_prompt_logprobs(req)
        params = req.completion_params()
        batch = await self._start(await self.tokenize_prompts(req.prompts(), params), params,
                                  lora_request, req.kv_transfer_params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self._reported_model(lora_request)}
        if req.stream and not req.echo_only:
            return self._stream_completions(req, batch, head, params.stop_strings)
        outputs = await self._finish_all(batch)
        choices = [self._completion_choice(req, i, out, seq)
                   for i, out in enumerate(outputs) for seq in out.outputs]
        usage = self._usage(outputs)
        if req.echo_only:  # the token generated to reach the prompt's logits is not returned
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        if req.stream:  # echo only: the whole answer is known at once
            return self._stream_whole(req, head, choices, usage)
        return {**head, "choices": choices, "usage": usage, **_kv_transfer_json(outputs)}

    async def _beam_search_completions(
        self, req: CompletionRequest, lora_request: LoRARequest | None
    ) -> dict[str, Any]:
        """vLLM's ``use_beam_search``: per prompt the ``n`` best beams, best first, as its
        choices (index ``prompt * n + rank``)."""
        search = getattr(self.engine, "beam_search", None)
        if search is None:
            raise ValueError("use_beam_search is not available on this server (its engine "
                             "client has no beam search)")
        if lora_request is not None:
            raise ValueError("model: beam search runs the base model only; name the base "
                             "model, not a LoRA adapter")
        params = req.beam_search_params(self.engine.max_model_len)
        prompts = await self.tokenize_prompts(req.prompts(), SamplingParams())
        outputs = await search(prompts, params)
        choices = [{"index": i * req.n + j, "text": seq.text, "logprobs": None,
                    "finish_reason": seq.finish_reason, "stop_reason": None}
                   for i, out in enumerate(outputs) for j, seq in enumerate(out.sequences)]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        completion_tokens = sum(len(s.output_token_ids) for o in outputs for s in o.sequences)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _completion_choice(
        self, req: CompletionRequest, i: int, out: RequestOutput, seq: CompletionOutput
    ) -> dict[str, Any]:
        """One choice of a finished completion; with ``echo`` the prompt comes first, in the
        text and in the logprobs (its first token has none: nothing precedes it)."""
        text, ids, entries = seq.text, seq.token_ids, list(seq.logprobs or [])
        if req.echo_only:
            text, ids, entries = "", [], []
        if req.echo:
            text = self._prompt_text(req, out) + text
            ids = out.prompt_token_ids + ids
            entries = list(out.prompt_logprobs or []) + entries
        return {
            "index": i * req.n + seq.index,
            "text": text,
            "logprobs": self._completion_logprobs(ids, entries, 0)
            if req.logprobs is not None else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "prompt_logprobs": _prompt_logprobs_json(out.prompt_logprobs)
            if req.prompt_logprobs is not None else None,
        }

    def _prompt_text(self, req: CompletionRequest, out: RequestOutput) -> str:
        """The prompt as echoed: the text sent, else (token ids sent, or a prompt the engine
        truncated) its token ids decoded."""
        if out.prompt is not None and req.truncate_prompt_tokens is None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids)

    @staticmethod
    async def _stream_whole(
        req: CompletionRequest, head: dict[str, Any], choices: list[dict[str, Any]],
        usage: dict[str, int],
    ) -> AsyncIterator[bytes]:
        """SSE chunks of an answer that is complete before the first chunk."""
        for choice in choices:
            yield sse({**head, "choices": [choice]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage})
        yield sse("[DONE]")

    def _stream_completions(
        self, req: CompletionRequest, batch: _Batch, head: dict[str, Any], stop: list[str]
    ) -> AsyncIterator[bytes]:
        offsets: dict[int, int] = {}

        def choice(index: int, text: str, ids: list[int], lps: list[Any]) -> dict[str, Any]:
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(ids, lps, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(text)
            return {"index": index, "text": text, "logprobs": logprobs}

        prologue = []
        if req.echo:  # the prompt (and its logprobs) first, then the completion as it comes
            for i, out in enumerate(batch.latest):
                text = self._prompt_text(req, out)
                for j in range(req.n):
                    echoed = choice(i * req.n + j, text, out.prompt_token_ids,
                                    list(out.prompt_logprobs or []))
                    prologue.append({**echoed, "finish_reason": None, "stop_reason": None})
        return self._stream(req, batch, head, stop, req.logprobs is not None, choice, prologue)

    async def _stream(
        self, req: CompletionRequest | ChatCompletionRequest, batch: _Batch,
        head: dict[str, Any], stop: list[str], with_logprobs: bool,
        choice: Callable[[int, str, list[int], list[Any]], dict[str, Any]],
        prologue: list[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        """SSE chunks: ``prologue`` choices, one chunk per update (``choice`` builds the
        endpoint's fields), optional usage, then ``[DONE]``."""
        try:
            for first in prologue:
                yield sse({**head, "choices": [first]})
            async for index, seq, text, ids, lps, finished in self._stream_updates(
                batch, stop, req.n, with_logprobs
            ):
                yield sse({**head, "choices": [{
                    **choice(index, text, ids, lps),
                    "finish_reason": seq.finish_reason if finished else None,
                    "stop_reason": seq.stop_reason if finished else None,
                }]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": self._streamed_usage(batch)})
            yield sse("[DONE]")
        finally:
            await batch.rest.aclose()

    @staticmethod
    def _streamed_usage(batch: _Batch) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in batch.latest)
        completion = sum(c.num_tokens for c in batch.cursors.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _completion_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob] | None], offset: int
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs; a None entry (an echoed prompt's first token) has a null
        logprob and null top logprobs."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in zip(token_ids, entries):
            text = self._token_text(token_id)
            tokens.append(text)
            token_lps.append(None if entry is None else entry[token_id].logprob)
            tops.append(None if entry is None else {
                self._token_text(t) if lp.decoded_token is None else lp.decoded_token: lp.logprob
                for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    # ---- /v1/chat/completions ----------------------------------------------------------

    def chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """Token ids of the conversation under the chat template (ValueError if there is no
        template, or the template rejects the messages)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "this model's tokenizer has no chat template; start the server with "
                "--chat-template FILE (a Jinja template)"
            )
        messages = [m.as_template_input() for m in req.messages]
        ids = chat_prompt_token_ids(self.tokenizer, messages, template,
                                    req.add_generation_prompt)
        return {"prompt_token_ids": ids}

    async def chat(
        self, req: ChatCompletionRequest, lora_request: LoRARequest | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """``/v1/chat/completions``, run with ``lora_request``'s adapter when given."""
        _check_no_streamed_prompt_logprobs(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = req.sampling_params(max_tokens, req.num_logprobs())
        prompt = await self.in_tokenizer_thread(self.chat_prompt, req)
        batch = await self._start([prompt], params, lora_request, req.kv_transfer_params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model = self._reported_model(lora_request)
        if req.stream:
            return self._stream_chat(req, batch, rid, created, model, params.stop_strings)
        [out] = await self._finish_all(batch)
        choices = [{
            "index": seq.index,
            "message": {"role": "assistant", "content": seq.text},
            "logprobs": self._chat_logprobs(seq.token_ids, seq.logprobs or [], req.top_logprobs)
            if req.logprobs else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
        } for seq in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": model, "choices": choices, "usage": self._usage([out]),
                "prompt_logprobs": _prompt_logprobs_json(out.prompt_logprobs)
                if req.prompt_logprobs is not None else None, **_kv_transfer_json([out])}

    def _stream_chat(
        self, req: ChatCompletionRequest, batch: _Batch, rid: str, created: int, model: str,
        stop: list[str],
    ) -> AsyncIterator[bytes]:
        def choice(index: int, text: str, ids: list[int], lps: list[Any]) -> dict[str, Any]:
            return {
                "index": index, "delta": {"content": text} if text else {},
                "logprobs": (self._chat_logprobs(ids, lps, req.top_logprobs)
                             if req.logprobs else None),
            }

        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model}
        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(req.n)]
        return self._stream(req, batch, head, stop, req.logprobs, choice, roles)

    def _chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]], top: int | None
    ) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(token_ids, entries):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: top or 0]
            content.append({
                **self._chat_token(token_id, entry[token_id].logprob),
                "top_logprobs": [self._chat_token(t, lp.logprob) for t, lp in ranked],
            })
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _kv_transfer_json(outputs: list[RequestOutput]) -> dict[str, Any]:
    """A producer's ``kv_transfer_params`` for the response (nothing from other engines)."""
    params = outputs[0].kv_transfer_params if len(outputs) == 1 else None
    return {} if params is None else {"kv_transfer_params": params}


def _check_no_streamed_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream and req.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs is not available with stream=true (vLLM's rule too); "
                         "use echo with logprobs on /v1/completions to stream a prompt's logprobs")


def _prompt_logprobs_json(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a dict
    ``token id -> {logprob, rank, decoded_token}`` (the prompt's token and the top ones)."""
    return [None if entry is None else {
        str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token, lp in entry.items()
    } for entry in entries or []]
