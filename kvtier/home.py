"""A store's home: the process that built it, the only one whose calls it serves.

A `KVStore` is per process. Its mover's threads run only in the process that started them, and
its shared-memory pools (`shared_memory=`) are mapped shared, so in a forked child a copy
inherited from the parent would wait forever on a thread that is not there, or write into the
parent's slots behind the parent's index. A child builds a store of its own.

`HomeLock` is the cache's lock as a store's public calls take it (`KVStore`, `Operations`):
in the home process it is the lock; in any other, taking it raises `ClosedError` naming both
processes, before the lock is asked for (a lock that another thread of the parent held at the
fork is never released in the child) and before anything is read or written.

`generation()` counts the forks this process descends from (`os.register_at_fork`), so that a
check of "still the home process" is a read of a number, not a `getpid` system call per call
(about 0.3 us each; a store call took several). The client's `Calls` checks the same way.
"""

from __future__ import annotations

import os
import threading

from kvtier.errors import ClosedError

_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def generation() -> int:
    """How many forks made this process from the first one (0 there): what a thing made here
    records to tell, later, whether it is still in the process that made it."""
    return _forks


class HomeLock:
    def __init__(self, lock: threading.RLock) -> None:
        """`lock` (reentrant), taken only in the process that calls this."""
        self.lock = lock
        self.pid, self.generation = os.getpid(), _forks

    def ensure_home(self) -> None:
        """`ClosedError` unless this is the process that built the store."""
        if _forks != self.generation:
            here = os.getpid()
            raise ClosedError(
                f"this KVStore was built in process {self.pid}, not in this one ({here}): its "
                "memory and threads are that process's; build one per process"
            )

    def __enter__(self) -> None:
        self.ensure_home()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
