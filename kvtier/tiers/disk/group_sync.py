"""Group commit across callers: concurrent callers of one sync share its runs.

`GroupSync.run(sync)` returns once a call of `sync` that *began after* `run` was called has
finished, and raises that call's error if it failed. A sync already running when a caller
arrives may have missed the caller's writes (it was issued before they completed), so it does
not count: the caller waits for it to end and then for the next. The first waiter to find no
sync running makes one for every caller waiting then. So at most two syncs run one after the
other for any number of concurrent callers:

    caller A: write, run -----------[sync 1]---> ok
    caller B:   write, run ---(waits: 1 began before)---[sync 2]---> ok
    caller C:     write, run ---(waits)-----------------[same 2]---> ok

Errors: a failed sync fails every caller it covered. Linux reports a failed writeback to one
`fdatasync` only, so a later sync may succeed although the data is lost: the error must reach
each caller whose writes that sync was for. The caller that ran it gets the error itself; the
others a new exception of the same type and arguments (one object is not raised in two
threads), or EIO where it cannot be made again (an interrupt). A sync that cannot run at all
(`ClosedError`: the file closed under it) fails its callers the same way: none of them may take
its writes as durable.

Why: the mover's path into the disk tier writes flights from several threads, each flight one
group commit of a few MiB ending in a sync, and on this machine's virtual disk a sync costs
28 ms (median): with one sync per flight the path reached about half the raw write bandwidth
(`bench_mover.py` (b)), and without syncs all of it.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable

FAILURES_KEPT = 64
"""Failed syncs remembered, for callers still waiting on one (they wake at once)."""


class GroupSync:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._asked = 0  # calls of `run` so far: each call's ticket
        self._done = 0  # every ticket up to this one was covered by a finished sync
        self._running = False
        self._failures: list[tuple[int, int, BaseException]] = []  # tickets (first, last]

    def run(self, sync: Callable[[], None]) -> None:
        """Return once a call of `sync` that began after this call has finished (module doc);
        raise its error if it failed."""
        with self._cond:
            self._asked += 1
            ticket = self._asked
            while self._running and self._done < ticket:
                self._cond.wait()
            if self._done >= ticket:  # a sync that began after this call covered it
                for first, last, error in self._failures:
                    if first < ticket <= last:
                        raise copy_of(error) from error
                return
            self._running = True
            first, last = self._done, self._asked  # this sync covers tickets (first, last]
        failed: BaseException | None = None
        try:
            sync()
        except BaseException as exc:  # handed to every caller it covered
            failed = exc
        with self._cond:
            self._running = False
            self._done = last
            if failed is not None:
                self._failures = [*self._failures[1 - FAILURES_KEPT :], (first, last, failed)]
            self._cond.notify_all()
        if failed is not None:
            raise failed


def copy_of(error: BaseException) -> BaseException:
    """The error of a shared sync for another caller it covered (module doc)."""
    if isinstance(error, Exception):
        try:
            return type(error)(*error.args)
        except Exception:  # a type that cannot be made again
            pass
    return OSError(errno.EIO, f"a shared sync did not finish: {error!r}")
