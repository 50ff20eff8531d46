"""`ThreadExecutor`: transfers run on worker threads, one queue per path.

    submit(t) -> queue of path (src, dst) -> worker: throttle, then InlineExecutor.run(t)
                                                  |
                     publish in submission order: settle the handle, add it to what poll()
                     returns, then run its done callbacks (outside every lock)

One queue per path, so that device->host demotions, host->device prefetches and disk traffic
never wait behind each other; a path's workers start with its first transfer. A path that
writes to disk has at least `DISK_WRITERS` workers: a group commit ends in a sync, and with one
worker the disk idles while it waits (`bench_mover.py` (b): 1.8x the bytes written with 3), and
the batches that several workers write into one slab at once share one sync
(`SlabFile.sync`), so more workers flush the device's cache fewer times per byte. A path that
reads from disk has at least `DISK_READERS`: the prefetches of several requests read at once.
The copies are `InlineExecutor.run` (one `InlineExecutor` per worker, all counting in one
`Ledger`, which may be shared with the store's inline executor), so threads and the synchronous
store move bytes
with the same code.

Contract, besides that of `shared.py`:
- FIFO per path: the transfers of one path complete in submission order, with any number of
  workers per path (a transfer that finishes early is published after those before it).
- `throttle_bytes_per_s` paces every path on its own: a transfer of n bytes reserves the next
  n / rate seconds of its path and its copy starts when they are over, as if a link of that
  bandwidth delivered the data, which becomes visible when the transfer completes. No path
  moves more than rate * t bytes in any t seconds. Tests use it to make a real slow path.
- `close(timeout_s)` refuses new transfers (`ClosedError`) and waits up to `timeout_s` for those
  queued or running; any left after that still complete their handles, on the daemon workers.
- A done callback that raises does not kill its worker: the next `poll()` raises it.
"""

from __future__ import annotations

import math
import queue
import threading
import time

from kvtier.errors import ClosedError, InvalidArgumentError
from kvtier.tiers.disk import DiskTier
from kvtier.transfer.copy import InlineExecutor, Ledger, Transfer
from kvtier.transfer.shared import Runner, TransferHandle

_Outcome = tuple[TransferHandle, list[bool] | None, Exception | None]

DISK_WRITERS = 8
"""Workers of a path into the disk tier, at least: one flight's writes overlap another's sync,
and syncs are shared. `bench_mover.py` (b), background, 4 rounds alternated, host->disk against
raw write: 3 workers 0.49 of raw (one sync per batch, 301-380 syncs in 8 s), 5 workers 0.62,
8 workers 0.63-0.71 (126 syncs), 12 no better; the cost: a prefetch from disk waits behind more
writes (time to ready p50 69 -> 92-104 ms with 3 -> 8 workers; 0-4 % of tokens lost, no trend
with the workers)."""


DISK_READERS = 4
"""Workers of a path out of the disk tier, at least: the prefetches of several requests read at
once, as the inline mover's callers do in their own threads (with one worker they queued, and
a prefetch from disk took about 3x as long as inline in `bench_mover.py` (b))."""


class _Throttle:
    """Paces one path at `bytes_per_s` (infinite: no wait)."""

    def __init__(self, bytes_per_s: float) -> None:
        self._rate = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # monotonic time at which the path's reserved bytes are delivered

    def hold(self, nbytes: int) -> None:
        """Reserve the path for `nbytes` and sleep until they would have been delivered."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = until = start + nbytes / self._rate
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _PathQueue:
    """One path's queue, workers and throttle, and the order in which it publishes."""

    def __init__(
        self, executor: ThreadExecutor, path: tuple[str, str], workers: int, rate: float
    ) -> None:
        self.path = path
        self._executor = executor
        self._throttle = _Throttle(rate)
        self._queue: queue.SimpleQueue[tuple[int, TransferHandle] | None] = queue.SimpleQueue()
        self._submitted = 0  # written under the executor's lock (by `put`)
        self._lock = threading.Lock()  # guards `_next` and `_ready`; taken before the executor's
        self._next = 0  # sequence number of the next transfer to publish
        self._ready: dict[int, _Outcome] = {}  # finished, waiting for those before them
        self._copiers = [InlineExecutor(executor.ledger) for _ in range(workers)]
        self._threads = [
            threading.Thread(
                target=self._work, args=(copier,), name=f"kvtier-{path[0]}-{path[1]}-{i}"
            )
            for i, copier in enumerate(self._copiers)
        ]
        for thread in self._threads:
            thread.daemon = True  # a copy stuck past close() must not hold the process open
            thread.start()

    def put(self, handle: TransferHandle) -> None:
        """Queue a transfer (call under the executor's lock, which orders the sequence)."""
        self._queue.put((self._submitted, handle))
        self._submitted += 1

    def queued(self) -> int:
        """Transfers submitted on this path and not yet published."""
        with self._lock:
            return self._submitted - self._next

    def stop(self) -> None:
        """Let each worker finish what is queued, then exit."""
        for _ in self._threads:
            self._queue.put(None)

    def join(self, deadline: float | None) -> None:
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _work(self, copier: InlineExecutor) -> None:
        while (item := self._queue.get()) is not None:
            seq, handle = item
            transfer = handle.transfer
            self._throttle.hold(transfer.nbytes)
            ok: list[bool] | None = None
            error: Exception | None = None
            try:
                ok = copier.run(transfer)
            except Exception as exc:  # kept in the handle; `result()` raises it
                error = exc
            self._finish(seq, (handle, ok, error))

    def _finish(self, seq: int, outcome: _Outcome) -> None:
        with self._lock:  # held while publishing, so two workers publish in sequence order
            self._ready[seq] = outcome
            batch: list[_Outcome] = []
            while self._next in self._ready:
                batch.append(self._ready.pop(self._next))
                self._next += 1
            self._executor._publish(batch)
        for handle, _, _ in batch:
            try:
                handle.run_callbacks()
            except Exception as exc:
                self._executor._callback_failed(exc)


