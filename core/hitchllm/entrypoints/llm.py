"""``LLM``: offline batched generation, the same shape as vLLM's ``LLM`` class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from hitchllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from hitchllm.config import EngineConfig
from hitchllm.engine.llm_engine import LLMEngine, Prompt
from hitchllm.entrypoints.startup import collector_off, collector_skips_older_objects
from hitchllm.outputs import RequestOutput
from hitchllm.sampling_params import SamplingParams


class LLM:
    """Generate from a Hugging Face checkpoint directory (default: the bundled code model).

    >>> llm = LLM(model="path/to/checkpoint")
    >>> out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=16, temperature=0))
    >>> out[0].outputs[0].text

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``, ``attention_backend``,
    ``block_size``, ``num_kv_blocks``, ``kv_cache_memory``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``seed``, ...). Invalid values
    raise ``EngineConfigError`` (a ``ValueError``), one line per field; vLLM arguments hitchllm
    does not implement yet (``data_parallel_size=2``, ...) are refused by name.
    ``tensor_parallel_size=N`` splits the model over N worker processes (N GPUs on CUDA);
    ``pipeline_parallel_size=M`` splits its layers into M stages (N x M processes).
    ``enable_lora=True`` (with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``) serves
    LoRA adapters through the hitchllm-lora plugin. ``preemption_mode="swap"`` (with
    ``swap_space`` GiB of host memory) swaps preempted requests' KV blocks to host memory
    instead of recomputing them (docs/preemption.md).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is not None:
            engine_args["model"] = model
        with collector_off():
            self.engine = LLMEngine(EngineConfig(**engine_args))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size > 1``); the ``LLM``
        cannot generate afterwards. Also runs at interpreter exit; ``with LLM(...) as llm:``
        calls it on leaving the block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        A prompt is a string or ``{"prompt_token_ids": [...]}``. ``sampling_params`` is one
        ``SamplingParams`` for all prompts or one per prompt. ``lora_request`` (a
        ``hitchllm.LoRARequest`` for all prompts, or a list with one per prompt, None for the
        base model) needs ``enable_lora=True`` and the hitchllm-lora plugin. If any prompt
        is invalid, a
        ``ValueError`` is raised and none of the prompts is left queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts; pass one "
                    "SamplingParams or one per prompt"
                )
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"got {len(loras)} lora requests for {len(prompts)} prompts; pass one "
                    "LoRARequest (or None) for all prompts or one per prompt"
                )
        else:
            loras = [lora_request] * len(prompts)
        ids: list[str] = []
        with collector_skips_older_objects():  # the intake too: tokenizing allocates
            try:
                for prompt, p, lora in zip(prompts, params, loras):
                    # The id is recorded before the request is queued, so that an interrupt
                    # landing after the engine queued it still finds it to abort.
                    ids.append(self.engine.new_request_id(p.n if p is not None else 1))
                    self.engine.add_request(prompt, p, request_id=ids[-1], lora_request=lora,
                                            final_only=True)
            except BaseException:  # an interrupt too: none of the prompts stays queued
                self.engine.abort_request(ids)
                raise
            return self._run(ids, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
        lora_request: Any = None, use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (a string or ``{"prompt_token_ids": [...]}``); per
        prompt its ``params.beam_width`` best sequences, best first, scored as Hugging Face's
        ``generate(num_beams=...)`` scores them. Beams share KV blocks copy-on-write. Raises
        ``ValueError`` naming the option the engine cannot honour (``beam_width`` above
        ``max_num_seqs``, speculative decoding, ``temperature > 0``, a ``lora_request``).
        ``use_tqdm`` shows the prompts as their searches finish."""
        if lora_request is not None:
            raise ValueError("lora_request: beam search runs the base model only; call "
                             "beam_search without an adapter")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        with tqdm(total=len(prompts), desc="Beam search", unit="prompt",
                  disable=not use_tqdm) as bar, collector_skips_older_objects():
            return beam_search(self.engine, prompts, params, on_done=lambda: bar.update(1))

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or ``chat_template``) and generate.

        ``messages`` is one conversation (a list of ``{"role", "content"}`` dicts) or a list of
        conversations; ``lora_request`` is one for all of them or one per conversation, as in
        ``generate``.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            {"prompt_token_ids": chat_prompt_token_ids(
                self.engine.tokenizer, conversation, chat_template, add_generation_prompt)}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]


def chat_prompt_token_ids(
    tokenizer: Any,
    conversation: list[dict[str, str]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt token ids of one conversation under the tokenizer's chat template (or
    ``chat_template``); ``ValueError`` if there is none or it rejects the conversation."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template; pass chat_template= (a Jinja template)"
        )
    from jinja2 import TemplateError  # chat templates need jinja2; so does transformers here

    try:
        ids = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=True,
            add_generation_prompt=add_generation_prompt, return_dict=True,
        )["input_ids"]
    except TemplateError as exc:  # e.g. raise_exception("roles must alternate ...")
        raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
    return list(ids)
