"""`IOPool`: the disk tier's I/O threads, several jobs in flight, reads before writes.

Why plain threads and positional system calls, not aiofiles: `io.py`'s module doc.
"""

from __future__ import annotations

import errno
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

from kvtier.errors import ClosedError

T = TypeVar("T")


def _run_lane(
    jobs: Sequence[Callable[[], T]],
) -> tuple[list[T | OSError], BaseException | None]:
    """Run one worker's jobs in order: their results or OSErrors, and the first other error
    (after which the lane's remaining jobs are reported as not run, with EIO)."""
    outcomes: list[T | OSError] = []
    for job in jobs:
        try:
            outcomes.append(job())
        except OSError as exc:
            outcomes.append(exc)
        except BaseException as exc:  # our bug: finish the bookkeeping, then let it surface
            outcomes.extend(OSError(errno.EIO, "not run") for _ in range(len(jobs) - len(outcomes)))
            return outcomes, exc
    return outcomes, None


class IOPool:
    """Runs I/O jobs on worker threads, several in flight, reads before writes.

    A job is a function of no arguments, typically a `SlabFile.write` or `read_into` bound with
    `functools.partial`. `run` is safe to call from several threads at once; calling it from
    inside one of its own jobs can deadlock (the job would wait for a worker it occupies).

    Two queues: the lanes of a call with `urgent` (the tier's reads: a request waits on them)
    go to the next free worker before every lane of a plain call (writes, syncs, retires, the
    scan) queued earlier. The mover writes flights from several threads at once, each a few
    lanes of a few MiB ending in a sync; with one FIFO queue a prefetch's reads waited behind
    all of them. Plain lanes still run in their order, and a steady stream of reads delays
    writes without dropping them (the mover's backpressure sees its queue grow)."""

    def __init__(self, workers: int = 4) -> None:
        """A pool of `workers` (>= 1) threads, started by the first call that queues a lane."""
        if workers < 1:
            raise ValueError(f"IOPool workers: got {workers}, expected an integer >= 1")
        self.workers = workers
        self._queues = _Queues()
        self._threads: list[threading.Thread] = []
        # the workers hold the queues, not the pool: a pool dropped unclosed lets them end
        weakref.finalize(self, self._queues.shut)

    def run(self, jobs: Sequence[Callable[[], T]], urgent: bool = False) -> list[T | OSError]:
        """Run all `jobs` concurrently (up to `workers` at a time) and wait for every one;
        with `urgent`, ahead of the plain calls waiting (class doc).

        Returns, in job order, each job's result or the `OSError` it raised, so that one
        failed I/O does not hide the others. Any other exception (our bug) is raised after all
        jobs have finished; no job is still running when `run` returns or raises. Jobs are
        dealt to lanes in turn (job j to lane j % lanes, `lanes` = min(workers, jobs)), one
        hand-off per lane: one per job cost a thread switch each, which at 2 MiB per job was a
        quarter of the bandwidth. The calling thread runs the last lane itself rather than
        only wait, so one job (the small batches of an inline store) costs no hand-off."""
        lanes = min(self.workers, len(jobs))
        queued = [_Lane(jobs[lane::lanes]) for lane in range(lanes - 1)]
        queues = self._queues
        with queues.cond:
            if queues.closed:
                raise ClosedError("IOPool is closed")
            if queued:
                while len(self._threads) < self.workers:
                    thread = threading.Thread(
                        target=_work, args=(queues,), name="kvtier-io", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
                (queues.urgent if urgent else queues.plain).extend(queued)
                queues.cond.notify(len(queued))
        mine: tuple[list[T | OSError], BaseException | None] = ([], None)
        try:
            if lanes:
                mine = _run_lane(jobs[lanes - 1 :: lanes])
        finally:
            for lane in queued:
                lane.done.wait()
        results: list[T | OSError] = [OSError()] * len(jobs)
        failure: BaseException | None = None
        outcomes_by_lane = [lane.outcome for lane in queued] + ([mine] if lanes else [])
        for index, (outcomes, error) in enumerate(outcomes_by_lane):
            results[index::lanes] = outcomes
            if error is not None and failure is None:
                failure = error
        if failure is not None:
            raise failure
        return results

    def waiting(self) -> tuple[int, int]:
        """Lanes queued for a worker: (urgent, plain)."""
        with self._queues.cond:
            return len(self._queues.urgent), len(self._queues.plain)

    def close(self) -> None:
        """Let what is queued run, then stop the threads; closing twice is allowed. A `run`
        after it raises `ClosedError`."""
        self._queues.shut()
        threads, self._threads = self._threads, []
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    def __enter__(self) -> IOPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Queues:
    """What a pool's workers share: the lanes waiting, urgent and plain, and whether it shut."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.urgent: deque[_Lane[Any]] = deque()
        self.plain: deque[_Lane[Any]] = deque()
        self.closed = False

    def shut(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _work(queues: _Queues) -> None:
    """A worker: the next urgent lane, else the next plain one, until shut and drained."""
    while True:
        with queues.cond:
            while not queues.urgent and not queues.plain:
                if queues.closed:
                    return
                queues.cond.wait()
            lane = (queues.urgent or queues.plain).popleft()
        try:
            lane.outcome = _run_lane(lane.jobs)
        finally:
            lane.done.set()


class _Lane(Generic[T]):
    """One worker's share of a `run`: its jobs, then their outcomes, then `done` set."""

    __slots__ = ("done", "jobs", "outcome")

    def __init__(self, jobs: Sequence[Callable[[], T]]) -> None:
        self.jobs = jobs
        self.outcome: tuple[list[T | OSError], BaseException | None] = (
            [],
            RuntimeError("an I/O lane that never ran"),
        )
        self.done = threading.Event()
