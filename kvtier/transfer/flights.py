"""Flights: the copies of one mover decision, from submit to the moment the index learns of them.

A flight is planned under the cache's lock: it pins the path of its blocks (a never-expiring
lease, so no source copy is evicted or dropped while it is read: a prefetch in every tier, a
demotion in its source tier, a disk insert on disk), owns the destination slots it allocated
(`dst`: allocated in a pool, not yet in the index), and names its blocks by position along the
pinned path (positions survive node splits). Each kind is its own type, built complete by its
planner; its copies then run without the lock, on the executor's threads or streams, and the
`FlightRunner` here counts them off. When the last one is done the flight goes to the mover's
finished queue, and the mover has its planner publish it under the lock (DESIGN invariant 1: a
copy is visible only once complete).

    type             planned by        copies                              published as
    PrefetchFlight   prefetch.py       [disk -> host staging], then host   gpu (and host) copies;
                                       -> gpu in `groups` layer ranges     its leases turn READY
    DemotionFlight   background.py     tier -> next tier (`demotion.py`)   the lower copies, then
                                                                           the faster ones freed
    InsertFlight     background.py     host staging -> disk (new blocks    new index blocks on
                                       below a disk-only prefix)           disk

Callbacks run on whatever thread completes a handle (a worker, or the thread polling CUDA
events). They never take the cache's lock: they touch only their flight's outcome fields and
tell the leases waiting on it of progress (`LeaseOwner.progress`), both under the flight's own
lock, which the lease book also takes to add or forget a waiting lease (`wait`, `forget`): so a
lease never ends while a callback tells it of progress (the book ends it under the cache's lock,
after forgetting it). A callback counts its copy off whatever it raises, so a flight always
finishes and is published (its pin and slots given back). `Flights` is the set of flights
planned and not yet published, and what they hold.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier.errors import ClosedError, InvariantError
from kvtier.index import LeaseId
from kvtier.index.leases import LeaseRecord
from kvtier.results import LeaseOwner
from kvtier.tiers.base import HOST
from kvtier.transfer.copy import Transfer
from kvtier.transfer.demotion import CopyDown
from kvtier.transfer.shared import CacheState, Executor, TransferHandle


@dataclass(eq=False, kw_only=True)
class Flight:
    pin: LeaseRecord  # locks the path to pin.end (in the tiers it reads) until published
    positions: list[int]  # the flight's blocks, as positions from the namespace root
    dst: dict[int, list[int]]  # tier -> slots it allocated, not in the index before publishing
    after: list[Flight] = field(default_factory=list)  # flights to publish before this one
    # outcome, written by callbacks under `lock`
    failed: str = field(default="", init=False)  # why, when a copy failed or raised
    published: bool = field(default=False, init=False)  # the index knows (or the mover gave up)
    lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    outstanding: int = field(default=0, init=False)  # the runner's: copies not done
    launched: bool = field(default=False, init=False)  # the runner's: first copies submitted
    finished: bool = field(default=False, init=False)  # the runner's: on_finished was called

    def reserved(self, tier: int) -> int:
        return len(self.dst.get(tier, ()))


@dataclass(eq=False, kw_only=True)
class PrefetchFlight(Flight):
    """Brings blocks up to gpu: `read` (disk -> host staging, or straight to gpu) first, then
    `group_transfers` (host -> gpu, one per layer group). Joined flights are in `after`."""

    groups: int  # layer groups of the final copy
    read: Transfer | None  # disk -> host staging (dst[HOST]) or -> gpu, before the groups
    read_positions: list[int]  # the blocks `read` carries
    group_transfers: list[Transfer]
    leases: list[LeaseOwner] = field(default_factory=list, init=False)  # waiting on it
    layers_done: int = field(default=0, init=False)  # layer groups complete in every block
    bad_position: int | None = field(default=None, init=False)  # failed verification

    def wait(self, lease: LeaseOwner) -> None:
        """`lease` waits on this flight: told of each layer group (module doc)."""
        with self.lock:
            self.leases.append(lease)

    def forget(self, lease: LeaseOwner) -> None:
        """`lease` ended: no callback tells it of progress from now on, and none is telling it
        now (it holds the lock while it does)."""
        with self.lock:
            if lease in self.leases:
                self.leases.remove(lease)

    def staged(self) -> dict[int, int]:
        """Position -> host staging slot of each block read from disk through host."""
        stage = self.dst.get(HOST)
        return {} if stage is None else dict(zip(self.read_positions, stage, strict=True))


@dataclass(eq=False, kw_only=True)
class BlockFlight(Flight):
    """A flight of whole-block copies whose outcome is per block (`ok`)."""

    ok: list[bool] = field(default_factory=list, init=False)


@dataclass(eq=False, kw_only=True)
class DemotionFlight(BlockFlight):
    """Copies a batch of blocks of one node down one tier; once they are in, the faster copies
    are freed (unless leased)."""

    copy: CopyDown


@dataclass(eq=False, kw_only=True)
class InsertFlight(BlockFlight):
    """Writes new blocks that extend a disk-only prefix from host staging slots to disk; they
    enter the index (blocks `first_block` on of `key` in `namespace`) once durable, counted
    stored for `tenant` then if they landed after the call."""

    namespace: bytes
    tenant: str
    key: bytes
    first_block: int
    write: Transfer
    kept: int = field(default=0, init=False)  # blocks that entered the index when published
    in_call: bool = field(default=False, init=False)  # published inside the storing call


_F = TypeVar("_F", bound=Flight)


class Flights:
    """The flights planned and not yet published: what slots they own (`reserved`), which
    pins are theirs, and `check()` that no two own a slot and every pin is live."""

    def __init__(self) -> None:
        self.live: set[Flight] = set()

    def add(self, flight: Flight) -> None:
        self.live.add(flight)

    def discard(self, flight: Flight) -> None:
        self.live.discard(flight)

    def __len__(self) -> int:
        return len(self.live)

    def reserved(self, tier: int) -> int:
        """Slots of `tier` that flights have allocated and the index does not know yet."""
        return sum(flight.reserved(tier) for flight in self.live)

    def pin_ids(self) -> set[LeaseId]:
        """The lease ids of the flights' pins (they are leases of the index, not of clients)."""
        return {flight.pin.lease_id for flight in self.live}

    def check(self, state: CacheState) -> None:
        owned: set[tuple[int, int]] = set()
        for flight in self.live:
            if flight.pin.lease_id not in state.index.leases:
                raise InvariantError(f"{type(flight).__name__}: pin {flight.pin.lease_id} is gone")
            for tier, slots in flight.dst.items():
                for slot in slots:
                    if (tier, slot) in owned:
                        raise InvariantError(f"{state.pools[tier].name} slot {slot}: two flights")
                    owned.add((tier, slot))


