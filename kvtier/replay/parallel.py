"""The independent pieces of `kvtier replay`, side by side in worker processes (`--jobs N`).

Each run builds its own store and each yardstick simulation its own cache (`simulate.py`), so
they are tasks that share nothing but what they read (`Workload`): one per run, and one per
simulation of each distinct run capacity (LRU of leaves, furthest next use).

    parent: trace, ceiling, chains ──fork──► worker 1: tiered run ─────────────────► dict
                                      └─────► worker 2: gpu-only run, LRU(1,828), ... ─► dict
    parent: results in the order the runs are defined, each with its yardsticks

`replay_all(work, sizings, 1, ...)` performs the tasks in the calling process one after the
other, runs first (the replay as it always ran). With more jobs, a `ProcessPoolExecutor` of
that many forked workers takes the runs first (the larger stores, which run longest, before
the smaller ones), then the simulations, so the long runs start at once and the short tasks
fill the other cores. A task's result comes back as plain data (`ReplayResult.to_dict`, a
`SimResult`'s fields) and is rebuilt in the parent, for every job count alike: the figures do
not depend on where a task ran. Latencies and wall times do: a run measured while other tasks
share the CPU is slower, and its lookup/prefetch percentiles with it (`--jobs 1` for clean
ones; `--speed` defaults to it, a paced run needs the CPU its clock assumes).

Progress: workers add each request they replay to a shared counter, which the parent reads
into `progress` every `POLL_S`. When a task fails the parent tells the others to stop (they
stop after the request they are on, removing their stores' directories), cancels the tasks not
started and raises that task's error; a `KVTierError` travels as its message only. A worker
whose parent is gone (SIGKILL) stops the same way and exits (`_watch`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.synchronize
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from typing import Any, Protocol

from kvtier.errors import KVTierError
from kvtier.replay.memory import host_bytes
from kvtier.replay.report import ReplayResult, Sizing, Yardsticks
from kvtier.replay.runner import ReplayOptions, capacity_blocks, replay, replay_config
from kvtier.replay.simulate import LRU, Chain, Furthest, Policy, SimResult, chains, simulate
from kvtier.replay.trace import Ceiling, TraceRequest
from kvtier.tiers.memory import available_host_bytes

POLL_S = 0.2
"""How often the parent reads the workers' progress (only when it shows progress)."""

Progress = Callable[[int], None]
"""Told how many more requests were replayed."""

YARDSTICKS: dict[str, Callable[[Sequence[Chain]], Policy]] = {
    "lru": lambda keys: LRU(),
    "furthest": Furthest,
}
"""The simulations each run is compared with (`Yardsticks`' fields), by name."""


@dataclass(frozen=True)
class Workload:
    """What every task reads: the trace's requests, their ceiling, the replay options and the
    requests' block keys in store blocks (`simulate.chains`). Never changed by a task."""

    requests: Sequence[TraceRequest]
    ceiling: Ceiling
    options: ReplayOptions
    keys: Sequence[Chain]

    @staticmethod
    def of(requests: Sequence[TraceRequest], ceiling: Ceiling, options: ReplayOptions) -> Workload:
        return Workload(requests, ceiling, options, chains(requests, options.block_tokens))


class Task(Protocol):
    @property
    def rank(self) -> tuple[int, float]:
        """Tasks start in the order of their ranks: long ones first (module doc)."""
        ...

    def perform(self, work: Workload, progress: Progress | None) -> dict[str, Any]:
        """Do the task on `work`, telling `progress` of each request replayed (if it replays);
        returns its result as plain data."""
        ...


@dataclass(frozen=True)
class RunTask:
    """Replay the trace against a store sized by `sizing` (`runner.replay`)."""

    sizing: Sizing

    @property
    def rank(self) -> tuple[int, float]:
        return (0, -self.sizing.total)

    def perform(self, work: Workload, progress: Progress | None) -> dict[str, Any]:
        return replay(work.requests, work.ceiling, self.sizing, work.options, progress).to_dict()


@dataclass(frozen=True)
class SimTask:
    """Simulate one cache of `capacity` blocks evicting by `YARDSTICKS[policy]`."""

    capacity: int
    policy: str

    @property
    def rank(self) -> tuple[int, float]:
        return (1, 0.0)

    def perform(self, work: Workload, progress: Progress | None) -> dict[str, Any]:
        result = simulate(work.keys, self.capacity, YARDSTICKS[self.policy](work.keys))
        return dataclasses.asdict(result)


@dataclass(frozen=True)
class _Plan:
    """The runs of `sizings`, then the simulations of each distinct capacity they have."""

    runs: list[RunTask]
    capacities: list[int]  # of each run, in its order
    sims: list[SimTask]

    @staticmethod
    def of(work: Workload, sizings: Sequence[Sizing]) -> _Plan:
        unique = work.ceiling.unique_blocks
        capacities = [capacity_blocks(s, unique, work.options) for s in sizings]
        sims = [SimTask(c, policy) for c in dict.fromkeys(capacities) for policy in YARDSTICKS]
        return _Plan([RunTask(s) for s in sizings], capacities, sims)

    @property
    def tasks(self) -> list[Task]:
        return [*self.runs, *self.sims]

    def results(self, outcomes: Sequence[dict[str, Any]]) -> list[ReplayResult]:
        """Each run's result with its yardsticks, from `outcomes` (one per task, in order)."""
        runs, sims = outcomes[: len(self.runs)], outcomes[len(self.runs) :]
        found = {
            (t.capacity, t.policy): SimResult(**o) for t, o in zip(self.sims, sims, strict=True)
        }
        return [
            dataclasses.replace(
                ReplayResult.from_dict(run),
                yardsticks=Yardsticks(**{p: found[capacity, p] for p in YARDSTICKS}),
            )
            for run, capacity in zip(runs, self.capacities, strict=True)
        ]


