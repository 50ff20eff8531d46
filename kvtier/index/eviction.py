"""Choosing eviction victims: least-recently-used leaves of one tier, never locked.

A tier-t candidate is a node whose run of blocks with fastest copy in t ends in a leaf of tier
t: the last block of that run has no block after it, in the node or in a child, whose fastest
copy is in t or a faster tier. Removing that block's t copy (after copying it down, or
dropping it when t is the lowest tier) keeps prefix closure. The index keeps the candidates of
each tier in a set, refreshed whenever a node's residency, children or locks change, so a call
here costs O(candidates) to heapify and O(log candidates) per victim, never a tree scan.

    root - A[g g g] - B[g g h]        g: fastest copy on gpu, h: on host
             \\
              C[g h h]
    gpu candidates:  B (block 1), C (block 0)      A is not: B and C hang below it on gpu
    host candidates: B (block 2), C (block 2)

Recency is per node: a lookup stamps every node it walks with one tick, so the ancestors of a
used node are at least as recent as it, and a shared trunk outlives the branches below it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvtier.index.node import Node
from kvtier.index.results import BlockRef

if TYPE_CHECKING:
    from kvtier.index.radix import RadixIndex


def victims(index: RadixIndex, tier: int, candidates: dict[Node, None]) -> Iterator[BlockRef]:
    """Yield tier-`tier` victims, least recently used first, one block at a time.

    After each yield the caller either removes the block's `tier` copy (`clear_slot` or
    `drop`) or leaves it; a node whose victim was left is not offered again in this pass.
    The caller stops iterating when it has freed enough. Blocks that become victims during the
    pass (a parent whose last child left the tier) join the same pass.
    """
    heap = [(node.tick, seq, node) for seq, node in enumerate(candidates)]
    heapq.heapify(heap)
    seq = len(heap)
    queued = set(candidates)
    skipped: set[Node] = set()
    while heap:
        tick, _, node = heapq.heappop(heap)
        queued.discard(node)
        if node not in candidates or node in skipped:
            continue
        if node.tick != tick:  # used again since it was queued: take its place in line again
            heapq.heappush(heap, (node.tick, seq, node))
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
                heapq.heappush(heap, (nxt.tick, seq, nxt))
                seq += 1
                queued.add(nxt)
