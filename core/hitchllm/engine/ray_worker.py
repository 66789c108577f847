"""A tensor-parallel rank on a Ray actor: what the Ray executor's actors run.

``RayWorker`` is a plain class; the executor (``hitchllm.engine.ray_executor``) makes it an
actor with ``ray.remote`` and starts one per rank in a bundle of its placement group. The
actor joins the process group through a ``TCPStore`` that rank 0's actor serves on its node
(the driver picks the address: rank 0's node IP and a port free there), loads the rank's shard
(``Worker.load``) and then runs the calls the driver sends, in order, like the multiprocess
executor's worker processes. Every answer is ``("ok", value)`` or ``("error", exception,
traceback text)``; only a dead actor (``ray.exceptions.RayActorError``) reaches the driver
otherwise.

This module imports nothing from Ray, so that it loads where Ray is not installed.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from hitchllm.attention import KVCacheSpec
from hitchllm.distributed import ParallelRank
from hitchllm.engine.runner_output import PendingOutput
from hitchllm.engine.worker import Worker, WorkerSetup, output_digest
from hitchllm.engine.worker_process import SETUP_TIMEOUT_S, exception_reply
from hitchllm.logger import init_logging
from hitchllm.scheduler.step_plan import StepPlan

Answer = tuple[Any, ...]


class RayWorker:
    """One rank of a tensor-parallel engine, hosted by a Ray actor.

    ``env`` (the driver's ``HITCHLLM_*`` variables, and ``TRITON_CACHE_DIR``/``TRITON_HOME``
    where the user set them) is set before anything is loaded, so that a rank on another node
    selects the same plugins and log level as the driver and keeps Triton's compiles where
    the user asked.
    """

    def __init__(self, setup: WorkerSetup, rank: ParallelRank, env: dict[str, str]) -> None:
        os.environ.update(env)
        init_logging()
        if rank.global_rank:  # one copy of the start-up log is enough
            logging.getLogger("hitchllm").setLevel(logging.WARNING)
        self.setup = setup
        self.rank = rank
        # Ray shows an actor only the card of its bundle (CUDA_VISIBLE_DEVICES), as cuda:0.
        device = torch.device("cuda", 0) if setup.device.type == "cuda" else setup.device
        self.worker = Worker(setup, rank, device=device)
        # The launched step whose answer is not sent yet (or the error its launch raised).
        self._in_flight: PendingOutput | BaseException | None = None

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP address and a TCP port free on it (asked of rank 0's actor: the
        process group's store runs there)."""
        import ray  # in an actor, Ray is there

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, host: str, port: int) -> Answer:
        """Join the process group through the store at ``host:port`` (rank 0 serves it) and
        load this rank's shard; answers the runner's KV-cache specs."""
        try:
            store = dist.TCPStore(host, port, self.rank.world_size,
                                  is_master=self.rank.global_rank == 0,
                                  wait_for_workers=False)
            self.worker.init_distributed(store, SETUP_TIMEOUT_S)
            self.worker.load()
            specs: list[KVCacheSpec] = self.worker.runner.kv_cache_specs
            return "ok", specs
        except Exception as exc:
            return exception_reply(exc)

    def call(self, method: str, *args: Any) -> Answer:
        """Run the ``Worker`` set-up ``method`` (``kv_cache_bytes``, ``initialize_kv_cache``,
        ``warm_up``, ``capture_cuda_graphs``; before any step)."""
        try:
            return "ok", getattr(self.worker, method)(*args)
        except Exception as exc:
            return exception_reply(exc)

    def execute_model(self, plan: StepPlan) -> Answer | None:
        """Launch ``plan``, then answer the step launched before it (None when there is
        none in flight): the device computes this step while the last one's tokens go back."""
        previous = self._in_flight
        try:
            self._in_flight = self.worker.launch_step(plan)
        except Exception as exc:
            self._in_flight = exc  # this step's answer, sent when it is asked for
        return None if previous is None else self._answer(previous)

    def flush(self) -> Answer | None:
        """Answer the step in flight (None when there is none)."""
        previous, self._in_flight = self._in_flight, None
        return None if previous is None else self._answer(previous)

    def _answer(self, launched: PendingOutput | BaseException) -> Answer:
        """Rank 0's output of a step, another rank's digest of it, or the step's error."""
        if isinstance(launched, BaseException):
            return exception_reply(launched)
        try:
            output = launched.result()
        except Exception as exc:
            return exception_reply(exc)
        return "ok", output if self.rank.global_rank == 0 else output_digest(output)
