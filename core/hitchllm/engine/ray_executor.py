"""The Ray executor: one Ray actor per tensor-parallel rank, on one host or across a cluster.

Start-up: the engine's process (the driver) joins a Ray cluster: the one it is already
connected to, the one ``RAY_ADDRESS`` names or one running on this host (``ray start``), or else
a local one it starts (and stops at ``close``). It reserves a placement group with one bundle
per rank (``{"GPU": 1}`` on CUDA, ``{"CPU": 1}`` on the CPU), placed by
``ray_placement_strategy`` (``STRICT_PACK``, the default: every rank on one node), and fails
with what the cluster has when the group is not granted within ``ray_placement_timeout_s``.
Each rank is a ``hitchllm.engine.ray_worker.RayWorker`` actor in its bundle; rank 0's actor
names its node's IP and a free port, where it serves the store through which every rank
joins the process group (NCCL on CUDA, gloo on the CPU). Each actor then loads its shard; the
driver never loads the model.

Each step the driver puts the ``StepPlan`` in Ray's object store once (``ray.put``) and
passes the reference to every actor, which launches the step and answers the step before
(so the device computes while the tokens travel), or answers on ``flush`` when no next step
comes first. Rank 0 answers with its ``RunnerOutput``; the other ranks with a digest of
their tokens, checked against rank 0's.

Failures: an actor that dies (``ray.exceptions.RayActorError``) is reported by rank; ranks
that do not answer within ``worker_step_timeout_s`` are reported as hung. Either way the
executor kills every actor and raises ``WorkerFailedError``. An exception inside a rank's
step is raised in the driver as that exception, with the rank's traceback as a note.

Shutdown: ``close`` kills the actors and removes the placement group (and stops the Ray
instance the executor started); it runs at garbage collection and at interpreter exit too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hitchllm.attention import KVCacheSpec
from hitchllm.distributed import ParallelRank
from hitchllm.engine.executor import (
    LazyStepOutput,
    RunnerOutputFuture,
    WorkerFailedError,
    WorkerGroupExecutor,
)
from hitchllm.engine.runner_output import RunnerOutput
from hitchllm.engine.worker import WorkerSetup, output_digest
from hitchllm.engine.worker_process import SETUP_TIMEOUT_S
from hitchllm.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)

# What else to try when a strict placement strategy is not granted.
_STRATEGY_HINTS = {
    "STRICT_PACK": ", or place ranks on several nodes with ray_placement_strategy='PACK' or "
                   "'SPREAD'",
    "STRICT_SPREAD": ", or let nodes hold several ranks with ray_placement_strategy='SPREAD'",
}


def import_ray() -> ModuleType:
    """The ``ray`` module, or an ``ImportError`` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            "pip install 'hitchllm[ray]' (or use distributed_executor_backend='mp', worker "
            "processes on this host)") from exc
    return ray


