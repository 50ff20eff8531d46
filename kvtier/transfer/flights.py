"""Flights: the copies of one mover decision, from submit to the moment the index learns of them.

A flight is planned under the store's lock (`mover.py`): it pins the path of its blocks (a
never-expiring lease, so no source copy is evicted or dropped while it is read: a prefetch in
every tier, a demotion in its source tier, a disk insert on disk), owns the
destination slots it allocated (`dst`, reserved: allocated in a pool, not yet in the index), and
names its blocks by position along the pinned path (positions survive node splits). Its copies
then run without the lock, on the executor's threads or streams; the done callbacks here count
them off. When the last one is done the flight goes on the mover's finished queue, and the mover
publishes it to the index under the lock (DESIGN invariant 1: a copy is visible only once
complete).

    kinds      copies                                           published as
    prefetch   [disk -> host staging], then host -> gpu in      gpu (and host) copies; the
               `groups` layer-range transfers                   leases waiting on it turn READY
    demote     tier -> lower tier, whole blocks                  the lower copy, then the faster
                                                                copy freed (unless leased)
    insert     host staging -> disk (new blocks below a         new index blocks on disk
               disk-only prefix)

Callbacks run on whatever thread completes a handle (a worker, or the thread polling CUDA
events). They never take the store's lock: they touch only this flight's counters (under its own
lock) and the leases waiting on it (`Lease._progress`, under each lease's own lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.errors import ClosedError
from kvtier.index.leases import LeaseRecord
from kvtier.results import Lease
from kvtier.transfer.copy import Transfer
from kvtier.transfer.handles import Executor, TransferHandle


@dataclass(eq=False)
class Flight:
    kind: str  # "prefetch" | "demote" | "insert"
    pin: LeaseRecord  # locks the path to pin.end (in the tiers it reads) until published
    positions: list[int]  # the flight's blocks, as positions from the namespace root
    dst: dict[int, list[int]] = field(default_factory=dict)  # tier -> slots it allocated
    groups: int = 1  # layer groups of the final copy (prefetch)
    # prefetch: the transfers, and where each block's data comes from
    read: Transfer | None = None  # disk -> host staging (or -> gpu), before the groups
    group_transfers: list[Transfer] = field(default_factory=list)
    read_positions: list[int] = field(default_factory=list)  # the blocks `read` carries
    staged: dict[int, int] = field(default_factory=dict)  # position -> host staging slot
    after: list[Flight] = field(default_factory=list)  # joined flights: published first
    leases: list[Lease] = field(default_factory=list)  # waiting on this flight
    # demote: source tier, whether its copies are freed once the lower copy is in
    src_tier: int = 0
    free_src: bool = False
    # insert: what to index when the write is durable
    namespace: bytes = b""
    key: bytes = b""
    first_block: int = 0
    # outcome, written by callbacks under `lock`
    layers_done: int = 0  # layer groups complete in every block
    ok: list[bool] = field(default_factory=list)  # per block, for demote and insert
    failed: str = ""  # why, when a copy failed or raised
    bad_position: int | None = None  # a disk copy that failed verification
    published: bool = False  # the mover has told the index (or given up)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _outstanding: int = 0
    _launched: bool = False
    _finished: bool = False

    def reserved(self, tier: int) -> int:
        return len(self.dst.get(tier, ()))


class FlightRunner:
    """Submits a flight's transfers and calls `on_finished(flight)` once, when every copy of it
    is done (successfully or not). Thread-safe; holds no lock of the store."""

    def __init__(self, executor: Executor, on_finished: Callable[[Flight], None]) -> None:
        self.executor = executor
        self.on_finished = on_finished

    def launch(self, flight: Flight, transfers: list[Transfer]) -> None:
        """Start a demote or insert flight: its transfers, whose per-block outcomes are kept."""
        self._submit(flight, transfers, self._blocks_done)
        self._launched(flight)

    def launch_prefetch(self, flight: Flight) -> None:
        """Start a prefetch: the disk read first if any, then the layer groups."""
        if flight.read is not None:
            self._submit(flight, [flight.read], self._read_done)
        else:
            self._submit(flight, flight.group_transfers, self._group_done)
        self._launched(flight)

    # ---- callbacks (any thread) -----------------------------------------------------------

    def _read_done(self, flight: Flight, handle: TransferHandle) -> None:
        try:
            ok = handle.result()
        except Exception as exc:
            self._fail(flight, f"disk read raised {exc!r}")
        else:
            if all(ok):
                # the groups are submitted before this read counts as done: the flight stays
                # open until they are
                self._submit(flight, flight.group_transfers, self._group_done)
            else:
                bad = ok.index(False)
                with flight.lock:
                    flight.bad_position = flight.read_positions[bad]
                self._fail(flight, "a disk copy failed verification")
        self._one_done(flight)

    def _group_done(self, flight: Flight, handle: TransferHandle) -> None:
        try:
            handle.result()
        except Exception as exc:
            self._fail(flight, f"copy to gpu raised {exc!r}")
        else:
            with flight.lock:
                flight.layers_done += 1
            for lease in list(flight.leases):
                lease._progress()
        self._one_done(flight)

    def _blocks_done(self, flight: Flight, handle: TransferHandle) -> None:
        try:
            ok = handle.result()
        except Exception as exc:
            ok = [False] * len(handle.transfer.src_slots)
            self._fail(flight, f"copy raised {exc!r}")
        with flight.lock:
            flight.ok.extend(ok)
        self._one_done(flight)

    # ---- bookkeeping ----------------------------------------------------------------------

    def _submit(
        self,
        flight: Flight,
        transfers: list[Transfer],
        done: Callable[[Flight, TransferHandle], None],
    ) -> None:
        if not transfers and done is self._group_done:  # nothing to copy: every layer is in
            with flight.lock:
                flight.layers_done = flight.groups
        for transfer in transfers:
            with flight.lock:
                if flight.failed:
                    return
                flight._outstanding += 1
            try:
                handle = self.executor.submit(transfer)
            except ClosedError as exc:
                self._fail(flight, f"mover closed: {exc}")
                self._one_done(flight)
                return
            handle.add_done_callback(lambda h, done=done: done(flight, h))  # type: ignore[misc]

    def _launched(self, flight: Flight) -> None:
        with flight.lock:
            flight._launched = True
        self._one_done(flight, count=False)

    def _fail(self, flight: Flight, why: str) -> None:
        with flight.lock:
            if not flight.failed:
                flight.failed = why

    def _one_done(self, flight: Flight, count: bool = True) -> None:
        with flight.lock:
            if count:
                flight._outstanding -= 1
            last = flight._launched and flight._outstanding == 0 and not flight._finished
            if last:
                flight._finished = True
        if last:
            self.on_finished(flight)
