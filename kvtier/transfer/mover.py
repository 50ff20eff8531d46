"""The mover: the flights in the air, and the thread that publishes them.

    plan (cache lock)                 copy (no lock)                publish (cache lock)
    prefetch.py / background.py  -->  executor: worker threads  --> the flight's planner tells
    pin, allocate, submit             or CUDA streams               the index; leases settle

`Mover` puts the parts together: the lease book (`leasing.py`), prefetch planning
(`prefetch.py`), background work (`background.py`), the set of live flights and their runner
(`flights.py`). Copies finish on executor threads, which only queue the flight and wake the
mover's thread; `reap()` then publishes, under the cache's lock, every finished flight whose
joined flights are published, through the planner of its type. `step()` is one round of the
thread: publish, expire leases, drop corrupt blocks no longer locked, keep watermarks, lift.

Contract:
- With an `InlineExecutor` (`mover.background: false`), every flight runs inside the call that
  plans it and is published before the call returns, through the same code.
- `reserved(tier)` counts the slots flights own: the store's `check()` adds it to residency.
- `throttle(need)` (a store or reservation of `need` new blocks calls it before taking the
  cache's lock) waits, at most `store_wait_s` and without the lock, while the work is behind
  (`Background.behind`), host could take the blocks only by dropping unwritten ones
  (`Background.short`), or gpu only once its demotion flights land (`_landing`): each
  published flight wakes it to look again. Before each look it
  publishes finished flights, plans demotions over watermarks, as the thread would, and
  writes down ahead what the call needs, for its tenant (`make_room_ahead`: the victims its
  own room-making would take); it stores nothing.
- The thread wakes on every completion (a done callback, or a CUDA event it polls while copies
  run: a launch on such an executor wakes it to start polling) and at least every
  `IDLE_WAKE_S`; it holds the mover only while it works, so a store
  dropped without `close()` is collected and its thread ends.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.blocks import BlockId
from kvtier.errors import ClosedError
from kvtier.index import BlockRef, Match
from kvtier.results import Lease
from kvtier.text import ERROR_CHARS, printable
from kvtier.tiers.base import GPU
from kvtier.transfer.background import Background, BackgroundSettings
from kvtier.transfer.demotion import Demoter
from kvtier.transfer.flights import (
    DemotionFlight,
    Flight,
    FlightRunner,
    Flights,
    InsertFlight,
    PrefetchFlight,
)
from kvtier.transfer.leasing import LeaseBook, Residency
from kvtier.transfer.prefetch import Prefetcher, PrefetchSettings
from kvtier.transfer.shared import Executor

log = logging.getLogger("kvtier.mover")

POLL_S = 0.0005
"""How often the thread polls an executor whose completion must be probed (CUDA events)."""

IDLE_WAKE_S = 0.25
"""The mover thread looks at watermarks and expiries at least this often."""


Landing = Callable[[], tuple[int, bytes]]
"""`throttle`'s `need`: how many of a call's new blocks go to gpu, and the namespace whose room
it is (`writes.gpu_need`), read under the cache's lock."""


@dataclass(frozen=True)
class MoverSettings:
    background: bool  # a thread publishes; copies run on `executor` behind the caller
    prefetch: PrefetchSettings
    work: BackgroundSettings
    store_wait_s: float = 0.0  # the longest a store waits in `throttle` (`mover.store_wait_s`)


