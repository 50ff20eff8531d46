"""One tier's eviction candidates in recency order, kept across passes and repaired lazily.

The index stamps recency on its hot paths (a lookup sets `node.tick` on every node it walks)
and must not pay for ordering there, so the order is kept lazily: per namespace, a heap of
entries `(tick, stamp, node)`, least recent first, where `stamp` is the node's entry stamp in
the candidate set (`CandidateSets`: a later entry, a larger stamp; equal ticks go by it). An
entry may be out of date; `take` repairs what it meets at the top:

    node no longer a candidate           -> dropped
    node used since (tick moved on), or
    left and came back (stamp moved on)  -> pushed back with its tick and stamp now
    node already taken in this pass      -> dropped (a duplicate)

Invariant between calls: every candidate of the tier has an entry in the heaps or in
`pending` (nodes that became candidates since the last pass), or was lent to the last pass.
`begin` (the start of a pass) returns what the last pass took to `pending` and moves
`pending` into the heaps. So a pass costs O(log n) per entry it takes, each stale entry is
repaired once per change that made it stale, and nothing is ever O(candidates) except
`rebuild`, which runs at the start of a pass when dead entries outnumber the candidates, and
the sweep of `pending`'s dead entries when it outgrows them (both amortised over the changes
that made the dead entries). Nothing reorders the heaps during a pass.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from kvtier.index.node import Node

Entry = tuple[int, int, Node]  # (tick, stamp, node)

SLACK = 1024  # dead entries tolerated beyond twice the candidates before a rebuild


class RecencyQueue:
    def __init__(self, members: dict[Node, int]) -> None:
        self._members = members  # the tier's candidate set: node -> stamp
        self._heaps: dict[bytes, list[Entry]] = {}  # namespace -> entries, least recent first
        self._pending: list[Entry] = []
        self._lent: set[Node] = set()  # nodes taken out by the current (or last) pass
        self.passes = 0

    def add(self, node: Node, stamp: int) -> None:
        """`node` became a candidate with `stamp`. O(1), amortised."""
        self._pending.append((node.tick, stamp, node))
        if len(self._pending) > 2 * len(self._members) + SLACK:
            members = self._members  # keep the live entries: at most one per candidate
            self._pending = [e for e in self._pending if members.get(e[2]) == e[1]]

    def begin(self) -> int:
        """Start a pass: what the last one took and `pending` join the heaps. Returns the
        pass's number; a pass ends when the next begins."""
        members = self._members
        pending = self._pending
        for node in self._lent:
            stamp = members.get(node)
            if stamp is not None:
                pending.append((node.tick, stamp, node))
        self._lent = set()
        if sum(map(len, self._heaps.values())) + len(pending) > 2 * len(members) + SLACK:
            self.rebuild()
        else:
            by_namespace: dict[bytes, list[Entry]] = defaultdict(list)
            for entry in pending:
                by_namespace[entry[2].root.ids].append(entry)
            self._pending = []
            for namespace, entries in by_namespace.items():
                heap = self._heaps.setdefault(namespace, [])
                if len(entries) * 8 > len(heap):
                    heap.extend(entries)
                    heapq.heapify(heap)
                else:
                    for entry in entries:
                        heapq.heappush(heap, entry)
        self.passes += 1
        return self.passes

    def rebuild(self) -> None:
        """Heaps made afresh from the candidate set, dead entries gone. O(candidates)."""
        heaps: dict[bytes, list[Entry]] = defaultdict(list)
        for node, stamp in self._members.items():
            heaps[node.root.ids].append((node.tick, stamp, node))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = dict(heaps)
        self._pending = []
        self._lent = set()

    def namespaces(self) -> list[bytes]:
        """The namespaces whose heaps may hold candidates."""
        return list(self._heaps)

    def take(self, namespace: bytes) -> Entry | None:
        """Remove and return the least recent candidate of `namespace` (its entry up to date),
        lent to the current pass; None when it has none left."""
        heap = self._heaps.get(namespace)
        if heap is None:
            return None
        members, lent = self._members, self._lent
        while heap:
            tick, stamp, node = heap[0]
            now = members.get(node)
            if now is None or node in lent:
                heapq.heappop(heap)
            elif tick != node.tick or stamp != now:
                heapq.heapreplace(heap, (node.tick, now, node))
            else:
                heapq.heappop(heap)
                lent.add(node)
                return tick, stamp, node
        del self._heaps[namespace]
        return None

    def lent(self, node: Node) -> bool:
        """Whether the current pass took `node` out of the queue."""
        return node in self._lent

    def unqueued(self) -> int:
        """Candidates with no entry anywhere (the invariant says none). O(entries)."""
        held = set(self._lent)
        held.update(entry[2] for entry in self._pending)
        for heap in self._heaps.values():
            held.update(entry[2] for entry in heap)
        return sum(1 for node in self._members if node not in held)
