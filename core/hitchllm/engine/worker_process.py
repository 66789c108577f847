"""A worker process (one tensor-parallel rank of one pipeline stage): the loop that answers
the multiprocess executor.

The executor (``hitchllm.engine.mp_executor``) starts ``worker_main`` in one process per rank.
It joins the process group through the driver's rendezvous store, loads the rank's shard
(``Worker.load``) and reports ready with its KV-cache specs; then it answers calls read from
its pipe, in order: ``("execute_model", (plan, fed_tokens))``, ``("flush", ())``,
``("shutdown", ())``, or the name of a ``Worker`` set-up method. Every answer is ``("ok",
value)`` or ``("error", exception, traceback text)``.
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import MutableSequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from hitchllm import distributed, timeline
from hitchllm.distributed import ParallelRank
from hitchllm.engine.runner_output import PendingOutput
from hitchllm.engine.worker import Worker, WorkerSetup, output_digest
from hitchllm.logger import init_logging

# Start-up and set-up calls (loading a shard, profiling memory, capturing graphs, compiling)
# may take minutes; only a worker that dies is detected sooner.
SETUP_TIMEOUT_S = 3600.0
# The driver's address (one host: the multiprocess executor's workers run beside it).
HOST = "127.0.0.1"
# How long a stopping worker waits for its answer thread to send what is queued.
SHUTDOWN_SEND_S = 5.0


def exception_reply(exc: BaseException) -> tuple[str, BaseException, str]:
    """``("error", exception, traceback)``; an exception that cannot be pickled travels as a
    ``RuntimeError`` with its type and message."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return "error", exc, text


def worker_main(
    setup: WorkerSetup, rank: ParallelRank, conn: Connection, store_port: int,
    num_threads: int, calls_taken: MutableSequence[int],
) -> None:
    """A worker process: join the group, load the shard, then answer calls until told to
    stop or until the driver's end of the pipe closes. ``calls_taken[rank]`` (shared memory)
    counts the calls it has read, so that the driver can tell a rank that stopped taking
    calls from ranks waiting for it in a collective."""
    # Ctrl-C in a terminal reaches the whole process group: the driver decides when workers
    # stop (it tells them, or its pipe closes), not a traceback in every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_logging()
    if rank.global_rank:  # one copy of the start-up log is enough
        logging.getLogger("hitchllm").setLevel(logging.WARNING)
    torch.set_num_threads(num_threads)
    try:
        store = dist.TCPStore(HOST, store_port, is_master=False)
        worker = Worker(setup, rank)
        worker.init_distributed(store, SETUP_TIMEOUT_S)
        worker.load()
        timeline.start(rank.describe(), worker.device)
        conn.send(("ok", worker.runner.kv_cache_specs))
    except BaseException as exc:
        conn.send(exception_reply(exc))
        return
    try:
        serve(worker, conn, calls_taken)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone: nobody is left to answer
    finally:
        distributed.destroy_distributed()


def serve(worker: Worker, conn: Connection, calls_taken: MutableSequence[int]) -> None:
    """Answer the driver's calls in order.

    When a step is answered: with pipeline stages, as soon as its output is ready: a thread
    of the worker's own waits for each launched step and sends its answer while this thread
    goes on taking and launching plans, so that the driver gets micro-batch k's tokens
    while the device still computes k + 1 (and schedules k + 2 meanwhile). Without stages,
    on CUDA a step is answered once the next step has been launched (so the device computes
    one step while this process prepares the next, as under async scheduling in one
    process; the next plan may hold the same requests, whose states the answer advances) or
    when the driver asks for it (``flush``); on the CPU a launched step is already computed
    and is answered at once."""
    sender = _AnswerSender(worker, conn)
    in_flight: tuple[int, PendingOutput] | None = None
    answer_at_once = worker.device.type != "cuda" or sender.threaded

    def answer_in_flight() -> None:
        nonlocal in_flight
        if in_flight is not None:
            (step, pending), in_flight = in_flight, None
            sender.answer_step(step, pending)

    try:
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except EOFError:
                return  # the driver is gone
            calls_taken[worker.rank.global_rank] += 1
            if method == "execute_model":
                step = worker.runner.num_steps
                if timeline.ACTIVE is not None:
                    timeline.ACTIVE.mark("plan_received", step)
                try:
                    launched = worker.launch_step(*args)
                except Exception as exc:
                    answer_in_flight()
                    sender.reply(exception_reply(exc))
                    continue
                answer_in_flight()
                in_flight = step, launched
                if answer_at_once:
                    answer_in_flight()
                continue
            answer_in_flight()
            if method == "flush":
                continue
            if method == "shutdown":
                worker.close()
                sender.reply(("ok", None))
                return
            try:
                sender.reply(("ok", getattr(worker, method)(*args)))
            except Exception as exc:
                sender.reply(exception_reply(exc))
    finally:
        sender.close()


class _AnswerSender:
    """Sends a worker's answers to the driver, in call order: from the calling thread, or
    (pipeline stages) from a thread of its own that waits for each step's output, so that
    the thread taking plans never waits for the device. Its waits only advance the request
    states of the step it reads: the engine keeps the requests of steps in flight apart
    (micro-batches), and a plan with one of them comes only after the driver has read that
    step's answer."""

    def __init__(self, worker: Worker, conn: Connection) -> None:
        self._worker = worker
        self._conn = conn
        self.threaded = worker.rank.pp_size > 1
        self._queue: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="hitchllm-answers",
                                            daemon=True)
            self._thread.start()

    def answer_step(self, step: int, pending: PendingOutput) -> None:
        """Send step ``step``'s answer once its output is ready."""
        if self._thread is None:
            self._send_step(step, pending)
        else:
            self._queue.put((step, pending))

    def reply(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` after every answer before it."""
        if self._thread is None:
            self._conn.send(message)
        else:
            self._queue.put((-1, message))

    def close(self) -> None:
        """Send what is queued (a driver that is gone is not waited for)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(SHUTDOWN_SEND_S)
            self._thread = None

    def _send_step(self, step: int, pending: PendingOutput) -> None:
        message = _step_answer(self._worker, pending)
        tl = timeline.ACTIVE
        if tl is not None:
            tl.mark("result_ready", step)
        self._conn.send(message)
        if tl is not None:
            tl.mark("answer_sent", step)

    def _run(self) -> None:
        if self._worker.device.type == "cuda":
            torch.cuda.set_device(self._worker.device)
        try:
            while (item := self._queue.get()) is not None:
                step, value = item
                if step < 0:
                    self._conn.send(value)
                else:
                    self._send_step(step, value)
        except OSError:
            pass  # the driver is gone: nobody is left to answer


def _step_answer(worker: Worker, pending: PendingOutput) -> tuple[Any, ...]:
    """The answering rank's output of a step (tensor-parallel rank 0 of the last pipeline
    stage), another rank of that stage's digest of it, None from an earlier stage (or the
    step's error)."""
    try:
        output = pending.result()
    except Exception as exc:
        return exception_reply(exc)
    rank = worker.rank
    if rank.answers:
        return "ok", output
    return "ok", output_digest(output) if rank.is_last_stage else None
