"""The vLLM connector's saves thread (`integrations/saving.py`), without vLLM: jobs run in order
off the caller's thread, `flush` waits for them, a `release` job is reported only once done and
never dropped, and a backlog skips prompt saves rather than growing."""

from __future__ import annotations

import threading
import time

import torch

from kvtier.integrations.plans import SaveJob
from kvtier.integrations.saving import Saves

CPU = torch.device("cpu")


def job(name: str, release: bool = False) -> SaveJob:
    return SaveJob(name, (1, 2), (1,), "", release=release)


class Recorder:
    """A `save` that records the jobs it ran, and the threads, and waits on `gate` first."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, saved: SaveJob) -> None:
        self.gate.wait(10)
        self.ran.append(saved.req_id)
        self.threads.add(threading.current_thread().name)


def test_inline_saves_are_done_on_return_on_the_callers_thread() -> None:
    save = Recorder()
    saves = Saves(save)
    saves.run([job("a"), job("b", release=True)], wait=True, device=CPU)
    assert save.ran == ["a", "b"] and save.threads == {threading.current_thread().name}
    assert saves.thread is None and saves.take_sent() == {"b"} and saves.take_sent() == set()


def test_queued_saves_run_in_order_on_their_thread_and_flush_waits() -> None:
    save = Recorder()
    save.gate.clear()
    saves = Saves(save)
    start = time.perf_counter()
    saves.run([job("a"), job("b")], wait=False, device=CPU)
    saves.run([job("c", release=True)], wait=False, device=CPU)
    assert time.perf_counter() - start < 1 and save.ran == []  # the step did not wait
    assert saves.take_sent() == set()  # nothing reported before it is saved
    threading.Timer(0.2, save.gate.set).start()
    saves.flush()
    assert save.ran == ["a", "b", "c"] and len(save.threads) == 1
    assert save.threads != {threading.current_thread().name}
    assert saves.take_sent() == {"c"}
    saves.close()


def test_a_backlog_skips_prompt_saves_but_never_a_release() -> None:
    save = Recorder()
    save.gate.clear()
    saves = Saves(save, backlog=2)
    saves.run([job("a"), job("b"), job("c"), job("d", release=True)], wait=False, device=CPU)
    assert saves.skipped == 1  # "c": two were queued
    save.gate.set()
    saves.close()
    assert save.ran == ["a", "b", "d"] and saves.take_sent() == {"d"}


def test_a_save_that_raises_still_reports_its_release_and_flush_returns() -> None:
    def failing(saved: SaveJob) -> None:
        raise RuntimeError("the sidecar went away")

    saves = Saves(failing)
    saves.run([job("a", release=True)], wait=False, device=CPU)
    saves.flush()
    assert saves.take_sent() == {"a"}
    saves.close()


def test_drop_saves_none_of_the_queued_jobs_reports_their_releases_and_waits_for_the_running_one(
) -> None:  # fmt: skip
    """The weights changed (`resets.py`): queued KV is the old weights'; the running save ends
    before `drop` returns, so a reset after it finds everything stored that will be."""
    save = Recorder()
    save.gate.clear()
    saves = Saves(save)
    saves.run([job("a"), job("b"), job("c", release=True)], wait=False, device=CPU)
    time.sleep(0.1)  # "a" is running, held at the gate
    threading.Timer(0.2, save.gate.set).start()
    saves.drop()
    assert save.ran == ["a"]  # "b" and "c" were not saved
    assert saves.take_sent() == {"c"}  # vLLM gets the finished request's blocks back
    saves.run([job("d")], wait=False, device=CPU)  # later jobs are saved again
    saves.close()
    assert save.ran == ["a", "d"]