class FlightRunner:
    """Submits a flight's transfers and calls `on_finished(flight)` once, when every copy of it
    is done (successfully or not), and `on_launched()` once its transfers are submitted (the
    mover wakes its thread there: with CUDA events nothing else would tell it a copy began).
    Thread-safe; holds no lock of the cache."""

    def __init__(
        self,
        executor: Executor,
        on_finished: Callable[[Flight], None],
        on_launched: Callable[[], None] | None = None,
    ) -> None:
        self.executor = executor
        self.on_finished = on_finished
        self.on_launched = on_launched

    def launch(self, flight: BlockFlight, transfer: Transfer) -> None:
        """Start a demotion or insert flight: its transfer, whose per-block outcomes are kept."""
        self._submit(flight, [transfer], self._blocks_done)
        self._launched(flight)

    def launch_prefetch(self, flight: PrefetchFlight) -> None:
        """Start a prefetch: the disk read first if any, then the layer groups."""
        if flight.read is not None:
            self._submit(flight, [flight.read], self._read_done)
        else:
            self._submit_groups(flight)
        self._launched(flight)

    # ---- callbacks (any thread) -----------------------------------------------------------

    def _read_done(self, flight: PrefetchFlight, handle: TransferHandle) -> None:
        try:
            ok = handle.result()
        except Exception as exc:
            self._fail(flight, f"disk read raised {exc!r}")
        else:
            if all(ok):
                # the groups are submitted before this read counts as done: the flight stays
                # open until they are
                try:
                    self._submit_groups(flight)
                except BaseException as exc:
                    self._fail(flight, f"submitting the copies to gpu raised {exc!r}")
                    raise
                finally:
                    self._one_done(flight)
                return
            bad = ok.index(False)
            with flight.lock:
                flight.bad_position = flight.read_positions[bad]
            self._fail(flight, "a disk copy failed verification")
        self._one_done(flight)

    def _group_done(self, flight: PrefetchFlight, handle: TransferHandle) -> None:
        try:
            handle.result()
        except Exception as exc:
            self._fail(flight, f"copy to gpu raised {exc!r}")
            self._one_done(flight)
            return
        try:
            with flight.lock:  # the book forgets an ending lease under it (module doc)
                flight.layers_done += 1
                for lease in flight.leases:
                    lease.progress()
        finally:
            self._one_done(flight)

    def _blocks_done(self, flight: BlockFlight, handle: TransferHandle) -> None:
        try:
            ok = handle.result()
        except Exception as exc:
            ok = [False] * len(handle.transfer.src_slots)
            self._fail(flight, f"copy raised {exc!r}")
        with flight.lock:
            flight.ok.extend(ok)
        self._one_done(flight)

    # ---- bookkeeping ----------------------------------------------------------------------

    def _submit_groups(self, flight: PrefetchFlight) -> None:
        if not flight.group_transfers:  # nothing to copy up: every layer is in
            with flight.lock:
                flight.layers_done = flight.groups
        self._submit(flight, flight.group_transfers, self._group_done)

    def _submit(
        self, flight: _F, transfers: list[Transfer], done: Callable[[_F, TransferHandle], None]
    ) -> None:
        for transfer in transfers:
            with flight.lock:
                if flight.failed:
                    return
                flight.outstanding += 1
            try:
                handle = self.executor.submit(transfer)
            except Exception as exc:  # counted off, so that the flight finishes (module doc)
                closed = isinstance(exc, ClosedError)
                self._fail(flight, f"mover closed: {exc}" if closed else f"a copy raised {exc!r}")
                self._one_done(flight)
                if closed:
                    return
                raise
            handle.add_done_callback(lambda h: done(flight, h))

    def _launched(self, flight: Flight) -> None:
        with flight.lock:
            flight.launched = True
        if self.on_launched is not None:
            self.on_launched()
        self._one_done(flight, count=False)

    def _fail(self, flight: Flight, why: str) -> None:
        with flight.lock:
            if not flight.failed:
                flight.failed = why

    def _one_done(self, flight: Flight, count: bool = True) -> None:
        with flight.lock:
            if count:
                flight.outstanding -= 1
            last = flight.launched and flight.outstanding == 0 and not flight.finished
            if last:
                flight.finished = True
        if last:
            self.on_finished(flight)
