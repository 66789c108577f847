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
import signal
import traceback
from collections.abc import MutableSequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from hitchllm import distributed
from hitchllm.distributed import ParallelRank
from hitchllm.engine.runner_output import PendingOutput
from hitchllm.engine.worker import Worker, WorkerSetup, output_digest
from hitchllm.logger import init_logging

# Start-up and set-up calls (loading a shard, profiling memory, capturing graphs, compiling)
# may take minutes; only a worker that dies is detected sooner.
SETUP_TIMEOUT_S = 3600.0
# The driver's address (one host: the multiprocess executor's workers run beside it).
HOST = "127.0.0.1"


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
    """Answer the driver's calls in order. On CUDA a step is answered once the next step has
    been launched (so the device computes one step while this process prepares the next, as
    under async scheduling in one process) or when the driver asks for it (``flush``). On the
    CPU a launched step is already computed: it is answered at once (with pipeline stages the
    driver needs a step's tokens while the stages compute later steps)."""
    in_flight: PendingOutput | None = None
    answer_at_once = worker.device.type != "cuda"

    def answer_in_flight() -> None:
        nonlocal in_flight
        if in_flight is not None:
            pending, in_flight = in_flight, None
            conn.send(_step_answer(worker, pending))

    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return  # the driver is gone
        calls_taken[worker.rank.global_rank] += 1
        if method == "execute_model":
            try:
                launched = worker.launch_step(*args)
            except Exception as exc:
                answer_in_flight()
                conn.send(exception_reply(exc))
                continue
            answer_in_flight()
            in_flight = launched
            if answer_at_once:
                answer_in_flight()
            continue
        answer_in_flight()
        if method == "flush":
            continue
        if method == "shutdown":
            worker.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as exc:
            conn.send(exception_reply(exc))


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
