"""A pipeline-stage worker answers each step from a thread of its own, as soon as the step's
output is ready, while the thread that takes plans goes on launching: handing a step over
never waits for the device, answers and set-up replies leave in call order, and what is
queued is sent when the worker stops. Without stages a worker answers from the calling
thread. (That PP=2 still generates what one process does is tested in test_pp_generation and
test_ppo_generation, which run through this path.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from hitchllm.distributed import ParallelRank
from hitchllm.engine.runner_output import RunnerOutput
from hitchllm.engine.worker_process import _AnswerSender


class Conn:
    """The worker's end of the pipe: records what is sent, from any thread."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self.lock:
            self.sent.append(message)


class SlowStep:
    """A launched step whose output is ready once ``finish()`` is called."""

    def __init__(self, tokens: dict[str, list[int]]) -> None:
        self.done = threading.Event()
        self.output = RunnerOutput(sampled=tokens)

    def finish(self) -> None:
        self.done.set()

    def result(self) -> RunnerOutput:
        assert self.done.wait(10), "the step never finished"
        return self.output


def worker(pp_size: int) -> SimpleNamespace:
    return SimpleNamespace(rank=ParallelRank(pp_rank=pp_size - 1, pp_size=pp_size),
                           device=torch.device("cpu"))


def wait_for(conn: Conn, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(conn.sent) < count and time.monotonic() < deadline:
        time.sleep(0.005)


def test_a_stage_hands_steps_over_without_waiting_and_answers_in_order():
    conn = Conn()
    sender = _AnswerSender(worker(pp_size=2), conn)
    assert sender.threaded
    first, second = SlowStep({"a": [5]}), SlowStep({"b": [7]})
    start = time.perf_counter()
    sender.answer_step(0, first)
    sender.reply(("ok", "set-up"))  # a set-up call's reply queues behind step 0
    sender.answer_step(1, second)
    assert time.perf_counter() - start < 0.5  # nothing waited for the steps
    time.sleep(0.05)
    assert conn.sent == []  # step 0 is not ready, so nothing behind it leaves either
    second.finish()
    time.sleep(0.05)
    assert conn.sent == []
    first.finish()
    wait_for(conn, 3)
    assert conn.sent == [("ok", first.output), ("ok", "set-up"), ("ok", second.output)]
    sender.close()


def test_a_stopping_stage_sends_what_is_queued():
    conn = Conn()
    sender = _AnswerSender(worker(pp_size=2), conn)
    step = SlowStep({"a": [1]})
    sender.answer_step(0, step)
    sender.reply(("ok", None))  # the shutdown reply
    threading.Timer(0.05, step.finish).start()
    sender.close()
    assert conn.sent == [("ok", step.output), ("ok", None)]


def test_an_earlier_stage_answers_none_and_a_step_error_is_its_answer():
    conn = Conn()
    early = SimpleNamespace(rank=ParallelRank(pp_rank=0, pp_size=2), device=torch.device("cpu"))
    sender = _AnswerSender(early, conn)
    ready = SlowStep({})
    ready.finish()
    sender.answer_step(0, ready)
    failing = SimpleNamespace(result=lambda: (_ for _ in ()).throw(ValueError("bad row")))
    sender.answer_step(1, failing)
    sender.close()
    assert conn.sent[0] == ("ok", None)
    status, exc, text = conn.sent[1]
    assert status == "error" and isinstance(exc, ValueError) and "bad row" in text


def test_without_stages_answers_leave_from_the_calling_thread():
    conn = Conn()
    sender = _AnswerSender(worker(pp_size=1), conn)
    assert not sender.threaded
    step = SlowStep({"a": [3]})
    step.finish()
    sender.answer_step(0, step)
    assert conn.sent == [("ok", step.output)]  # sent before answer_step returned
    sender.close()
