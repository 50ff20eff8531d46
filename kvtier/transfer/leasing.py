"""Leases, owner side: the lease state machine, and the residency view kernels read.

The lease book: every live client lease and the state machine that moves it.

    open (PENDING, its flights named)  --all published-->  READY (locked on gpu only)
         |                                                    |
         +--> CANCELLED / FAILED / EXPIRED                    +--> RELEASED / EXPIRED

Contract:
- A lease is opened under the cache's lock with the index record that locks its path (in every
  tier while pending: its sources must stay) and the flights it waits on; `settle` makes it
  READY once every one of them is published (the record narrows to gpu and the residency view
  learns its slots), or FAILED if one failed. `release`, `cancel`, `expire` and `close` end it;
  every waiter wakes (`LeaseOwner.resolve`, the owner's side of `results.Lease`).
- `leases_of(tenant)` counts a tenant's live leases (its quota, `tenancy.py`).
- Thread: every method runs under the cache's lock (a call of the store, or the mover thread).

The residency view: which gpu slots a kernel may read now, without the cache's lock.

The lease book (`leasing.py`) adds a lease's block table here when the lease turns READY and
removes it when the lease ends, each before the lease's waiters wake; `covers(slot)` is true
while some READY lease that has not passed its expiry (the cache's clock) names the slot. While
such a lease lives, its slots hold exactly its blocks (DESIGN invariant 4), so a kernel that
reads only covered slots reads the blocks it was leased. `PagedAttention`
(`kernels/attention.py`) checks every slot of a launch here: a dict lookup per slot, under this
view's own small lock, never the cache's lock and
never a set rebuilt per launch.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.errors import InvariantError, LeaseError, shown
from kvtier.index import LeaseId, RadixIndex
from kvtier.index.leases import LeaseRecord
from kvtier.results import Lease, LeaseOwner, LeaseState
from kvtier.tiers.base import GPU
from kvtier.transfer.flights import PrefetchFlight


class Residency:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_slot: dict[int, dict[int, float]] = {}  # slot -> {lease id: expires at}
        self._tables: dict[int, tuple[int, ...]] = {}  # lease id -> its block table

    def add(self, lease_id: int, slots: tuple[int, ...], expires_at: float) -> None:
        with self._lock:
            self._tables[lease_id] = slots
            for slot in slots:
                self._by_slot.setdefault(slot, {})[lease_id] = expires_at

    def remove(self, lease_id: int) -> None:
        with self._lock:
            for slot in self._tables.pop(lease_id, ()):
                holders = self._by_slot[slot]
                del holders[lease_id]
                if not holders:
                    del self._by_slot[slot]

    def uncovered(self, slots: Iterable[int]) -> int | None:
        """The first of `slots` that no live READY lease covers, or None if all are covered."""
        now = self._clock()
        with self._lock:
            for slot in slots:
                holders = self._by_slot.get(slot)
                if holders is None or not any(at > now for at in holders.values()):
                    return slot
        return None

    def slots(self) -> frozenset[int]:
        """Every covered slot (a snapshot)."""
        now = self._clock()
        with self._lock:
            return frozenset(
                slot
                for slot, holders in self._by_slot.items()
                if any(at > now for at in holders.values())
            )

    def leases(self) -> set[int]:
        with self._lock:
            return set(self._tables)


RECENT_READY = 1024
"""Prefetch-to-ready times kept for the status percentiles."""


class LeaseBook:
    def __init__(self, index: RadixIndex, residency: Residency, num_layers: int) -> None:
        self.index = index
        self.residency = residency
        self.num_layers = num_layers
        self._owners: dict[LeaseId, LeaseOwner] = {}
        self._per_tenant: dict[str, int] = {}  # live leases per tenant
        self._waits: dict[LeaseId, list[PrefetchFlight]] = {}  # pending lease -> its flights
        self._ready_s: deque[float] = deque(maxlen=RECENT_READY)
        self.cancelled = 0
        self.failed = 0

    # ---- reading ---------------------------------------------------------------------------

    def get(self, lease_id: LeaseId) -> Lease | None:
        owner = self._owners.get(lease_id)
        return None if owner is None else owner.lease

    def leases(self) -> list[Lease]:
        return [owner.lease for owner in self._owners.values()]

    def ids(self) -> set[LeaseId]:
        return set(self._owners)

    def leases_of(self, tenant: str) -> int:
        """Live leases of `tenant` (pending or ready)."""
        return self._per_tenant.get(tenant, 0)

    # ---- opening and settling --------------------------------------------------------------

    def open(
        self,
        record: LeaseRecord,
        tenant: str,
        table: tuple[int, ...],
        flights: Sequence[PrefetchFlight],
        layers_of: Callable[[int], int],
        canceller: Callable[[Lease], None] | None,
    ) -> Lease:
        """A PENDING lease on `record`'s path that waits on `flights` (`layers_of(g)`: leading
        layers complete once g layer groups are), settled at once if nothing is in flight."""
        lease = Lease(
            record.lease_id,
            tenant,
            record.num_blocks * self.index.block_tokens,
            table,
            record.expires_at,
            num_layers=self.num_layers,
            pending=True,
            canceller=canceller,
        )
        owner = LeaseOwner(lease)
        self._owners[record.lease_id] = owner
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._waits[record.lease_id] = list(flights)
        for flight in flights:  # all of them before any flight's callback can see the lease
            owner.wait_on(flight, layers_of)
        for flight in flights:
            flight.wait(owner)
        owner.progress()
        self.settle(owner)
        return lease

    def settle(self, owner: LeaseOwner) -> None:
        """Make a pending lease READY once all its flights are published, FAILED if one failed."""
        lease = owner.lease
        if lease.state is not LeaseState.PENDING:
            return
        lease_id = LeaseId(lease.lease_id)
        flights = self._waits.get(lease_id, [])
        failed = next((f for f in flights if f.published and f.failed), None)
        if failed is not None:
            self.index.leases.release(lease_id)
            self.failed += 1
            self._end(owner, LeaseState.FAILED, failed.failed)
            return
        if all(f.published for f in flights):
            self.index.leases.narrow(lease_id, (GPU,))
            self._waits.pop(lease_id, None)
            # the view first: `resolve` wakes waiters, which launch kernels at once, without
            # the cache's lock (in the other order one was refused a READY lease's pages)
            self.residency.add(lease.lease_id, lease.block_table, lease.expires_at)
            owner.resolve(LeaseState.READY)
            if lease.ready_after_s is not None and flights:
                self._ready_s.append(lease.ready_after_s)

    # ---- ending ----------------------------------------------------------------------------

    def release(self, lease_id: LeaseId) -> None:
        """Unlock a lease in any live state (`LeaseError` if unknown, released or expired): a
        ready one ends RELEASED, a pending one CANCELLED, counted in `cancelled` as `cancel`
        counts it (the sidecar's `/v1/release` ends both kinds)."""
        owner = self._owners.get(lease_id)
        if owner is None:  # never the id of a pin: those are the mover's own
            raise LeaseError(f"lease {shown(lease_id)}: unknown, released or expired")
        self.index.leases.release(lease_id)
        if owner.lease.ready():
            self._end(owner, LeaseState.RELEASED)
            return
        self.cancelled += 1
        self._end(owner, LeaseState.CANCELLED, "released before it was ready")

    def cancel(self, lease: Lease) -> None:
        """Cancel a pending lease (its flights go on and publish; nothing waits on them), or
        release a ready one."""
        owner = self._owners.get(LeaseId(lease.lease_id))
        if owner is None or owner.lease is not lease:
            raise LeaseError(f"lease {shown(lease.lease_id)}: unknown, released or expired")
        if lease.ready():
            self.release(LeaseId(lease.lease_id))
            return
        self.index.leases.release(LeaseId(lease.lease_id))
        self.cancelled += 1
        self._end(owner, LeaseState.CANCELLED, "cancelled")

    def expire(self, now: float) -> int:
        """End every lease past its expiry at `now`; return how many."""
        expired = self.index.leases.expire(now)
        for record in expired:
            owner = self._owners.get(record.lease_id)
            if owner is not None:
                self._end(owner, LeaseState.EXPIRED, "expired before it was released")
        return len(expired)

    def close(self, reason: str) -> None:
        """End every lease: pending ones CANCELLED, ready ones RELEASED."""
        for lease_id, owner in list(self._owners.items()):
            self.index.leases.release(lease_id)
            state = LeaseState.RELEASED if owner.lease.ready() else LeaseState.CANCELLED
            self._end(owner, state, reason)

    def _end(self, owner: LeaseOwner, state: LeaseState, reason: str = "") -> None:
        """The index record is gone already: forget the lease and wake its waiters."""
        lease = owner.lease
        lease_id = LeaseId(lease.lease_id)
        if self._owners.pop(lease_id, None) is not None:
            left = self._per_tenant[lease.tenant] - 1
            if left:
                self._per_tenant[lease.tenant] = left
            else:
                del self._per_tenant[lease.tenant]
        for flight in self._waits.pop(lease_id, ()):
            flight.forget(owner)  # before it resolves: no callback is telling it of progress
        self.residency.remove(lease.lease_id)
        owner.resolve(state, reason)

    # ---- accounting ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        ready = sorted(self._ready_s)
        return {
            "pending_leases": sum(1 for owner in self._owners.values() if not owner.lease.ready()),
            "prefetch_to_ready_s": {
                "count": len(ready),
                "p50": statistics.median(ready) if ready else 0.0,
                "p99": ready[min(len(ready) - 1, int(0.99 * len(ready)))] if ready else 0.0,
            },
        }

    def check(self) -> None:
        """Every live lease is in the index, PENDING or READY, counted for its tenant, and in
        the residency view exactly when READY."""
        per_tenant: dict[str, int] = {}
        for lease_id, owner in self._owners.items():
            lease = owner.lease
            if lease_id not in self.index.leases:
                raise InvariantError(f"lease {lease_id}: live in the book, gone from the index")
            if lease.state not in (LeaseState.PENDING, LeaseState.READY):
                raise InvariantError(f"lease {lease_id}: {lease.state.value} but still live")
            per_tenant[lease.tenant] = per_tenant.get(lease.tenant, 0) + 1
        if per_tenant != self._per_tenant:
            raise InvariantError(f"leases per tenant {self._per_tenant} != recount {per_tenant}")
        ready = {lid for lid, owner in self._owners.items() if owner.lease.ready()}
        if self.residency.leases() != ready:
            raise InvariantError(
                f"residency view names leases {sorted(self.residency.leases())}, "
                f"the READY ones are {sorted(ready)}"
            )