def connect(ray: ModuleType) -> bool:
    """Join a Ray cluster: the one this process is connected to, the one ``RAY_ADDRESS``
    names, one started on this host with ``ray start``, or else a new local one. True when
    a local one was started here (the caller stops it)."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # RAY_ADDRESS says where
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:  # no cluster runs on this host
        logger.info("no Ray cluster is running (RAY_ADDRESS is unset): starting a local one")
        ray.init(include_dashboard=False)
        return True


@dataclass
class _Actors:
    """The actors, their placement group and whether the Ray instance is ours. Kept apart
    from the executor so that its finalizer can stop them without keeping it alive."""

    ray: ModuleType
    actors: list[Any] = field(default_factory=list)
    placement_group: Any = None
    owns_ray: bool = False

    def stop(self) -> None:
        """Kill the actors, remove the placement group, stop a Ray instance started here.
        Idempotent; a no-op once Ray itself has shut down (at interpreter exit)."""
        ray = self.ray
        actors, group = self.actors, self.placement_group
        self.actors, self.placement_group = [], None
        if not ray.is_initialized():
            return
        for actor in actors:
            with contextlib.suppress(Exception):  # it is gone already
                ray.kill(actor, no_restart=True)
        if group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)
        if self.owns_ray:
            self.owns_ray = False
            ray.shutdown()


class RayExecutor(WorkerGroupExecutor):
    """Runs each step on ``tensor_parallel_size`` Ray actors (see the module doc)."""

    def __init__(self, setup: WorkerSetup) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hitchllm.engine.ray_worker import RayWorker

        config = setup.config
        self.world_size = config.tensor_parallel_size
        self.step_timeout_s = config.worker_step_timeout_s
        self._launched = 0  # steps sent to the actors
        self._in_flight: int | None = None  # the step the actors answer at the next call
        self._answers: dict[int, list[Any]] = {}  # refs to each step's answers, rank order
        self._collected = 0  # steps whose answers were read
        self._outputs: dict[int, RunnerOutput] = {}
        self._pids: list[int] = []  # the actors' process ids, rank order
        self._state = _Actors(ray)
        self._finalizer = weakref.finalize(self, self._state.stop)
        on_gpu = setup.device.type == "cuda"
        try:
            self._state.owns_ray = connect(ray)
            bundle = {"GPU": 1.0} if on_gpu else {"CPU": 1.0}
            group = self._reserve(bundle, config.ray_placement_strategy,
                                  config.ray_placement_timeout_s)
            # The engine's settings, and where the user keeps Triton's compiles.
            env = {k: v for k, v in os.environ.items()
                   if k.startswith("HITCHLLM_") or k in ("TRITON_CACHE_DIR", "TRITON_HOME")}
            actor_class = ray.remote(RayWorker)
            for r in range(self.world_size):
                self._state.actors.append(actor_class.options(
                    num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=r),
                ).remote(setup, ParallelRank(tp_rank=r, tp_size=self.world_size), env))
            self._pids = self._gather([a.pid.remote() for a in self._state.actors],
                                      "start-up", SETUP_TIMEOUT_S, plain=True)
            host, port = self._gather([self._state.actors[0].rendezvous_address.remote()],
                                      "start-up", SETUP_TIMEOUT_S, plain=True)[0]
            specs = self._gather([a.start.remote(host, port) for a in self._state.actors],
                                 "start-up", SETUP_TIMEOUT_S, fail_fast=True)
        except BaseException:
            self.close()
            raise
        self._kv_cache_specs: list[KVCacheSpec] = specs[0]
        logger.info("%d tensor-parallel Ray actors ready (process group at %s:%d)",
                    self.world_size, host, port)

    # ---- start-up ----------------------------------------------------------------------

    def _reserve(self, bundle: dict[str, float], strategy: str, timeout_s: float) -> Any:
        """The placement group of one ``bundle`` per rank, or a ``RuntimeError`` naming what
        the cluster has once ``timeout_s`` passed without it being granted."""
        ray = self._state.ray
        group = ray.util.placement_group([dict(bundle)] * self.world_size, strategy=strategy)
        self._state.placement_group = group
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            (resource,) = bundle
            per_node = [
                f"{node['NodeManagerAddress']}: {node['Resources'].get(resource, 0):g}"
                for node in ray.nodes() if node.get("Alive")]
            total = ray.cluster_resources().get(resource, 0)
            available = ray.available_resources().get(resource, 0)
            hint = _STRATEGY_HINTS.get(strategy, "")
            raise RuntimeError(
                f"the Ray cluster did not grant tensor_parallel_size={self.world_size} "
                f"bundles of {{{resource!r}: 1}} (placement strategy {strategy}) within "
                f"{timeout_s:g} s: it has {total:g} {resource} in total, {available:g} "
                f"free now (per node: {'; '.join(per_node)}). Add nodes or free "
                f"{resource}s, lower tensor_parallel_size{hint} (or raise "
                "ray_placement_timeout_s when the cluster grows by itself)") from None
        return group

    # ---- calls on every rank -----------------------------------------------------------

    def _gather(self, refs: list[Any], what: str, timeout_s: float, fail_fast: bool = False,
                plain: bool = False) -> list[Any]:
        """Every rank's answer to a call (``refs`` in rank order, or fewer from rank 0 on).
        An actor that died or does not answer in ``timeout_s`` stops the executor
        (``WorkerFailedError``). An exception a rank raised is raised here (the lowest
        rank's, with its traceback as a note) once every rank answered, or at once with
        ``fail_fast`` (set-up calls; the actors are stopped then). ``plain``: the answers
        are values, not ``("ok", value)``."""
        ray = self._state.ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        answers: list[Any] = [None] * len(refs)
        errors: list[tuple[int, BaseException, str]] = []
        deadline = time.monotonic() + timeout_s
        while pending and not (errors and fail_fast):
            ready, _ = ray.wait(list(pending), num_returns=1,
                                timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                silent = sorted(pending.values())
                self._fail(f"tensor-parallel rank(s) {_names(silent)} did not answer {what} "
                           f"within {timeout_s:g} s (hung, or waiting in a collective for a "
                           "rank that is); raise worker_step_timeout_s if steps are this slow",
                           silent[0] if len(silent) == 1 else None)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    answer = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._fail(f"tensor-parallel rank {rank} (Ray actor, pid "
                               f"{self._pid(rank)}) died in {what}: {_first_line(exc)}", rank)
                except ray.exceptions.RayError as exc:
                    self._fail(f"tensor-parallel rank {rank} failed in {what}: {exc}", rank)
                if plain:
                    answers[rank] = answer
                elif answer is not None and answer[0] == "error":
                    errors.append((rank, answer[1], answer[2]))
                else:
                    answers[rank] = None if answer is None else answer[1]
        if errors:
            rank, exc, text = min(errors, key=lambda e: e[0])
            if fail_fast:
                self.close()
            exc.add_note(f"raised by tensor-parallel rank {rank} in {what}; its traceback:\n"
                         f"{text}")
            raise exc
        return answers

    def _pid(self, rank: int) -> int | str:
        return self._pids[rank] if self._pids else "unknown"

    def _fail(self, message: str, rank: int | None) -> None:
        logger.error("%s; stopping every actor", message)
        self.close()
        raise WorkerFailedError(message + "; the engine cannot go on", rank)

    def _check_running(self) -> None:
        if not self._state.actors:
            raise WorkerFailedError("the tensor-parallel Ray actors are stopped (the executor "
                                    "was closed or a worker failed); start a new engine")

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Run a ``Worker`` set-up ``method`` on every rank; every rank's answer."""
        self._check_running()
        return self._gather([a.call.remote(method, *args) for a in self._state.actors],
                            method, SETUP_TIMEOUT_S, fail_fast=True)

    # ---- the Executor interface --------------------------------------------------------

    def execute_model(self, step: StepPlan) -> RunnerOutputFuture:
        self.check_plain(step)
        self._check_running()
        plan = self._state.ray.put(step)  # serialized once, read by every actor
        refs = [a.execute_model.remote(plan) for a in self._state.actors]
        if self._in_flight is not None:
            self._answers[self._in_flight] = refs  # these calls answer the step before
        self._in_flight = self._launched
        self._launched += 1
        return LazyStepOutput(self._step_output, self._launched - 1)

    def _step_output(self, index: int) -> RunnerOutput:
        """Step ``index``'s output; reads the answers of earlier steps first (those not asked
        for by then are dropped: steps complete in launch order)."""
        if index == self._in_flight:
            # No later step will make the actors answer this one: ask for it.
            self._check_running()
            self._answers[index] = [a.flush.remote() for a in self._state.actors]
            self._in_flight = None
        while self._collected <= index:
            step = self._collected
            self._collected += 1  # read even when it raises: the next answers are the next step's
            answers = self._gather(self._answers.pop(step), f"step {step}", self.step_timeout_s)
            output: RunnerOutput = answers[0]
            digest = output_digest(output)
            for rank, other in enumerate(answers[1:], start=1):
                if other != digest:
                    self._fail(f"tensor-parallel rank {rank} sampled other tokens than rank 0 "
                               f"in step {step} (the ranks' logits differ)", rank)
            self._outputs[step] = output
        for old in [i for i in self._outputs if i < index]:
            del self._outputs[old]
        return self._outputs.pop(index)

    def close(self) -> None:
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        """The actors' process ids, rank order (empty once closed)."""
        return list(self._pids) if self._state.actors else []


def _names(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
