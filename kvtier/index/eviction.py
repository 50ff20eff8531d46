"""Choosing eviction victims: least-recently-used leaves of one tier, never locked, fair
between namespaces (tenants).

A tier-t candidate is a node whose run of blocks with fastest copy in t ends in a leaf of tier
t: the last block of that run has no block after it, in the node or in a child, whose fastest
copy is in t or a faster tier. Removing that block's t copy (after copying it down, or
dropping it when t is the lowest tier) keeps prefix closure. The index keeps the candidates of
each tier in a set (`CandidateSets`), refreshed whenever a node's residency, children or locks
change, so a call here costs O(candidates) to heapify and O(log candidates) per victim, never a
tree scan.

    root - A[g g g] - B[g g h]        g: fastest copy on gpu, h: on host
             \\
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
from typing import TYPE_CHECKING

from kvtier.index.node import Node
from kvtier.index.results import BlockRef

if TYPE_CHECKING:
    from kvtier.index.residency import Residency


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
