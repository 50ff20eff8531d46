"""`SteppedExecutor`: transfers that copy only when a test says so, for deterministic ordering.

    submit(t) -> queue (oldest first), handle pending      nothing copies on its own
    step(n)   -> the n oldest, one at a time, on the calling thread:
                 InlineExecutor.run(t), settle the handle, add it to what poll() returns,
                 then run its done callbacks (outside every lock)

A test submits work through the store (`KVStore(config, executor=SteppedExecutor())`, with
`mover.background: true`), observes the in-flight state as long as it likes (a pending lease, a
reserved slot not yet in the index), then steps and observes the result. What a step completes
is published to the index by the mover's thread, woken by the done callbacks: after a step, wait
for the lease or call `store.drain()` (which may plan more copies, such as demotions: step and
drain in turn until it returns True; a drain with copies still queued waits for someone to step).

Contract, besides that of `shared.py`:
- Nothing copies until `step` or `run_all` (or `close`); a handle stays pending until then, and
  `wait()` on it blocks until another thread steps.
- `step(n)` is `step()` called n times, stopping when nothing is queued: each transfer runs and
  completes, with its callbacks, before the next starts, so a transfer that a callback submits
  (the layer groups after a prefetch's disk read) queues behind those already there.
- The copies are `InlineExecutor.run`: an exception of a copy is kept in its handle
  (`result()` raises it); an exception of a done callback propagates out of `step`, and the
  transfers after it stay queued.
- `queued()` counts the transfers submitted and not complete: queued, or running in a step.
- `close()` refuses new transfers (`ClosedError`), then runs those still queued to completion on
  the closing thread (as the other executors finish what is queued), so no handle is left
  pending; a transfer that a callback submits meanwhile is refused.
"""

from __future__ import annotations

import threading
from collections import deque

from kvtier.errors import ClosedError, InvalidArgumentError
from kvtier.transfer.copy import InlineExecutor, Ledger, Transfer
from kvtier.transfer.shared import Runner, TransferHandle


class SteppedExecutor:
    """Queues transfers and runs them only when stepped; see the module doc."""

    polled = False  # `step` completes each handle and runs its done callbacks

    def __init__(self, ledger: Ledger | None = None) -> None:
        """`ledger`: where the copies count bytes moved (a new one when None)."""
        self._copier = InlineExecutor(ledger)
        self.ledger = self._copier.ledger
        self._lock = threading.Lock()  # guards the four fields below
        self._queue: deque[TransferHandle] = deque()
        self._running = 0  # taken off the queue by a step, not yet complete
        self._completed: list[TransferHandle] = []  # complete, not yet polled
        self._closed = False

    @property
    def bytes_moved(self) -> dict[tuple[str, str], int]:
        """Bytes of completed, ok block copies per path (a snapshot of the ledger)."""
        return self.ledger.bytes_moved

    def submit(self, transfer: Transfer) -> TransferHandle:
        """Queue `transfer` and return its handle, pending until a step runs it; `ClosedError`
        after `close()`."""
        handle = TransferHandle(transfer)
        with self._lock:
            if self._closed:
                raise ClosedError("the stepped executor is closed; submit before close()")
            self._queue.append(handle)
        return handle

    def step(self, n: int = 1) -> int:
        """Run the `n` oldest queued transfers, one after the other, on the calling thread;
        returns how many ran (fewer than `n` when the queue ran out, 0 when it was empty)."""
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"n: got {n!r}, expected an integer >= 0")
        ran = 0
        while ran < n and self._run_oldest():
            ran += 1
        return ran

    def run_all(self) -> int:
        """Step until nothing is queued, including transfers that callbacks submit meanwhile;
        returns how many ran."""
        ran = 0
        while self._run_oldest():
            ran += 1
        return ran

    def queued(self) -> int:
        """Transfers submitted and not complete yet: queued, or running in a step."""
        with self._lock:
            return len(self._queue) + self._running

    def poll(self) -> list[TransferHandle]:
        """Handles completed since the last poll, each once, in completion order."""
        with self._lock:
            completed, self._completed = self._completed, []
        return completed

    def mark_engine(self) -> None:
        """Nothing to order: the engine's writes into CPU pools are complete when its call
        returns, before any copy of them is submitted."""

    def in_call_runner(self, inline: Runner) -> Runner:
        return inline

    def close(self) -> None:
        """Refuse new transfers, then run those still queued to completion; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.run_all()

    def _run_oldest(self) -> bool:
        """Run the oldest queued transfer to completion; False when none was queued."""
        with self._lock:
            if not self._queue:
                return False
            handle = self._queue.popleft()
            self._running += 1
        ok: list[bool] | None = None
        error: Exception | None = None
        try:
            ok = self._copier.run(handle.transfer)
        except Exception as exc:  # kept in the handle; `result()` raises it
            error = exc
        with self._lock:  # done and pollable together, as the other executors publish
            handle.settle(ok, error)
            self._running -= 1
            self._completed.append(handle)
        handle.run_callbacks()
        return True
