"""An asyncio front for ``LLMEngine``: the engine steps in its own thread; request handlers
await per-request output queues and never block it.

Only the engine thread touches the ``LLMEngine``. Handlers send it commands (add, abort,
beam search) through a thread-safe queue; it answers through ``loop.call_soon_threadsafe``,
once per step for all the step's outputs (each wake-up of the event loop from another thread
is a system call on both sides and a hand-over of the GIL, and a step may have hundreds of
outputs). A handler that stops listening (a client disconnected) aborts its request, which
frees its KV blocks at the start of the engine's next step.

Outputs are cumulative (each carries the whole text and token ids so far), so a request's
stream keeps only the newest output its handler has not taken yet: a handler slower than the
engine (a busy event loop, a slow client) gets the tokens of several steps in one output
instead of falling further behind with a queue of stale ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hitchllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from hitchllm.config import EngineConfig
from hitchllm.engine.llm_engine import LLMEngine, Prompt
from hitchllm.lora import LoRARequest
from hitchllm.outputs import CompletionOutput, RequestOutput
from hitchllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unexpected error; the server must be restarted."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (``RequestOutput.error``); it serves the others."""


@dataclass
class _Add:
    prompt: Prompt
    params: SamplingParams
    request_id: str
    kwargs: dict[str, Any]
    stream: OutputSink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _BeamSearch:
    prompts: list[Prompt]
    params: BeamSearchParams
    stream: OutputSink


class OutputSink(Protocol):
    """Where the engine thread delivers one request's outputs, errors or beam-search result
    (``put`` is called from the engine thread)."""

    def put(self, item: Any) -> None: ...


class RequestStream:
    """Where the engine thread delivers one request's outputs (or an exception, or a beam
    search's result). Lives on ``loop``: ``push`` and ``get`` run there, ``put`` anywhere.
    A new ``RequestOutput`` replaces one not yet taken (outputs are cumulative)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        """Deliver ``item`` from any thread (one wake-up of the loop)."""
        self.loop.call_soon_threadsafe(self.push, item)

    def push(self, item: Any) -> None:
        """Deliver ``item`` (on the loop's thread)."""
        items = self._items
        if items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput):
            items[-1] = item
        else:
            items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Any:
        """The next item: the newest output not yet taken, or an exception."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


def _push_all(deliveries: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Deliver one step's outputs (on the streams' loop: one wake-up per step)."""
    for stream, out in deliveries:
        stream.push(out)


StepObserver = Callable[[LLMEngine, list[RequestOutput], float], None]


