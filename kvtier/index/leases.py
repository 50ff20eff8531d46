"""The leases that lock paths of the index (`forest.py` has its shape).

Leases: read locks on a cached prefix in some tiers, with an expiry. A lease covers every block
from a namespace root down to the end of one node (leases end on node boundaries: the index
splits a node where a leased prefix ends). Acquiring it adds one to `node.locks[t]` for each
leased tier t on every node of that path; a locked node offers no eviction candidate in that
tier, so leased copies are never evicted (DESIGN invariant 4). Leases expire at `expires_at` (a
caller-supplied clock reading), so a crashed client cannot pin memory forever; the store calls
`expire(now)`. The store's own short pins are leases that never expire, released before the
store call returns.

Held blocks: a lock taken for a tenant (its lease, or the pin of its reservation: `held=True`)
also counts in `node.held` along its path; `held_blocks(namespace)` is the number of blocks of
a namespace that such locks cover, each counted once however many cover it, kept up to date
as locks come and go (the tenant's quota, `shares.py`). The store's own pins (room-making,
the mover's flights) are not held.

Lease ids are random 63-bit numbers, unique among live leases (`blocks.py`): an id tells a
client nothing of others' leases; one held across a restart names no lease but by 2**-63 odds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

from kvtier.blocks import fresh_id
from kvtier.errors import LeaseError
from kvtier.index.eviction import CandidateSets
from kvtier.index.node import LeaseId, Node

K = TypeVar("K", bound=int)

STALE_SLACK = 64
"""Stale entries an expiry heap may carry beyond as many as it has live ones (`push_expiry`)."""


def push_expiry(
    heap: list[tuple[float, K]], expires_at: float, key: K, live: Container[K], num_live: int
) -> None:
    """Push `(expires_at, key)` onto a lazy expiry heap whose live keys are `live` (`num_live`
    of them). An entry ended before its time stays until it is popped; once such stale entries
    outnumber the live ones (and `STALE_SLACK`), the heap keeps only live keys' entries, so that
    its memory follows what is live, not the rate of calls times the ttl (a caller that leases
    and releases, or reserves and aborts, in a loop). Amortized O(log n) a push."""
    heapq.heappush(heap, (expires_at, key))
    if len(heap) > 2 * num_live + STALE_SLACK:
        heap[:] = [entry for entry in heap if entry[1] in live]
        heapq.heapify(heap)


@dataclass(frozen=True)
class LeaseRecord:
    lease_id: LeaseId
    end: Node
    tiers: tuple[int, ...]
    expires_at: float
    num_blocks: int
    resident: bool = True  # every block of the path has a copy in each of `tiers` (checked)
    held: bool = False  # taken for a tenant: counts in `held_blocks` (the module doc)


class LeaseTable:
    """The live leases of one index. A lock changes a node's candidacy, so the table refreshes
    the index's `candidates` for every node whose lock counts it changes."""

    def __init__(self, num_tiers: int, candidates: CandidateSets) -> None:
        self._num_tiers = num_tiers
        self._candidates = candidates
        self._records: dict[LeaseId, LeaseRecord] = {}
        self._expiry: list[tuple[float, LeaseId]] = []  # stale entries are skipped
        self._held: dict[bytes, int] = {}  # namespace -> blocks covered by held locks

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
        held: bool = False,
    ) -> LeaseRecord:
        """Lock the prefix ending at `end` in `tiers` until `expires_at` (math.inf: never).
        `resident`: the prefix has a copy in each of `tiers` and keeps it (`check()` verifies
        it); False for a pure lock (a pin, a prefetch whose copies are in flight), which only
        stops copies in those tiers from leaving. `held`: taken for a tenant (module doc)."""
        lease_id = LeaseId(fresh_id(self._records))
        record = LeaseRecord(lease_id, end, tiers, expires_at, num_blocks, resident, held)
        self._records[record.lease_id] = record
        if expires_at != math.inf:
            push_expiry(self._expiry, expires_at, lease_id, self._records, len(self._records))
        self._lock(end, tiers, +1, held)
        return record

    def release(self, lease_id: LeaseId) -> LeaseRecord:
        """Unlock a lease; LeaseError if it is unknown (never acquired, released or expired)."""
        record = self._records.pop(lease_id, None)
        if record is None:
            raise LeaseError(f"lease {lease_id}: unknown, released or expired")
        self._lock(record.end, record.tiers, -1, record.held)
        return record

    def narrow(self, lease_id: LeaseId, tiers: tuple[int, ...]) -> LeaseRecord:
        """Keep a lease (same id, prefix and expiry) but lock only `tiers` from now on, which
        now hold the whole prefix: a prefetch locks its path in every tier while copies run,
        then holds it resident on gpu."""
        record = self.get(lease_id)
        if record.tiers == tiers and record.resident:  # held so from the start
            return record
        self._lock(record.end, tiers, +1, False)  # held counts stay: the same lease holds
        self._lock(record.end, record.tiers, -1, False)
        narrowed = replace(record, tiers=tiers, resident=True)
        self._records[lease_id] = narrowed
        return narrowed

    def expire(self, now: float) -> list[LeaseRecord]:
        """Release every lease whose expiry is at or before `now`; return them."""
        expired = []
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, lease_id = heapq.heappop(self._expiry)
            record = self._records.get(lease_id)
            if record is not None and record.expires_at == expires_at:  # not an id reused
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

    def held_blocks(self, namespace: bytes) -> int:
        """Blocks of `namespace` that held locks (a tenant's leases and reservation pins)
        cover, each counted once. O(1)."""
        return self._held.get(namespace, 0)

    def unheld_blocks(self, end: Node) -> int:
        """Blocks on the path to `end` that no held lock covers yet: what a new held lock on
        `end` would add to `held_blocks`. Held locks cover whole paths from the root, so these
        are the blocks below the deepest held node: O(their nodes)."""
        count = 0
        node = end
        while node.parent is not None and node.held == 0:
            count += node.size
            node = node.parent
        return count

    def _lock(self, end: Node, tiers: tuple[int, ...], delta: int, held: bool) -> None:
        num_tiers = self._num_tiers
        refresh = self._candidates.refresh
        node = end
        covered = 0  # blocks that held locks start (or stop) covering
        while node.parent is not None:
            if node.locks is None:
                node.locks = [0] * num_tiers
            for tier in tiers:
                node.locks[tier] += delta
                assert node.locks[tier] >= 0, "lock count below zero"
            if held:
                node.held += delta
                assert node.held >= 0, "held count below zero"
                if node.held == (1 if delta > 0 else 0):
                    covered += node.size
            refresh(node)
            node = node.parent
        if covered:
            namespace = node.ids  # the walk ends at the namespace root
            total = self._held.get(namespace, 0) + covered * delta
            if total:
                self._held[namespace] = total
            else:
                del self._held[namespace]
