"""Copies counted per tier, in all and per namespace, and the fair-share floors they are held to.

`Residency` is the index's tally of where blocks live, kept incrementally, O(1) per change:
every edit of the index that sets or clears a slot field calls `add(namespace, tier, ±n)`, so

    resident(t)           == number of set `slots[t]` fields in the whole index
    resident_in(ns, t)    == the same, counted below the root of namespace `ns` only

(`check.py` recounts both). A namespace appears in the per-namespace table from its first copy
until the index removes its last node (`forget`), when every count must be back at zero.

Floors are the fair shares of DESIGN invariant 9 (`RadixIndex.set_floors`): a namespace holding
no more than its floor in a tier is protected there. `eviction.victims` ranks candidates by
them; `evictable_share` bounds, with the same rule, what one call may take.
"""

from __future__ import annotations


class Residency:
    def __init__(self, num_tiers: int) -> None:
        self._num_tiers = num_tiers
        self._resident = [0] * num_tiers
        self._ns_resident: dict[bytes, list[int]] = {}  # namespace -> copies per tier
        self.floors: dict[bytes, tuple[int, ...]] = {}  # namespace -> floor per tier

    def add(self, namespace: bytes, tier: int, delta: int) -> None:
        """`delta` copies in `tier` of blocks of `namespace` (negative: copies gone)."""
        self._resident[tier] += delta
        counts = self._ns_resident.get(namespace)
        if counts is None:
            counts = self._ns_resident[namespace] = [0] * self._num_tiers
        counts[tier] += delta

    def forget(self, namespace: bytes) -> None:
        """`namespace` holds no block any more: drop its (zero) counts."""
        counts = self._ns_resident.pop(namespace, None)
        assert counts is None or not any(counts), f"an empty namespace holds {counts}"

    def resident(self, tier: int) -> int:
        """Number of blocks with a copy in `tier`."""
        return self._resident[tier]

    def resident_in(self, namespace: bytes, tier: int) -> int:
        """Number of blocks of `namespace` with a copy in `tier`."""
        counts = self._ns_resident.get(namespace)
        return counts[tier] if counts is not None else 0

    def namespaces_resident(self) -> dict[bytes, tuple[int, ...]]:
        """Copies per tier of every namespace that holds blocks."""
        return {namespace: tuple(counts) for namespace, counts in self._ns_resident.items()}

    def set_floors(self, floors: dict[bytes, tuple[int, ...]]) -> None:
        """Each namespace's floor per tier, in blocks (absent: 0). Empty: plain LRU."""
        self.floors = dict(floors)

    def evictable_share(self, tier: int, owner: bytes | None) -> int | None:
        """With floors set: the most copies of `tier` that `victims(tier, owner)` may offer
        (every namespace's copies above its floor, and all of `owner`'s); None without floors.
        O(namespaces). Locks are not subtracted: the caller bounds by them."""
        if not self.floors:
            return None
        total = 0
        for namespace, counts in self._ns_resident.items():
            floor = self.floors.get(namespace)
            above = counts[tier] - (floor[tier] if floor is not None else 0)
            total += counts[tier] if namespace == owner else max(0, above)
        return total