def task_count(work: Workload, sizings: Sequence[Sizing]) -> int:
    """The independent tasks of replaying `sizings`: more jobs than this would idle."""
    return len(_Plan.of(work, sizings).tasks)


def default_jobs(tasks: int, options: ReplayOptions) -> int:
    """One worker per core, at most one per task; 1 for paced runs (module doc)."""
    if options.speed is not None:
        return 1
    return max(1, min(os.cpu_count() or 1, tasks))


def replay_all(
    work: Workload, sizings: Sequence[Sizing], jobs: int, progress: Progress | None = None
) -> list[ReplayResult]:
    """Replay `work` against a store of each of `sizings` and compare each run with its
    yardsticks, in `jobs` processes (module doc); the results in the order of `sizings`.
    `progress(n)` is told of the requests replayed, `len(sizings) * len(requests)` in all."""
    assert jobs >= 1, jobs
    plan = _Plan.of(work, sizings)
    tasks = plan.tasks
    if jobs > 1 and not _fit_side_by_side(work, sizings, jobs):
        jobs = 1  # the same figures, one store at a time
    if jobs == 1:
        return plan.results([task.perform(work, progress) for task in tasks])
    return plan.results(_in_workers(work, tasks, min(jobs, len(tasks)), progress))


def _fit_side_by_side(work: Workload, sizings: Sequence[Sizing], jobs: int) -> bool:
    """Whether the `jobs` largest runs' stores, open at once in their workers, map at most the
    host memory available (`memory.py`; each alone is checked by `replay`): else they run one
    at a time, where two such runs side by side could fill the machine's memory."""
    unique = work.ceiling.unique_blocks
    each = [host_bytes(replay_config(s, unique, work.options, "unused")) for s in sizings]
    return sum(sorted(each, reverse=True)[:jobs]) <= available_host_bytes()


class _Stopped(Exception):
    """Raised in a worker's run when the parent asked the workers to stop."""


@dataclass(frozen=True)
class _Shared:
    """What a worker inherits when it is forked: the workload, the count of requests replayed
    in all workers, the parent's request to stop, and the parent's pid: a worker whose parent
    died (SIGKILL, or a signal that skips its cleanup) stops too, rather than replay on as an
    orphan with its store's directory."""

    work: Workload
    done: Synchronized[int]
    stop: multiprocessing.synchronize.Event
    parent: int = dataclasses.field(default_factory=os.getpid)

    def tick(self, requests: int) -> None:
        with self.done.get_lock():
            self.done.value += requests
        if self.stop.is_set() or os.getppid() != self.parent:
            raise _Stopped


_shared: _Shared | None = None
"""In a worker process: what `_adopt` was handed when it started."""


_busy = threading.Lock()
"""In a worker: held while it performs a task (`_perform`), so `_watch` never ends it mid-task."""

ORPHAN_POLL_S = 0.2
"""How often a worker checks that its parent lives (`_watch`)."""


def _adopt(shared: _Shared) -> None:
    global _shared
    _shared = shared
    threading.Thread(target=_watch, args=(shared.parent,), daemon=True).start()


def _watch(parent: int) -> None:
    """End this worker once its parent is gone and it performs no task: an orphan would wait on
    the task queue forever (its own copy of the queue's pipe keeps it open). A task it is on
    stops at its next request (`_Shared.tick`), removing its store's directory, first."""
    while True:
        time.sleep(ORPHAN_POLL_S)
        if os.getppid() != parent and _busy.acquire(blocking=False):
            os._exit(0)  # nothing of this worker's is left to clean: no task holds a store


def _perform(task: Task) -> dict[str, Any]:
    """A task in a worker; a `KVTierError` is sent back as a plain one of the same message
    (some do not survive pickling: `ConfigError` takes three arguments)."""
    assert _shared is not None, "a worker started without _adopt"
    with _busy:
        try:
            return task.perform(_shared.work, _shared.tick)
        except KVTierError as exc:
            raise KVTierError(str(exc)) from None


def _in_workers(
    work: Workload, tasks: Sequence[Task], jobs: int, progress: Progress | None
) -> list[dict[str, Any]]:
    """Perform `tasks` in `jobs` forked workers, in the order of their ranks; their results
    in the order of `tasks`."""
    context = multiprocessing.get_context("fork")
    shared = _Shared(work, context.Value("q", 0), context.Event())
    order = sorted(range(len(tasks)), key=lambda i: tasks[i].rank)
    with ProcessPoolExecutor(jobs, context, initializer=_adopt, initargs=(shared,)) as pool:
        futures: dict[int, Future[dict[str, Any]]] = {}
        try:
            for i in order:
                futures[i] = pool.submit(_perform, tasks[i])
            pending = set(futures.values())
            shown = 0
            while pending:
                timeout = POLL_S if progress is not None else None
                done, pending = wait(pending, timeout, FIRST_COMPLETED)
                for future in done:
                    future.result()  # the first failure raises here
                if progress is not None:
                    now = shared.done.value
                    progress(now - shown)
                    shown = now
        except BaseException:
            shared.stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [futures[i].result() for i in range(len(tasks))]
