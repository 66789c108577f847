"""``DataParallelEngine``: N engine replicas, each in its own process, served as one
``EngineClient``.

Each request goes to the replica the ``LoadBalancer`` picks and stays there; its outputs come
back through that replica's pipe, read by one thread per replica that hands them to the
request's asyncio queue. A caller that stops listening (a client disconnected) aborts the
request on its replica. A replica whose process exits fails its own requests with
``EngineDeadError`` naming it, is routed nothing more, and makes ``dead_reason`` (``/health``)
report it; the other replicas keep serving. ``shutdown`` stops and reaps every replica.

On CUDA, replica ``i`` sees only its own devices (``placement.py``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from hitchllm.config import EngineConfig
from hitchllm.data_parallel.balancer import BalancerPolicy, LoadBalancer, NoLiveReplicaError
from hitchllm.data_parallel.deltas import GrowDelta, OutputDelta
from hitchllm.data_parallel.handle import ReplicaHandle, as_exception
from hitchllm.data_parallel.messages import (
    Abort,
    Call,
    Dead,
    Deliveries,
    Generate,
    Reply,
    WireError,
)
from hitchllm.data_parallel.metrics import DataParallelMetrics, Family, without_gauges
from hitchllm.data_parallel.placement import replica_environments
from hitchllm.data_parallel.replica import ReplicaSpec, run_replica
from hitchllm.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from hitchllm.lora import LoRARequest
from hitchllm.outputs import RequestOutput
from hitchllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long a metrics or LoRA call waits for the replicas' answers.
_CALL_TIMEOUT_S = 30.0
# How long /metrics waits for them: less than a scraper's timeout (Prometheus' default is
# 10 s), so that a replica that hangs leaves the scrape answered, with its last numbers.
_METRICS_TIMEOUT_S = 5.0
# How long shutdown waits for a replica to exit by itself before killing it.
_EXIT_GRACE_S = 10.0
_ABORTED = object()  # put on a request's queue by ``abort``


class DataParallelEngine:
    """``num_replicas`` engines with ``config``, each in a process of its own, behind a load
    balancer (an ``EngineClient``)."""

    def __init__(
        self,
        config: EngineConfig,
        num_replicas: int,
        metrics_name: str = "model",
        lora_modules: list[LoRARequest] | None = None,
        policy: BalancerPolicy | None = None,
        on_all_dead: Callable[[], None] | None = None,
        start_timeout_s: float | None = None,
        wait: bool = True,
    ) -> None:
        """Start the replicas and wait until each has loaded the model (and
        ``lora_modules``), at most ``start_timeout_s`` (default: as long as they run).
        ``on_all_dead`` is called, from a reader thread, when the last replica stops. Raises
        if a replica cannot start (the others are then stopped). ``wait=False`` returns once
        the processes are started: the caller does other start-up work meanwhile, then calls
        ``wait_ready`` (and ``shutdown`` if its own work fails)."""
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {num_replicas}")
        _check_kv_connector_replicas(config, num_replicas)
        self.config = config
        self.balancer = LoadBalancer(
            num_replicas, policy or BalancerPolicy.for_config(config))
        self.on_all_dead = on_all_dead
        self.replicas: list[ReplicaHandle] = []
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._where: dict[str, ReplicaHandle] = {}
        self._loras_lock = threading.Lock()
        self._closed = False
        self._metrics_name = metrics_name
        atexit.register(self.shutdown)
        try:
            self._start(num_replicas, ReplicaSpec(
                0, config, metrics_name, config.max_loras if config.enable_lora else None,
                list(lora_modules or [])))
        except BaseException:
            self.shutdown()
            raise
        if wait:
            self.wait_ready(start_timeout_s)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every replica has loaded its model, at most ``timeout_s``; raises (and
        stops the replicas) if one cannot start."""
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            ready = [replica.wait_ready(deadline) for replica in self.replicas]
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = ready[0].max_model_len
        self._loras = {lora.lora_name: lora for lora in ready[0].loras}
        for replica in self.replicas:
            threading.Thread(target=self._read, args=(replica,), daemon=True,
                             name=f"hitchllm-dp-{replica.index}").start()
        self.metrics = DataParallelMetrics(self._metrics_name, len(self.replicas),
                                           self._metrics_snapshots, self._balancer_state)
        self.ready = ready
        for i, r in enumerate(ready):
            logger.info("data-parallel replica %d: pid %d, %s%s", i, r.pid, r.device,
                        f" (GPUs {', '.join(r.gpus)})" if r.gpus else "")

    def _start(self, num_replicas: int, spec: ReplicaSpec) -> None:
        """Start every replica process (they load their models at the same time). Replicas
        are not daemons: each may start worker processes of its own (tensor parallelism)."""
        context = multiprocessing.get_context("spawn")
        for i, env in enumerate(replica_environments(self.config, num_replicas)):
            ours, theirs = context.Pipe()
            process = context.Process(target=run_replica, args=(replace(spec, index=i), theirs),
                                      name=f"hitchllm-dp-replica-{i}", daemon=False)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # a spawned process inherits the environment at start
            try:
                process.start()
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            theirs.close()  # so that the replica's exit closes the pipe for our reader
            self.replicas.append(ReplicaHandle(i, process, ours))

    # ---- EngineClient -------------------------------------------------------------------

    @property
    def dead_reason(self) -> str | None:
        reasons = [r.dead_reason for r in self.replicas if r.dead_reason is not None]
        return "; ".join(reasons) if reasons else None

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLMEngine.generate``, on the replica the balancer picks."""
        request_id = request_id or f"dp-{next(self._ids)}"
        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        lora = kwargs.get("lora_request")
        salt = (getattr(lora, "lora_name", None), kwargs.get("cache_salt"))
        try:
            index = self.balancer.choose(token_ids, salt)
        except NoLiveReplicaError as exc:
            raise EngineDeadError(self.dead_reason or str(exc)) from exc
        replica = self.replicas[index]
        stream = RequestStream(asyncio.get_running_loop())
        replica.streams[request_id] = stream
        self._where[request_id] = replica
        done = False
        last: RequestOutput | None = None
        try:
            if not replica.send(Generate(request_id, prompt, params, kwargs)):
                raise EngineDeadError(f"data-parallel replica {index}: "
                                      f"{replica.dead_reason or 'it has stopped'}")
            while True:
                item = await stream.get()
                if item is _ABORTED:
                    done = True
                    if last is not None:
                        yield _aborted(last)
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                last, done = item, item.finished
                yield item
                if done:
                    return
        finally:
            replica.streams.pop(request_id, None)
            self._where.pop(request_id, None)
            self.balancer.finished(index)
            if not done:
                replica.send(Abort(request_id))

    async def beam_search(self, prompts: list[Any], params: Any) -> list[Any]:
        """``AsyncLLMEngine.beam_search`` on the least loaded replica (where it runs alone,
        as there)."""
        try:
            index = self.balancer.choose()
        except NoLiveReplicaError as exc:
            raise EngineDeadError(self.dead_reason or str(exc)) from exc
        try:
            future = self._call(self.replicas[index], "beam_search", prompts, params)
            if future is None:
                raise EngineDeadError(self.dead_reason or
                                      f"data-parallel replica {index} has stopped")
            return await asyncio.wrap_future(future)
        finally:
            self.balancer.finished(index)

    def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is None:
            return
        stream = replica.streams.get(request_id)
        if stream is not None:  # queued before the replica's answer to the abort can be
            stream.put(_ABORTED)
        replica.send(Abort(request_id))

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Load the adapter on every replica (blocking); if one refuses it, the others
        unload it again and the ``ValueError`` is raised."""
        results = self._call_all("add_lora", lora_request)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) < len(results):
                self._call_all("remove_lora", lora_request.lora_name)
            raise errors[0]
        bound = results[0]
        with self._loras_lock:
            self._loras[bound.lora_name] = bound
        return bound

    def remove_lora(self, lora_name: str) -> None:
        """Unload the adapter from every replica (blocking)."""
        results = self._call_all("remove_lora", lora_name)
        with self._loras_lock:
            self._loras.pop(lora_name, None)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def list_loras(self) -> list[LoRARequest]:
        with self._loras_lock:
            return list(self._loras.values())

    def shutdown(self) -> None:
        """Ask every replica to exit, wait, then kill the ones still there (they ignore
        SIGTERM, which a service manager sends the server's whole process group)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        for replica in self.replicas:
            replica.send(None)
        for replica in self.replicas:
            replica.process.join(_EXIT_GRACE_S)
            if replica.process.is_alive():
                logger.warning("data-parallel replica %d did not exit; killing it",
                               replica.index)
                replica.process.kill()
                replica.process.join(5)
            replica.close()

    # ---- replies from the replicas ------------------------------------------------------

    def _read(self, replica: ReplicaHandle) -> None:
        """One replica's reader thread: deliver its messages until its pipe closes."""
        dead_reason = None
        while True:
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Dead):
                dead_reason = message.reason
                continue
            try:
                self._handle(replica, message)
            except Exception:  # one bad message must not stop this replica's replies
                logger.exception("data-parallel replica %d: a message could not be handled",
                                 replica.index)
        if not self._closed:
            replica.process.join(5)
            self._replica_stopped(replica, dead_reason or
                                  f"its process (pid {replica.process.pid}) exited with code "
                                  f"{replica.process.exitcode}")

    def _handle(self, replica: ReplicaHandle, message: Any) -> None:
        if isinstance(message, Deliveries):
            self._deliver(replica, message.items)
        elif isinstance(message, Reply):
            future = replica.calls.pop(message.call_id, None)
            if future is not None:
                if message.error is not None:
                    future.set_exception(as_exception(message.error, replica.index))
                else:
                    future.set_result(message.value)
        else:
            logger.error("data-parallel replica %d sent an unknown %s", replica.index,
                         type(message).__name__)

    def _deliver(self, replica: ReplicaHandle,
                 items: list[tuple[str, OutputDelta | GrowDelta | WireError | None]]) -> None:
        """Decode one message's deliveries and hand them to their requests' queues (those
        still listened to), with one wake-up of the event loop for all of them."""
        ready: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for request_id, item in items:
            if isinstance(item, (OutputDelta, tuple)):  # tuple: a GrowDelta
                out: Any = replica.decoder.decode(item)
            else:
                replica.decoder.forget(request_id)
                out = (as_exception(item, replica.index) if item is not None else
                       RequestFailedError(f"data-parallel replica {replica.index} ended the "
                                          "request"))
            stream = replica.streams.get(request_id)
            if stream is not None:
                ready.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in ready.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed: no one listens
                loop.call_soon_threadsafe(_put_all, batch)

    def _replica_stopped(self, replica: ReplicaHandle, reason: str) -> None:
        replica.dead_reason = f"data-parallel replica {replica.index} stopped: {reason}"
        logger.error("%s; its requests fail, the other replicas go on serving",
                     replica.dead_reason)
        self.balancer.mark_dead(replica.index)
        error = replica.dead_reason
        for stream in list(replica.streams.values()):
            stream.put(EngineDeadError(error))
        for future in list(replica.calls.values()):
            future.set_exception(EngineDeadError(error))
        replica.calls.clear()
        if all(r.dead_reason is not None for r in self.replicas) and self.on_all_dead:
            self.on_all_dead()

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every live replica and wait; each result or exception."""
        futures = [f for r in self.replicas if (f := self._call(r, method, *args)) is not None]
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        results = []
        for future in futures:
            try:
                results.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception as exc:
                results.append(exc)
        if not results:
            raise EngineDeadError(self.dead_reason or "no data-parallel replica is running")
        return results

    def _call(self, replica: ReplicaHandle, method: str,
              *args: Any) -> concurrent.futures.Future[Any] | None:
        """Send a ``Call``; the future of its reply, or None when the replica is gone."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        replica.calls[call_id] = future
        if not replica.send(Call(call_id, method, args)):
            replica.calls.pop(call_id, None)
            return None
        return future

    def _metrics_snapshots(self) -> list[list[Family]]:
        """Each replica's metric families; one that cannot answer in time gives those it
        gave last, so that totals do not drop, less its gauges once it has stopped (nothing
        runs or waits there, and it holds no KV cache)."""
        futures = [(replica, self._call(replica, "metrics")) for replica in self.replicas]
        deadline = time.monotonic() + _METRICS_TIMEOUT_S
        for replica, future in futures:
            if future is not None:
                try:
                    replica.last_metrics = future.result(
                        timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    logger.warning("no metrics from data-parallel replica %d", replica.index)
        return [replica.last_metrics if replica.dead_reason is None
                else without_gauges(replica.last_metrics) for replica in self.replicas]

    def _balancer_state(self) -> tuple[list[int], list[int], list[bool]]:
        b = self.balancer
        return list(b.routed), list(b.load), [r.dead_reason is None for r in self.replicas]


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream.push(item)


def _aborted(last: RequestOutput) -> RequestOutput:
    """The final output of a request aborted after ``last``: its unfinished sequences end
    with finish_reason "abort"."""
    return replace(last, finished=True, outputs=[
        seq if seq.finish_reason is not None else replace(seq, finish_reason="abort")
        for seq in last.outputs])


def _check_kv_connector_replicas(config: EngineConfig, num_replicas: int) -> None:
    """Refuse replicas that would share a connector made for one engine per role."""
    kv = config.kv_transfer_config
    if kv is None or num_replicas == 1:
        return
    from hitchllm.kv_transfer.connector import connector_class
    from hitchllm.plugins import get_plugin_registry

    if not connector_class(kv, get_plugin_registry()).replicas_may_share:
        raise ValueError(
            f"kv_connector {kv.kv_connector!r} pairs one producer with one consumer, so "
            f"data_parallel_size={num_replicas} replicas cannot share it: start one instance "
            "per GPU with its own kv_connector_extra_config.port (or use shared_memory, "
            "which replicas can share)")
