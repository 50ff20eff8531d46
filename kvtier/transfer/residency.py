"""The residency view: which gpu slots a kernel may read now, without the cache's lock.

The lease book (`leasing.py`) adds a lease's block table here when the lease turns READY and
removes it when the lease ends; `covers(slot)` is true while some READY lease that has not
passed its expiry (the cache's clock) names the slot. While such a lease lives, its slots hold
exactly its blocks (DESIGN invariant 4), so a kernel that reads only covered slots reads the
blocks it was leased. `PagedAttention` (`kernels/attention.py`) checks every slot of a launch
here: a dict lookup per slot, under this view's own small lock, never the cache's lock and
never a set rebuilt per launch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


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