class ThreadExecutor:
    """Runs transfers on worker threads, `workers_per_path` per path; see the module doc."""

    def __init__(
        self,
        workers_per_path: int = 1,
        throttle_bytes_per_s: float | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        """`ledger`: where the workers count bytes moved (a new one when None)."""
        if type(workers_per_path) is not int or workers_per_path < 1:
            raise InvalidArgumentError(
                f"workers_per_path: got {workers_per_path!r}, expected an integer >= 1"
            )
        if throttle_bytes_per_s is not None and not throttle_bytes_per_s > 0:
            raise InvalidArgumentError(
                f"throttle_bytes_per_s: got {throttle_bytes_per_s!r}, expected > 0 or None"
            )
        self.workers_per_path = workers_per_path
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.ledger = ledger if ledger is not None else Ledger()
        self._rate = math.inf if throttle_bytes_per_s is None else throttle_bytes_per_s
        self._lock = threading.Lock()
        self._paths: dict[tuple[str, str], _PathQueue] = {}
        self._completed: list[TransferHandle] = []  # published, not yet polled
        self._callback_errors: list[Exception] = []
        self._closed = False

    @property
    def bytes_moved(self) -> dict[tuple[str, str], int]:
        """Bytes of completed, ok block copies per path (a snapshot of the ledger)."""
        return self.ledger.bytes_moved

    polled = False  # each worker completes its handles and runs their done callbacks

    def mark_engine(self) -> None:
        """Nothing to order: the engine's writes into CPU pools are complete when its call
        returns, before any copy of them is submitted."""

    def in_call_runner(self, inline: Runner) -> Runner:
        return inline

    def queued(self) -> int:
        """Transfers submitted and not yet complete, all paths together (queue depth)."""
        with self._lock:
            paths = list(self._paths.values())
        return sum(path.queued() for path in paths)

    def submit(self, transfer: Transfer) -> TransferHandle:
        """Queue `transfer` on its path and return its handle; `ClosedError` after `close()`."""
        handle = TransferHandle(transfer)
        with self._lock:
            if self._closed:
                raise ClosedError("the thread executor is closed; submit before close()")
            path = self._paths.get(transfer.path)
            if path is None:
                workers = self.workers_per_path
                if isinstance(transfer.dst, DiskTier):
                    workers = max(workers, DISK_WRITERS)
                elif isinstance(transfer.src, DiskTier):
                    workers = max(workers, DISK_READERS)
                path = self._paths[transfer.path] = _PathQueue(
                    self, transfer.path, workers, self._rate
                )
            path.put(handle)
        return handle

    def poll(self) -> list[TransferHandle]:
        """Handles completed since the last poll, in completion order. Raises first the
        exception of a done callback that failed on a worker, if any (the handles stay)."""
        with self._lock:
            if self._callback_errors:
                raise self._callback_errors.pop(0)
            completed, self._completed = self._completed, []
        return completed

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Refuse new transfers and wait up to `timeout_s` for queued and running ones."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            paths = list(self._paths.values())
        for path in paths:
            path.stop()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for path in paths:
            path.join(deadline)

    # -- called by the workers --------------------------------------------------------------

    def _publish(self, batch: list[_Outcome]) -> None:
        """Make finished transfers done and pollable together, so that a thread that sees
        `done()` true and then polls finds the handle."""
        with self._lock:
            for handle, ok, error in batch:
                handle.settle(ok, error)
                self._completed.append(handle)

    def _callback_failed(self, error: Exception) -> None:
        with self._lock:
            self._callback_errors.append(error)
