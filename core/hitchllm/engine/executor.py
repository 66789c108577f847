"""Executors: what stands between the engine and the model runner(s).

The engine hands an executor plain data (a ``StepPlan``, a number of KV blocks) and gets
plain data back (a ``RunnerOutput``), so the runners may live in this process, in worker
processes (torch.distributed) or on Ray actors. The in-process executor runs one
``Worker`` in the engine's process; the multiprocess executor (``hitchllm.engine.mp_executor``)
runs one per tensor-parallel rank in worker processes.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from hitchllm.attention import KVCacheSpec
from hitchllm.engine.model_runner import ModelRunner
from hitchllm.engine.runner_output import RunnerOutput
from hitchllm.engine.worker import Worker
from hitchllm.scheduler.step_plan import StepPlan


class WorkerFailedError(RuntimeError):
    """A worker of a distributed executor died, hung or failed: the engine cannot go on.

    ``rank`` is the failed worker's rank (None when no single rank is to blame)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class RunnerOutputFuture(Protocol):
    """A launched step's output."""

    def result(self) -> RunnerOutput:
        """Wait for the step and return its output; later calls return the same output."""
        ...



class LazyStepOutput:
    """Step ``index``'s output, read through ``read(index)`` when first asked for (the
    distributed executors read their workers' answers on demand)."""

    def __init__(self, read: Callable[[int], RunnerOutput], index: int) -> None:
        self._read = read
        self._index = index
        self._output: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._output is None:
            self._output = self._read(self._index)
        return self._output


class Executor(abc.ABC):
    """Runs step plans on the model runner(s) of one engine.

    Set-up order, as for a runner: ``kv_cache_bytes`` (CUDA, to size the KV cache),
    ``initialize_kv_cache``, ``warm_up``, then ``capture_cuda_graphs`` when graphs are
    wanted. ``close`` releases what the executor holds (worker processes); the engine calls
    it when it closes.
    """

    @property
    @abc.abstractmethod
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What each attention layer caches per token, in layer order (on one runner: with
        tensor parallelism, each runner's share)."""

    @abc.abstractmethod
    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        """CUDA: the bytes each runner may give its KV cache, ``gpu_memory_utilization`` of
        its card less what its process needs at the peak of a profiled worst-case step (the
        smallest over the runners)."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> float | None:
        """Allocate every runner's KV cache with ``num_blocks`` blocks, and with
        ``num_host_blocks`` a host pool of that many blocks per runner (swap preemption);
        returns then the seconds to swap one block out and back in (the slowest runner's)."""

    @abc.abstractmethod
    def warm_up(self) -> None:
        """Run every runner's start-up steps (``ModelRunner.warm_up``; after
        ``initialize_kv_cache``). The engine calls it on CUDA only."""

    @abc.abstractmethod
    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs (after ``initialize_kv_cache``); a no-op off CUDA."""

    @abc.abstractmethod
    def execute_model(self, step: StepPlan) -> RunnerOutputFuture:
        """Launch ``step`` on every runner and return at once; the future's ``result()``
        gives the step's output. Steps run in the order they are launched."""

    def close(self) -> None:  # noqa: B027 (nothing to release in-process)
        """Release the runners (stop worker processes); later calls do nothing."""


class InProcessExecutor(Executor):
    """One worker (rank 0 of a world of 1) in the engine's own process.

    With ``forward_thread`` (the CPU, where a launched step would otherwise be computed
    before ``execute_model`` returns) each step runs on a worker thread of its own, launch
    and read-back together, in launch order: the engine's thread schedules the next step and
    builds outputs meanwhile (torch's operators release the GIL while they compute). Only
    that thread touches the runner once steps run.
    """

    def __init__(self, worker: Worker, forward_thread: bool = False) -> None:
        self.worker = worker
        self._thread: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="hitchllm-forward")
            if forward_thread else None)

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.runner.kv_cache_specs

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        return self.worker.kv_cache_bytes(gpu_memory_utilization)

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> float | None:
        return self.runner.initialize_kv_cache(num_blocks, num_host_blocks)

    def warm_up(self) -> None:
        self.runner.warm_up()

    def capture_cuda_graphs(self) -> None:
        self.runner.capture_cuda_graphs()

    def execute_model(self, step: StepPlan) -> RunnerOutputFuture:
        if self._thread is None:
            return self.runner.execute_async(step)
        return ThreadStepOutput(self._thread.submit(self._run_step, step))

    def _run_step(self, step: StepPlan) -> RunnerOutput:
        return self.runner.execute_async(step).result()

    def close(self) -> None:
        if self._thread is not None:
            # A step under way finishes first (unless the engine is collected on that very
            # thread, which cannot wait for itself).
            on_worker = threading.current_thread().name.startswith("hitchllm-forward")
            self._thread.shutdown(wait=not on_worker)
            self._thread = None
        self.worker.close()


class ThreadStepOutput:
    """A step running on the in-process executor's worker thread; ``result()`` waits for it
    (and raises what the step raised)."""

    def __init__(self, future: Future[RunnerOutput]) -> None:
        self._future = future

    def result(self) -> RunnerOutput:
        return self._future.result()


class WorkerGroupExecutor(Executor):
    """What the multiprocess and Ray executors share: set-up calls go to every rank through
    ``_call``, and a step plan must be plain data (no tensors)."""

    _kv_cache_specs: list[KVCacheSpec]  # set by the subclass once its workers are up

    @abc.abstractmethod
    def _call(self, method: str, *args: object) -> list:
        """Run the ``Worker`` set-up ``method`` on every rank; the answers in rank order."""

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self._kv_cache_specs

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        return min(self._call("kv_cache_bytes", gpu_memory_utilization))

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> float | None:
        times = self._call("initialize_kv_cache", num_blocks, num_host_blocks)
        return max(times) if num_host_blocks else None

    def warm_up(self) -> None:
        self._call("warm_up")

    def capture_cuda_graphs(self) -> None:
        self._call("capture_cuda_graphs")

    @staticmethod
    def check_plain(step: StepPlan) -> None:
        """Refuse a plan the workers cannot be sent: draft probabilities are tensors."""
        if step.draft_probs:
            raise ValueError("draft probabilities (speculative decoding) cannot be sent to "
                             "tensor-parallel workers yet")