class Mover:
    def __init__(
        self,
        demoter: Demoter,
        executor: Executor,
        clock: Callable[[], float],
        settings: MoverSettings,
    ) -> None:
        """`demoter.state.lock` is the cache's: every method but `kick` runs with it held,
        and the thread takes it."""
        state = demoter.state
        self.state = state
        self.index = state.index
        self.lock = state.lock
        self.clock = clock
        self.executor = executor
        self.background = settings.background
        self.flights = Flights()
        # a polled executor (CUDA events) completes a copy only when asked: a launch wakes the
        # thread, which then polls while flights are in the air instead of sleeping its tick
        launched = self.kick if executor.polled else None
        self.runner = FlightRunner(executor, self._on_finished, launched)
        self.residency = Residency(clock)
        self.book = LeaseBook(state.index, self.residency, state.gpu.layout.num_layers)
        self.prefetcher = Prefetcher(
            demoter, self.flights, self.runner, self.book, settings.prefetch
        )
        self.work = Background(demoter, self.flights, self.runner, settings.work)
        self.lift_on_lookup = settings.prefetch.lift_on_lookup
        self._publishers: dict[type[Flight], Callable[[Any], None]] = {
            PrefetchFlight: self.prefetcher.publish,
            DemotionFlight: self.work.publish_demotion,
            InsertFlight: self.work.publish_insert,
        }
        self._finished: deque[Flight] = deque()  # copies done, to publish (any thread appends)
        self._unpublished: list[Flight] = []  # finished, waiting for flights they joined
        self.stats = dict.fromkeys(("failed_flights", "step_errors", "throttled_stores"), 0)
        self.store_wait_s = settings.store_wait_s if settings.background else 0.0
        self.last_error = ""
        self._wake = threading.Event()
        self._drained = threading.Event()  # set whenever a flight finishes (for `drain`)
        self._published = threading.Event()  # set whenever a flight is published (`throttle`)
        self._stop = False
        self._thread: threading.Thread | None = None
        if settings.background:
            self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._wake), name="kvtier-mover", daemon=True
            )
            self._thread.start()

    # ---- the calls of the store (cache lock held) ------------------------------------------

    def match_prefix(self, namespace: BlockId, key: bytes) -> Match:
        """What a prefetch of `key` would lease (finished flights are published first), for
        the caller to check before `prefetch`."""
        self.reap()
        return self.prefetcher.match(namespace, key)

    def prefetch(
        self,
        match: Match,
        tenant: str,
        expires_at: float,
        canceller: Callable[[Lease], None] | None,
    ) -> Lease:
        """Lease `match` for `tenant`, PENDING until its copies are in (`prefetch.py`)."""
        lease = self.prefetcher.prefetch(match, tenant, expires_at, canceller)
        self.reap()  # inline copies are done already: publish them before returning
        return lease

    def insert_on_disk(
        self, match: Match, key: bytes, blocks: torch.Tensor, namespace: BlockId, tenant: str
    ) -> tuple[int, int]:
        """Write new blocks below a disk-only prefix (`background.py`): how many were taken,
        and how many of them are in the index already (all that landed, inline)."""
        flight = self.work.insert_on_disk(match, key, blocks, namespace, tenant)
        if flight is None:
            return 0, 0
        flight.in_call = True  # published by this reap, it is the call's to count
        self.reap()
        flight.in_call = False
        return len(flight.write.src_slots), flight.kept if flight.published else 0

    def throttle(
        self, most: int = 0, ahead: Callable[[], int] | None = None, need: Landing | None = None
    ) -> None:
        """Wait, at most `store_wait_s` and without the cache's lock (the caller must not hold
        it), while the work is behind, or host has room for the call's new blocks only by
        dropping unwritten ones, or gpu only once its demotions land (module doc). `most`: at
        most how many new blocks the call brings; `ahead()` (under the lock) plans their room
        and says for how many of them host still lacks it (0: none); `need()` (under the lock)
        how many of them go to gpu, for whose namespace. Any thread; it stores nothing."""
        if self.store_wait_s <= 0:
            return
        deadline = 0.0
        work = self.work
        while True:
            self._published.clear()  # before looking: a flight published after it wakes us
            with self.lock:
                if not work.behind() and work.has_room(most) and not self._landing(need):
                    return  # the common case
                self.reap()  # flights done: publish them, and plan the next ones down now
                work.keep_watermarks()
                lacking = ahead() if ahead is not None else 0
                if not work.behind() and not work.short(lacking) and not self._landing(need):
                    return
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.store_wait_s
                    self.stats["throttled_stores"] += 1
            if now >= deadline:
                return
            self._published.wait(deadline - now)

    def _landing(self, need: Landing | None) -> bool:
        """Whether gpu has room for the call's gpu-bound new blocks (`need()`: none when they
        are cached or go below gpu) only once its demotion flights land: its free slots and the
        copies no lease, pin or flight holds, for the call's namespace, fall short while flights
        from it are in the air (each pins its node whole). A store then dropped every block at
        once while the copies that would free them were milliseconds from landing (gpu 8, two
        4-block prompts, then six more stored: 24 of 24 blocks dropped, audit BO)."""
        if need is None or not self.work.demoting[GPU]:
            return False
        count, owner = need()  # (a re-store of a cached prompt: 0, no wait; review R1)
        room = min(count, self.state.gpu.num_slots)
        return count > 0 and not self.work.demoter.can_make_room(GPU, room, owner)

    def doom(self, ref: BlockRef) -> None:
        """A load found `ref`'s disk copy corrupt while some of it is locked: it is dropped,
        with what hangs below it, once nothing there is (`Prefetcher.doom`)."""
        self.prefetcher.doom(ref)

    def note_lookup(self, namespace: BlockId, key: bytes) -> None:
        self.prefetcher.note_lookup(namespace, key)
        self._wake.set()

    def expire(self) -> int:
        """End every lease past its expiry (the store's clock); return how many."""
        return self.book.expire(self.clock())

    # ---- publishing ------------------------------------------------------------------------

    def _on_finished(self, flight: Flight) -> None:
        """Called once per flight by the thread that completed its last copy."""
        self._finished.append(flight)
        self._wake.set()
        self._drained.set()

    def reap(self) -> None:
        """Publish every finished flight whose joined flights are published."""
        self.executor.poll()  # drives CUDA completion; drains the thread executor's list
        while self._finished:
            self._unpublished.append(self._finished.popleft())
        progress = True
        while progress and self._unpublished:
            progress = False
            for flight in list(self._unpublished):
                if all(a.published for a in flight.after):
                    self._unpublished.remove(flight)
                    self._publish(flight)
                    progress = True

    def _publish(self, flight: Flight) -> None:
        if any(a.failed for a in flight.after) and not flight.failed:
            flight.failed = "a prefetch it joined failed"
        flight.published = True
        self.flights.discard(flight)
        self._publishers[type(flight)](flight)
        self._published.set()
        if flight.failed:
            self.stats["failed_flights"] += 1
            self.last_error = printable(flight.failed, ERROR_CHARS)
        self.prefetcher.drop_doomed()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every flight is published (lock held: copies need no lock, and the
        thread that would publish waits for it); True if none is left within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        polled = self.executor.polled
        while True:
            self._drained.clear()
            self.reap()
            if not self.flights:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._drained.wait(min(left, POLL_S if polled else 0.05))

    def step(self) -> None:
        """One round of the mover's work: publish, expire, drop corrupt blocks no longer
        locked, keep watermarks, lift. The thread runs it on every wake; inline stores call
        it after each change."""
        self.reap()
        self.state.ops["leases_expired"] += self.expire()
        self.prefetcher.drop_doomed()
        self.work.keep_watermarks()
        if self.lift_on_lookup:
            low = int(self.work.watermarks[GPU][1] * self.state.gpu.num_slots)
            self.prefetcher.lift(lambda: low - self.work.pressure(GPU))
        self.reap()

    # ---- the thread ------------------------------------------------------------------------

    def kick(self) -> None:
        """Wake the thread (any thread may call it, with or without the cache's lock)."""
        self._wake.set()

    def wait_s(self) -> float:
        """How long the thread may sleep: a CUDA handle completes only when its event is
        queried, so poll while copies run; thread executors wake it from done callbacks."""
        return POLL_S if self.executor.polled and self.flights else IDLE_WAKE_S

    def round(self) -> bool:
        """One wake of the thread; False when it should end."""
        with self.lock:
            if self._stop:
                return False
            try:
                self.step()
            except ClosedError:
                return False
            except Exception as exc:  # a bug: keep it visible in status, and keep moving
                self.last_error = printable(f"mover step raised {exc!r}", ERROR_CHARS)
                self.stats["step_errors"] += 1
                log.exception("kvtier mover step failed")
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """End every lease (pending ones CANCELLED, ready ones RELEASED, waiters wake), wait
        (bounded) for the copies in flight and publish them, stop the thread. Call without the
        cache's lock: the thread needs it to stop."""
        with self.lock:
            self._stop = True
            self.book.close("the store closed")
            if not self.drain(timeout_s):
                log.warning("kvtier mover: %d flights still in flight at close", len(self.flights))
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self.executor.close()

    # ---- accounting ------------------------------------------------------------------------

    def idle(self) -> bool:
        """No flight planned or finished and unpublished."""
        return not self.flights and not self._finished and not self._unpublished

    def reserved(self, tier: int) -> int:
        """Slots of `tier` that flights have allocated and the index does not know yet."""
        return self.flights.reserved(tier)

    def status(self) -> dict[str, Any]:
        book = self.book.status()
        return {
            "background": self.background,
            "in_flight": len(self.flights),
            "queued_transfers": self.executor.queued(),
            "pending_leases": book["pending_leases"],
            "corrupt_pending_drop": self.prefetcher.corrupt_pending_drop(),
            **self.prefetcher.stats,
            **self.work.stats,
            "leases_cancelled": self.book.cancelled,
            "leases_failed": self.book.failed,
            **self.stats,
            "prefetch_to_ready_s": book["prefetch_to_ready_s"],
            "last_error": self.last_error,
        }

    def check(self) -> None:
        """Flights own their slots alone and their pins are live; the in-flight map is current;
        the lease book is consistent."""
        self.flights.check(self.state)
        self.prefetcher.check()
        self.book.check()


def _run(ref: weakref.ref[Mover], wake: threading.Event) -> None:
    """The mover thread. It holds its mover only while it works, so that a store dropped
    without `close()` is collected and its thread ends."""
    while True:
        mover = ref()
        if mover is None:
            return
        timeout = mover.wait_s()
        del mover
        wake.wait(timeout)
        wake.clear()
        mover = ref()
        if mover is None or not mover.round():
            return
        del mover
