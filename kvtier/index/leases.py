"""Leases: read locks on a cached prefix in some tiers, with an expiry.

A lease covers every block from a namespace root down to the end of one node (leases end on
node boundaries: the index splits a node where a leased prefix ends). Acquiring it adds one to
`node.locks[t]` for each leased tier t on every node of that path; a locked node offers no
eviction candidate in that tier, so leased copies are never evicted (DESIGN invariant 4).
Leases expire at `expires_at` (a caller-supplied clock reading), so a crashed client cannot pin
memory forever; the store calls `expire(now)`. The store's own short pins are leases that
never expire, released before the store call returns.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import LeaseError
from kvtier.index.node import Node
from kvtier.index.results import LeaseId

if TYPE_CHECKING:
    from kvtier.index.radix import RadixIndex


@dataclass(frozen=True)
class LeaseRecord:
    lease_id: LeaseId
    end: Node
    tiers: tuple[int, ...]
    expires_at: float
    num_blocks: int
    resident: bool = True  # every block of the path has a copy in each of `tiers` (checked)


class LeaseTable:
    def __init__(self, index: RadixIndex, first_id: int = 1) -> None:
        """Lease ids count up from `first_id` (the store starts each process at a random one,
        so that an id held across a restart never names another client's lease)."""
        self._index = index
        self._records: dict[LeaseId, LeaseRecord] = {}
        self._expiry: list[tuple[float, LeaseId]] = []
        self._next = first_id

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._records

    def __iter__(self) -> Iterator[LeaseRecord]:
        return iter(list(self._records.values()))

    def get(self, lease_id: LeaseId) -> LeaseRecord:
        record = self._records.get(lease_id)
        if record is None:
            raise LeaseError(f"lease {lease_id}: unknown, released or expired")
        return record

    def acquire(
        self,
        end: Node,
        tiers: tuple[int, ...],
        expires_at: float,
        num_blocks: int,
        *,
        resident: bool = True,
    ) -> LeaseRecord:
        """Lock the prefix ending at `end` in `tiers` until `expires_at` (math.inf: never).
        `resident`: the prefix has a copy in each of `tiers` and keeps it (`check()` verifies
        it); False for a pure lock (a pin, a prefetch whose copies are in flight), which only
        stops copies in those tiers from leaving."""
        record = LeaseRecord(LeaseId(self._next), end, tiers, expires_at, num_blocks, resident)
        self._next += 1
        self._records[record.lease_id] = record
        if expires_at != math.inf:
            heapq.heappush(self._expiry, (expires_at, record.lease_id))
        self._lock(end, tiers, +1)
        return record

    def release(self, lease_id: LeaseId) -> LeaseRecord:
        """Unlock a lease; LeaseError if it is unknown (never acquired, released or expired)."""
        record = self._records.pop(lease_id, None)
        if record is None:
            raise LeaseError(f"lease {lease_id}: unknown, released or expired")
        self._lock(record.end, record.tiers, -1)
        return record

    def narrow(self, lease_id: LeaseId, tiers: tuple[int, ...]) -> LeaseRecord:
        """Keep a lease (same id, prefix and expiry) but lock only `tiers` from now on, which
        now hold the whole prefix: a prefetch locks its path in every tier while copies run,
        then holds it resident on gpu."""
        record = self.get(lease_id)
        self._lock(record.end, tiers, +1)
        self._lock(record.end, record.tiers, -1)
        narrowed = LeaseRecord(
            lease_id, record.end, tiers, record.expires_at, record.num_blocks, resident=True
        )
        self._records[lease_id] = narrowed
        return narrowed

    def expire(self, now: float) -> list[LeaseRecord]:
        """Release every lease whose expiry is at or before `now`; return them."""
        expired = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            if lease_id in self._records:
                expired.append(self.release(lease_id))
        return expired

    def locked_blocks(self, tier: int, *, pins: bool = True) -> int:
        """Blocks with a copy in `tier` that a lease (or, with `pins`, a pin: a record that
        never expires) on `tier` holds, each counted once however many leases cover it."""
        seen: set[Node] = set()
        count = 0
        for record in self._records.values():
            if tier not in record.tiers or (not pins and record.expires_at == math.inf):
                continue
            node = record.end
            while node.parent is not None and node not in seen:
                seen.add(node)
                count += sum(1 for slot in node.slots[tier] if slot is not None)
                node = node.parent
        return count

    def _lock(self, end: Node, tiers: tuple[int, ...], delta: int) -> None:
        num_tiers = len(self._index.tiers)
        node = end
        while node.parent is not None:
            if node.locks is None:
                node.locks = [0] * num_tiers
            for tier in tiers:
                node.locks[tier] += delta
                assert node.locks[tier] >= 0, "lock count below zero"
            self._index._refresh(node)
            node = node.parent
