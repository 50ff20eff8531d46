"""Eviction in the index: the copies counted per tier, the floors, and choosing victims.

Copies counted per tier, in all and per namespace, and the fair-share floors they are held to.

`Residency` is the index's tally of where blocks live, kept incrementally, O(1) per change:
every edit of the index that sets or clears a slot field calls `add(namespace, tier, ±n)`, so

    resident(t)           == number of set `slots[t]` fields in the whole index
    resident_in(ns, t)    == the same, counted below the root of namespace `ns` only

(`check.py` recounts both). A namespace appears in the per-namespace table from its first copy
until the index removes its last node (`forget`), when every count must be back at zero.

Floors are the fair shares of DESIGN invariant 9 (`RadixIndex.set_floors`): a namespace holding
no more than its floor in a tier is protected there. `eviction.victims` ranks candidates by
them; `evictable_share` bounds, with the same rule, what one call may take.

Choosing eviction victims: least-recently-used leaves of one tier, never locked, fair
between namespaces (tenants).

A tier-t candidate is a node whose run of blocks with fastest copy in t ends in a leaf of tier
t: the last block of that run has no block after it, in the node or in a child, whose fastest
copy is in t or a faster tier. Removing that block's t copy (after copying it down, or
dropping it when t is the lowest tier) keeps prefix closure. The index keeps the candidates of
each tier in a set (`CandidateSets`), refreshed whenever a node's residency, children or locks
change, so a call here costs O(candidates) to heapify and O(log candidates) per victim, never a
tree scan.

    root - A[g g g] - B[g g h]        g: fastest copy on gpu, h: on host
             \
              C[g h h]
    gpu candidates:  B (block 1), C (block 0)      A is not: B and C hang below it on gpu
    host candidates: B (block 2), C (block 2)

Recency is per node: a lookup stamps every node it walks with one tick, so the ancestors of a
used node are at least as recent as it, and a shared trunk outlives the branches below it.

Fair shares (DESIGN invariant 9): with floors set (`RadixIndex.set_floors`), each candidate
has a rank, read from its namespace's copies in the tier (`Residency.resident_in`, O(1)):

    rank 0   its namespace holds more than its floor here         first, LRU among them
    rank 1   it is `owner`'s own (the namespace the room is for)  then, LRU among them
    none     another namespace at or under its floor              never offered

so a tenant's call never takes another tenant below its floor, and the store's own work
(`owner` None: watermark demotion) takes only what is above floors. During one pass a tier's
copies only leave, so a rank only falls (0 to 1, or to none): a popped entry whose rank fell is
pushed back once with its new rank, or dropped, which keeps O(log candidates) per victim.
Without floors every rank is 0: plain LRU.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from kvtier.index.node import BlockRef, Node


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


class CandidateSets:
    """Per tier, the nodes that offer a candidate (module doc), in insertion order.

    Kept by the index: whoever changes a node's `depth`, size, `child_res` or `locks` calls
    `refresh(node)` (O(tiers)), and a node leaving the tree is `discard`ed, so that
    `of(tier)` is exactly the set the module doc defines (`check.py` recomputes it)."""

    def __init__(self, num_tiers: int) -> None:
        self._sets: list[dict[Node, None]] = [{} for _ in range(num_tiers)]

    def of(self, tier: int) -> dict[Node, None]:
        """The candidates of `tier`; the live set, not a copy."""
        return self._sets[tier]

    def refresh(self, node: Node) -> None:
        """Re-decide, per tier, whether `node` offers a candidate. A root never does."""
        if node.parent is None:
            return
        size = node.size
        lo = 0
        for tier, hi in enumerate(node.depth):
            candidates = self._sets[tier]
            if (
                hi > lo
                and (hi < size or node.child_res[tier] == 0)
                and not (node.locks is not None and node.locks[tier])
            ):
                candidates[node] = None
            else:
                candidates.pop(node, None)
            lo = hi

    def discard(self, node: Node) -> None:
        """`node` left the tree: it offers no candidate any more."""
        for candidates in self._sets:
            candidates.pop(node, None)


def victims(
    candidates: dict[Node, None], residency: Residency, tier: int, owner: bytes | None = None
) -> Iterator[BlockRef]:
    """Yield tier-`tier` victims, by rank (module doc), least recently used first within a
    rank, one block at a time.

    After each yield the caller either removes the block's `tier` copy (`clear_slot` or
    `drop`) or leaves it; a node whose victim was left is not offered again in this pass.
    The caller stops iterating when it has freed enough. Blocks that become victims during the
    pass (a parent whose last child left the tier) join the same pass.
    """
    rank = _ranking(residency, tier, owner)
    heap = []
    for seq, node in enumerate(candidates):
        first = rank(node)
        if first is not None:
            heap.append((first, node.tick, seq, node))
    heapq.heapify(heap)
    seq = len(candidates)
    queued = {entry[3] for entry in heap}
    skipped: set[Node] = set()
    while heap:
        was, tick, _, node = heapq.heappop(heap)
        queued.discard(node)
        if node not in candidates or node in skipped:
            continue
        now = rank(node)
        if now is None:
            continue
        if node.tick != tick or now != was:  # used again, or its namespace fell to its floor
            heapq.heappush(heap, (now, node.tick, seq, node))
            seq += 1
            queued.add(node)
            continue
        before = (node.size, node.depth[tier])
        parent = node.parent
        yield BlockRef(node, node.depth[tier] - 1)
        if node.parent is not None and (node.size, node.depth[tier]) == before:
            skipped.add(node)
            continue
        for nxt in (node, parent):
            if nxt is not None and nxt in candidates and nxt not in queued and nxt not in skipped:
                nxt_rank = rank(nxt)
                if nxt_rank is not None:
                    heapq.heappush(heap, (nxt_rank, nxt.tick, seq, nxt))
                    seq += 1
                    queued.add(nxt)


def _ranking(residency: Residency, tier: int, owner: bytes | None) -> Callable[[Node], int | None]:
    """The rank of a candidate (module doc): 0, 1, or None for not to be offered."""
    floors = residency.floors
    if not floors:
        return _first
    resident_in = residency.resident_in

    def rank(node: Node) -> int | None:
        namespace = node.root.ids
        floor = floors.get(namespace)
        if floor is None or resident_in(namespace, tier) > floor[tier]:
            return 0
        return 1 if namespace == owner else None

    return rank


def _first(node: Node) -> int:
    return 0