class AsyncLLMEngine:
    """Runs an ``LLMEngine`` in a background thread and serves ``generate`` to asyncio code
    (an ``EngineClient``)."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: StepObserver | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_step`` is called from the engine thread after every loop iteration;
        ``on_dead`` once, from the engine thread, if the loop dies."""
        self.engine = engine
        self.on_step = on_step
        self.on_dead = on_dead
        self._commands: queue.Queue[_Add | _Abort | _BeamSearch | None] = queue.Queue()
        self._streams: dict[str, Any] = {}
        # A beam search runs alone: it waits for the running requests to finish, and
        # requests that arrive meanwhile wait for it (so that it cannot starve).
        self._beam_searches: deque[_BeamSearch] = deque()
        self._held: list[_Add] = []
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hitchllm-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """``LLMEngine.add_lora`` (safe beside the engine thread)."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        self.engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    @property
    def dead_reason(self) -> str | None:
        """None while the engine loop is alive; else why it stopped (no internal detail)."""
        if self._dead is not None:
            return f"the engine loop stopped after an unexpected {type(self._dead).__name__}"
        if not self._thread.is_alive():
            return "the engine loop is not running"
        return None

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output each time it makes progress, the last one finished.

        Raises ``ValueError`` (before yielding) for a request the engine rejects. If the caller
        stops iterating early (or is cancelled), the request is aborted.
        """
        if (reason := self.dead_reason) is not None:
            raise EngineDeadError(reason)
        request_id = request_id or f"req-{next(self._ids)}"
        if self.engine.logits_processors_for(params):
            # Grammar compilation and the like run here, off the engine loop; the loop's own
            # call in add_request then finds them cached and other requests never wait.
            await asyncio.to_thread(self.engine.compile_logits_processors, params)
        stream = RequestStream(asyncio.get_running_loop())
        self.submit(prompt, params, request_id, stream, **kwargs)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def beam_search(
        self, prompts: list[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """``LLM.beam_search`` on the engine thread. It runs alone: once the requests
        running when it arrives have finished; requests that arrive meanwhile wait for it.
        Raises ``ValueError`` for input the search refuses."""
        if (reason := self.dead_reason) is not None:
            raise EngineDeadError(reason)
        stream = RequestStream(asyncio.get_running_loop())
        self.submit_beam_search(prompts, params, stream)
        item = await stream.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self, request_id: str) -> None:
        """Stop the request; its stream ends with a finished output (finish_reason
        "abort")."""
        self._commands.put(_Abort(request_id))

    def submit(self, prompt: Prompt, params: SamplingParams, request_id: str,
               stream: OutputSink, **kwargs: Any) -> None:
        """Queue a request from any thread (``generate`` without asyncio): its outputs go
        to ``_deliver`` once per step, an error or the final output of an abort to
        ``stream.put``."""
        self._commands.put(_Add(prompt, params, request_id, kwargs, stream))

    def submit_beam_search(self, prompts: list[Prompt], params: BeamSearchParams,
                           stream: OutputSink) -> None:
        """Queue a beam search from any thread; its result (a list of ``BeamSearchOutput``)
        or exception goes to ``stream.put``."""
        self._commands.put(_BeamSearch(prompts, params, stream))

    def shutdown(self) -> None:
        """Stop the engine thread, then the engine's worker processes (if any)."""
        self._commands.put(None)
        self._thread.join(timeout=30)
        self.engine.close()

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                outputs: list[RequestOutput] = []
                block = not self.engine.has_unfinished_requests() and not self._beam_searches
                if not self._drain_commands(block, outputs):
                    return
                if self._beam_searches and not self.engine.has_unfinished_requests():
                    self._run_beam_search(self._beam_searches.popleft())
                elif self.engine.has_unfinished_requests():
                    stepped = self.engine.step()
                    self._deliver(stepped)
                    outputs += stepped
                if self.on_step is not None:
                    try:
                        self.on_step(self.engine, outputs, time.monotonic())
                    except Exception:  # an observer (metrics) must not stop serving
                        logger.exception("step observer failed")
        except BaseException as exc:  # the loop must tell every waiter, never die silently
            logger.exception("engine loop failed")
            self._dead = exc
            for stream in self._streams.values():
                stream.put(EngineDeadError(self.dead_reason or "the engine loop stopped"))
            self._streams.clear()
            if self.on_dead is not None:
                self.on_dead(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop that has
        any (a server has one). A driver without asyncio (an engine process) overrides it."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_push_all, deliveries)

    def _run_beam_search(self, cmd: _BeamSearch) -> None:
        """Run one queued beam search; once none is left, add the requests held back."""
        try:
            cmd.stream.put(beam_search(self.engine, cmd.prompts, cmd.params))
        except (ValueError, TypeError, RuntimeError) as exc:  # it fails alone
            if not isinstance(exc, (ValueError, TypeError)):
                logger.exception("a beam search failed")
            cmd.stream.put(exc)
        if not self._beam_searches:
            held, self._held = self._held, []
            for add in held:
                self._add(add)

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id, **cmd.kwargs)
        except Exception as exc:  # a request that cannot be added fails alone
            if not isinstance(exc, (ValueError, TypeError)):
                logger.exception("adding request %s failed", cmd.request_id)
            cmd.stream.put(exc)
            return
        self._streams[cmd.request_id] = cmd.stream

    def _drain_commands(self, block: bool, aborted: list[RequestOutput]) -> bool:
        """Apply pending commands (final outputs of aborted requests go to ``aborted``); wait
        for one when idle. False means shut down."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _BeamSearch):
                self._beam_searches.append(cmd)
                continue
            if isinstance(cmd, _Abort):
                # A request held back behind a beam search is dropped before it runs.
                held = [a for a in self._held if a.request_id == cmd.request_id]
                for add in held:
                    self._held.remove(add)
                    aborted = CompletionOutput(0, "", [], finish_reason="abort")
                    add.stream.put(RequestOutput(cmd.request_id, None, [], [aborted],
                                                 finished=True))
                stream = self._streams.pop(cmd.request_id, None)
                if stream is not None:
                    final = self.engine.abort_request(cmd.request_id)
                    for out in final:  # a caller still listening sees the request end
                        stream.put(out)
                    aborted += final
                continue
            if self._beam_searches:
                self._held.append(cmd)
            else:
                self._add(cmd)
