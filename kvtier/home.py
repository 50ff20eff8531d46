"""A store's home: the process that built it, the only one whose calls it serves.

A `KVStore` is per process. Its mover's threads run only in the process that started them, and
its shared-memory pools (`shared_memory=`) are mapped shared, so in a forked child a copy
inherited from the parent would wait forever on a thread that is not there, or write into the
parent's slots behind the parent's index. A child builds a store of its own.

`HomeLock` is the cache's lock as a store's public calls take it (`KVStore`, `Operations`):
in the home process it is the lock; in any other, taking it raises `ClosedError` naming both
processes, before the lock is asked for (a lock that another thread of the parent held at the
fork is never released in the child) and before anything is read or written.
"""

from __future__ import annotations

import os
import threading

from kvtier.errors import ClosedError


class HomeLock:
    def __init__(self, lock: threading.RLock) -> None:
        """`lock` (reentrant), taken only in the process that calls this."""
        self.lock = lock
        self.pid = os.getpid()

    def ensure_home(self) -> None:
        """`ClosedError` unless this is the process that built the store."""
        here = os.getpid()
        if here != self.pid:
            raise ClosedError(
                f"this KVStore was built in process {self.pid}, not in this one ({here}): its "
                "memory and threads are that process's; build one per process"
            )

    def __enter__(self) -> None:
        self.ensure_home()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
