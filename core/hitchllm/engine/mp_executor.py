"""The multiprocess executor: one worker process per rank on this host (tensor-parallel
ranks x pipeline stages; ``hitchllm.distributed`` describes the rank layout).

Start-up: the engine's process (the driver) opens the rendezvous store of the process group
and spawns one process per rank (``spawn``: no forked CUDA or thread state), which runs
``hitchllm.engine.worker_process.worker_main``: it joins the group (NCCL on CUDA, gloo on the
CPU), loads its shard of the model through the weight loaders, builds its runner
(``hitchllm.engine.worker.Worker``) and reports ready or its error. The driver never loads
the model: it keeps the tokenizer, the scheduler and the KV manager.

Each step the driver pickles the ``StepPlan`` once (plain data: ids, token ids, block ids,
sampling parameters; no tensors) and writes the bytes to every worker's pipe. Every rank runs
the step; rank 0 answers with its ``RunnerOutput`` (plain lists), every other rank with a
digest of its sampled tokens, checked against rank 0's. The driver does not wait when it
launches a step, so it schedules the next step while the workers compute this one; a CUDA
worker answers a step once it has launched the next (its device is never idle while it
prepares a step) or when the driver asks for the answer (``flush``: no next step is coming
first); a CPU worker has computed a step when it launched it and answers at once. A
pipeline stage's worker answers each step from a thread of its own as soon as the step's
output is ready (``worker_process.serve``).

Pipeline stages: only the last stage samples; its tensor-parallel rank 0 answers, its other
ranks send digests and the earlier stages answer None. The earlier stages need a request's
tokens before it runs again (they embed them, or keep them as their request states): the
driver sends every token it has read with the next plan (``fed_tokens``). Several steps may be
in flight (the engine's micro-batches: stage 0 computes step n+1 while stage 1 computes step
n), as long as they hold disjoint requests: a plan that schedules a request of a step whose
answer has not been read is refused (``ValueError``), as the earlier stages could not know
its input token. Each rank runs the plans in the order sent and answers them in that order.

Failures: while it waits for answers the driver also watches every worker's process: a worker
that exits is reported by rank at once, and ranks that do not answer within
``worker_step_timeout_s`` are reported as hung; either way the executor stops every worker and
raises ``WorkerFailedError``, which ends the engine. An exception inside a rank's step is
raised in the driver as that exception (with the rank's traceback as a note), so the engine
treats it like a failed step of its own.

Shutdown: ``close`` asks every worker to stop, then terminates (and at last kills) any that
does not; it runs at garbage collection and at interpreter exit too. A worker whose pipe to the
driver closes (the driver died) exits by itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from hitchllm.attention import KVCacheSpec, bytes_per_shared_block
from hitchllm.distributed import ParallelRank
from hitchllm.engine.executor import (
    LazyStepOutput,
    RunnerOutputFuture,
    WorkerFailedError,
    WorkerGroupExecutor,
)
from hitchllm.engine.runner_output import RunnerOutput
from hitchllm.engine.worker import WorkerSetup, output_digest
from hitchllm.engine.worker_process import HOST, SETUP_TIMEOUT_S, worker_main
from hitchllm.scheduler.step_plan import StepPlan

# How long ``close`` waits for workers to stop by themselves before terminating them.
SHUTDOWN_GRACE_S = 5.0

logger = logging.getLogger(__name__)


@dataclass
class _Workers:
    """The worker processes and the driver's ends of their pipes, rank order. Kept apart
    from the executor so that its finalizer can stop them without keeping it alive."""

    processes: list[BaseProcess] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    # The rendezvous store (its server thread runs in the driver), dropped once the workers
    # are gone rather than at interpreter teardown.
    store: dist.TCPStore | None = None

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Ask every worker to stop; terminate, then kill, those still running after
        ``grace_s``; close the pipes. Idempotent."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that worker is gone already
                conn.send_bytes(pickle.dumps(("shutdown", ())))
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()  # also ends a stopped (SIGSTOP) process
                process.join()
        for conn in self.conns:
            conn.close()
        self.processes, self.conns, self.store = [], [], None


class MultiprocExecutor(WorkerGroupExecutor):
    """Runs each step on ``tensor_parallel_size`` worker processes (see the module doc)."""

    def __init__(self, setup: WorkerSetup) -> None:
        config = setup.config
        self.tp_size = config.tensor_parallel_size
        self.pp_size = config.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self._ranks = [ParallelRank.of(r, self.tp_size, self.pp_size)
                       for r in range(self.world_size)]
        # The rank whose output the driver reads: tensor-parallel rank 0 of the last stage.
        self._answering = next(r for r, rank in enumerate(self._ranks) if rank.answers)
        # Tokens the last stage sampled that the earlier stages have not been sent yet.
        self._unfed: dict[str, list[int]] = {}
        # With pipeline stages: the request ids of each step whose answer was not read yet.
        self._unread_ids: dict[int, list[str]] = {}
        # The most steps sent to the workers at once whose answers the driver had not read.
        self.max_unread_steps = 0
        self.step_timeout_s = config.worker_step_timeout_s
        self._launched = 0  # steps sent to the workers
        self._flushed = False  # whether the workers were asked to answer the last one
        self._collected = 0  # steps whose answers were read
        self._outputs: dict[int, RunnerOutput] = {}
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.stop)
        # The rendezvous store lives in the driver: its port is chosen when it binds.
        store = dist.TCPStore(HOST, 0, self.world_size + 1, is_master=True,
                              wait_for_workers=False)
        self._workers.store = store
        context = mp.get_context("spawn")
        num_threads = max(1, torch.get_num_threads() // self.world_size)
        # Calls each rank has read from its pipe (shared memory, written by the workers).
        self._calls_taken = context.RawArray("q", self.world_size)
        try:
            for r, rank in enumerate(self._ranks):
                ours, theirs = context.Pipe()
                name = (f"hitchllm-tp{r}" if self.pp_size == 1
                        else f"hitchllm-pp{rank.pp_rank}-tp{rank.tp_rank}")
                process = context.Process(
                    target=worker_main, name=name,
                    args=(setup, rank, theirs, store.port, num_threads, self._calls_taken))
                process.start()
                theirs.close()  # the worker holds it now; our copy would hide its exit
                self._workers.processes.append(process)
                self._workers.conns.append(ours)
            specs = self._receive("start-up", SETUP_TIMEOUT_S, fail_fast=True)
        except BaseException:
            self.close()
            raise
        # Each stage caches its own layers; one block table serves them all, so a block is
        # sized by the stage whose layers need the most bytes per block.
        self._kv_cache_specs: list[KVCacheSpec] = max(specs, key=bytes_per_shared_block)
        logger.info("%d workers ready (%d tensor-parallel x %d pipeline stages; pids %s)",
                    self.world_size, self.tp_size, self.pp_size,
                    ", ".join(str(p.pid) for p in self._workers.processes))

    # ---- calls on every rank -----------------------------------------------------------

    def _send(self, method: str, *args: Any) -> None:
        self._check_running()
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._workers.conns):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                self._check_alive(range(self.world_size), f"sending {method}")
                self._fail(f"could not reach {self._ranks[rank].describe()}: {exc}", rank)

    def _receive(self, what: str, timeout_s: float, fail_fast: bool = False) -> list[Any]:
        """One answer from every rank, rank order. A rank that died or does not answer in
        ``timeout_s`` stops the executor (``WorkerFailedError``). An exception a rank raised
        is raised here (the lowest rank's, with its traceback as a note): once every rank has
        answered, or at once with ``fail_fast`` (set-up calls; the workers are stopped then,
        since ranks that wait in a collective for the failed one would never answer)."""
        self._check_running()
        pending = dict(enumerate(self._workers.conns))
        answers: list[Any] = [None] * self.world_size
        errors: list[tuple[int, BaseException, str]] = []
        deadline = time.monotonic() + timeout_s
        processes = self._workers.processes
        while pending and not (errors and fail_fast):
            # A rank that answered and then exited is reported by the next call.
            ready = wait([*pending.values(), *(processes[r].sentinel for r in pending)],
                         timeout=max(0.0, deadline - time.monotonic()))
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, *value = conn.recv()
                except (EOFError, OSError):
                    continue  # it died; reported below
                del pending[rank]
                if status == "ok":
                    answers[rank] = value[0]
                else:
                    errors.append((rank, value[0], value[1]))
            if errors and fail_fast:
                break
            self._check_stalling_stage(errors, pending, what)
            self._check_alive(pending, what)
            if not ready:
                self._fail_hung(list(pending), what, timeout_s)
        if errors:
            rank, exc, text = min(errors, key=lambda e: e[0])
            if fail_fast:
                self.close()
            exc.add_note(f"raised by {self._ranks[rank].describe()} in {what}; its traceback:\n"
                         f"{text}")
            raise exc
        return answers

    def _check_stalling_stage(self, errors: list[tuple[int, BaseException, str]],
                              pending: dict[int, Connection], what: str) -> None:
        """A rank of a stage before the last that raised in a step never sends its
        activations on: the later stages would wait for them until the step timeout. Fail at
        once, naming it (its traceback goes to the log)."""
        for rank, exc, text in errors:
            if not self._ranks[rank].is_last_stage and pending:
                logger.error("%s raised in %s:\n%s", self._ranks[rank].describe(), what, text)
                self._fail(f"{self._ranks[rank].describe()} raised {type(exc).__name__} in "
                           f"{what} ({exc}); the later pipeline stages wait for its "
                           "activations", rank)

    def _fail_hung(self, pending: list[int], what: str, timeout_s: float) -> None:
        """Ranks that have not even read the call are the hung ones; the others wait for
        them in a collective. When all have read it, every silent rank is named."""
        taken = list(self._calls_taken)
        behind = [r for r in pending if taken[r] < max(taken)]
        waiting = [r for r in pending if r not in behind]
        if behind:
            message = (f"{self._noun}(s) {self._names(behind)} stopped taking calls and did "
                       f"not answer {what} within {timeout_s:g} s (hung)")
            if waiting:
                message += f"; rank(s) {self._names(waiting)} wait for them in a collective"
        else:
            message = (f"{self._noun}(s) {self._names(pending)} did not answer {what} "
                       f"within {timeout_s:g} s (hung, or waiting in a collective for a rank "
                       "that is)")
        self._fail(message + "; raise worker_step_timeout_s if steps are this slow",
                   (behind or pending)[0])

    def _check_running(self) -> None:
        if not self._workers.conns:
            raise WorkerFailedError("the tensor-parallel workers are stopped (the executor "
                                    "was closed or a worker failed); start a new engine")

    def _check_alive(self, ranks: Iterable[int], what: str) -> None:
        """Fail if one of ``ranks`` has exited."""
        for rank in ranks:
            process = self._workers.processes[rank]
            code = process.exitcode
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                hint = ("; its error is printed above (a script that builds the engine when it "
                        "is imported needs an `if __name__ == \"__main__\":` guard: workers "
                        "start with spawn, which imports the main module)"
                        if what == "start-up" else "")
                self._fail(f"{self._ranks[rank].describe()} (pid {process.pid}) died in {what} "
                           f"({how}){hint}", rank)

    def _fail(self, message: str, rank: int | None) -> None:
        logger.error("%s; stopping every worker", message)
        # The others are likely stuck in a collective with the failed rank: no grace period.
        self._workers.stop(grace_s=0.0)
        self.close()
        raise WorkerFailedError(message + "; the engine cannot go on", rank)

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Run a set-up ``method`` on every rank; every rank's answer, in rank order."""
        self._send(method, *args)
        return self._receive(method, SETUP_TIMEOUT_S, fail_fast=True)

    # ---- the Executor interface --------------------------------------------------------

    def execute_model(self, step: StepPlan) -> RunnerOutputFuture:
        self.check_plain(step)
        fed: dict[str, list[int]] = {}
        if self.pp_size > 1:
            self._check_disjoint(step)
            fed, self._unfed = self._unfed, {}
            self._unread_ids[self._launched] = step.request_ids
        self._send("execute_model", step, fed)
        self._launched += 1
        self.max_unread_steps = max(self.max_unread_steps, self._launched - self._collected)
        self._flushed = False
        return LazyStepOutput(self._step_output, self._launched - 1)

    def _check_disjoint(self, step: StepPlan) -> None:
        """Pipeline stages: refuse a plan with a request of a step still in flight."""
        unread = {rid for ids in self._unread_ids.values() for rid in ids}
        clash = [rid for rid in step.request_ids if rid in unread]
        if clash:
            raise ValueError(
                f"request(s) {clash[:5]} are scheduled while a step in flight still computes "
                "them; with pipeline stages the earlier stages need a request's tokens before "
                "it runs again: read that step's output first (steps in flight must hold "
                "disjoint requests)")

    def _step_output(self, index: int) -> RunnerOutput:
        """Step ``index``'s output; reads the answers of earlier steps first (those not asked
        for by then are dropped: steps complete in launch order)."""
        if index == self._launched - 1 and not self._flushed:
            # No later step will make the workers answer this one: ask for it.
            self._send("flush")
            self._flushed = True
        while self._collected <= index:
            step = self._collected
            self._collected += 1  # read even when it raises: the next answers are the next step's
            self._unread_ids.pop(step, None)
            answers = self._receive(f"step {step}", self.step_timeout_s)
            output: RunnerOutput = answers[self._answering]
            digest = output_digest(output)
            for rank, other in enumerate(answers):
                if self._ranks[rank].is_last_stage and other is not output and other != digest:
                    self._fail(f"{self._ranks[rank].describe()} sampled other tokens than "
                               f"{self._ranks[self._answering].describe()} in step {step} "
                               "(the ranks' logits differ)", rank)
            if self.pp_size > 1:
                for rid, tokens in output.sampled.items():
                    self._unfed.setdefault(rid, []).extend(tokens)
            self._outputs[step] = output
        for old in [i for i in self._outputs if i < index]:
            del self._outputs[old]
        return self._outputs.pop(index)

    def close(self) -> None:
        self._finalizer()

    @property
    def _noun(self) -> str:
        return "tensor-parallel rank" if self.pp_size == 1 else "rank"

    def _names(self, ranks: list[int]) -> str:
        if self.pp_size == 1:
            return ", ".join(str(r) for r in ranks)
        return ", ".join(f"{r} (pipeline stage {self._ranks[r].pp_rank}, tensor-parallel rank "
                         f"{self._ranks[r].tp_rank})" for r in ranks)

    @property
    def stage_names(self) -> list[str]:
        """How each rank is named, rank order (``rank 1 (pipeline stage 1, ...)``)."""
        return [rank.describe() for rank in self._ranks]

    def timeline_marks(self) -> list[list[Any]]:
        """Each rank's step-timeline marks since the last call (``hitchllm.timeline``; empty
        lists unless ``HITCHLLM_STEP_TIMELINE=1`` was set when the workers started)."""
        return self._call("timeline_marks")

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank order (empty once closed)."""
        return [p.pid for p in self._workers.processes if p.pid is not None]



