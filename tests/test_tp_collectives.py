"""The collectives the parallel layers call, on a real gloo process group of 2 processes:
``all_reduce`` sums, ``all_gather`` concatenates the ranks' tensors in rank order along any
dimension, and leaving the group restores the world of 1."""

from __future__ import annotations

import multiprocessing as mp
import queue

import torch
import torch.distributed as dist
from tp_support import TP_TEST_TIMEOUT_S

from hitchllm import distributed
from hitchllm.distributed import ParallelRank

WORLD = 2


def rank_tensor(rank: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * rank


def run_rank(rank: int, port: int, results: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    distributed.init_distributed(ParallelRank(tp_rank=rank, tp_size=WORLD),
                                 torch.device("cpu"), store, TP_TEST_TIMEOUT_S)
    x = rank_tensor(rank)
    out = {"rank": (distributed.tp_rank(), distributed.tp_world_size()),
           "reduced": distributed.all_reduce(x.clone())}
    for dim in (0, 1, -1):
        out[f"gathered{dim}"] = distributed.all_gather(x, dim=dim)
    distributed.destroy_distributed()
    out["after"] = (distributed.tp_rank(), distributed.tp_world_size(), dist.is_initialized())
    # Plain lists: a tensor would travel as shared memory that dies with this process.
    results.put((rank, {k: v.tolist() if isinstance(v, torch.Tensor) else v
                        for k, v in out.items()}))


def test_all_reduce_and_all_gather_on_two_gloo_processes():
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=run_rank, args=(r, store.port, results))
                 for r in range(WORLD)]
    for p in processes:
        p.start()
    try:
        outs = dict(results.get(timeout=TP_TEST_TIMEOUT_S) for _ in range(WORLD))
    except queue.Empty as exc:
        raise AssertionError("a rank did not report within the timeout") from exc
    finally:
        for p in processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    parts = [rank_tensor(r) for r in range(WORLD)]
    for rank, out in outs.items():
        assert out["rank"] == (rank, WORLD)
        assert out["reduced"] == (parts[0] + parts[1]).tolist()
        for dim in (0, 1, -1):
            assert out[f"gathered{dim}"] == torch.cat(parts, dim=dim).tolist()
        assert out["after"] == (0, 1, False)
    assert all(p.exitcode == 0 for p in processes)
