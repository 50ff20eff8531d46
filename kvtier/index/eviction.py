"""Eviction in the index: choosing victims, fair between namespaces, in recency order.

Choosing eviction victims: least-recently-used leaves of one tier, never locked, fair
between namespaces (tenants).

A tier-t candidate is a node whose run of blocks with fastest copy in t ends in a leaf of tier
t: the last block of that run has no block after it, in the node or in a child, whose fastest
copy is in t or a faster tier. Removing that block's t copy (after copying it down, or
dropping it when t is the lowest tier) keeps prefix closure. The index keeps the candidates of
each tier in a set (`CandidateSets`), refreshed whenever a node's residency, children or locks
change, and in a recency queue (`RecencyQueue`, below) that keeps them in LRU order across
calls, so a pass costs O(log candidates) per victim it offers, never O(candidates) and never a
tree scan.

    root - A[g g g] - B[g g h]        g: fastest copy on gpu, h: on host
                           C[g h h]
    gpu candidates:  B (block 1), C (block 0)      A is not: B and C hang below it on gpu
    host candidates: B (block 2), C (block 2)

Recency is per node: a lookup stamps every node it walks with one tick (a node matched in part
is split first, so a stamp covers exactly the blocks used), so the ancestors of a used node are
at least as recent as it, and a shared trunk outlives the branches below it.
The tier's candidates form an antichain (none hangs below another), and one tick stamps one
path, so two candidates of a tier share a tick only when neither was used since recovery
(`restore.py` stamps 0); those go in the order they became candidates, as `victims` always did.

A pass offers a candidate's blocks as runs (`victim_runs`): `VictimRun(node, lo, hi)` says that
the next victims are blocks hi-1, ..., lo of one node, exactly the blocks that one-at-a-time
`victims` would offer in a row if the caller took each (the run stops where the node's rank
would fall, where another candidate ties with it, or where its blocks' hit counts differ:
`node.hits_run`), so a caller frees k blocks of one node in one edit (`drop_tail`), one copy.

Fair shares (DESIGN invariant 9): with floors set (`RadixIndex.set_floors`), each candidate
has a rank, read from its namespace's copies in the tier (`Residency.resident_in`, O(1)):

    rank 0   its namespace holds more than its floor here         first, LRU among them
    rank 1   it is `owner`'s own (the namespace the room is for)  then, LRU among them
    none     another namespace at or under its floor              never offered

so a tenant's call never takes another tenant below its floor, and the store's own work
(`owner` None: watermark demotion) takes only what is above floors. A pass starts from the
namespaces over their floor (`Residency.over`, kept as copies come and go) and the owner: the
others rank none, and a pass costs nothing per tenant that has nothing to give. During one
pass a tier's copies only leave, so a rank only falls (0 to 1, or to none): a popped entry
whose rank fell is pushed back once with its new rank, or dropped, which keeps O(log
candidates) per victim.
Without floors every rank is 0: plain LRU.

The recency queue (`RecencyQueue`): one tier's eviction candidates in recency order, kept
across passes and repaired lazily.

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
from collections.abc import Callable, Iterator
from typing import cast

from kvtier.errors import InvariantError
from kvtier.index.node import BlockRef, Node, VictimRun, hits_run
from kvtier.index.residency import Residency


class CandidateSets:
    """Per tier, the nodes that offer a candidate (module doc), each with the stamp of its entry
    (a counter over all tiers: a later entry has a larger stamp), and the tier's recency queue.

    Kept by the index: whoever changes a node's `depth`, size, `child_res` or `locks` calls
    `refresh(node)` (O(tiers)), and a node leaving the tree is `discard`ed, so that
    `of(tier)` is exactly the set the module doc defines (`check.py` recomputes it)."""

    def __init__(self, num_tiers: int) -> None:
        self._sets: list[dict[Node, int]] = [{} for _ in range(num_tiers)]
        self._queues = [RecencyQueue(members) for members in self._sets]
        self.stamp = 0  # the last stamp given

    def of(self, tier: int) -> dict[Node, int]:
        """The candidates of `tier` and their stamps; the live set, not a copy."""
        return self._sets[tier]

    def queue(self, tier: int) -> RecencyQueue:
        return self._queues[tier]

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
                if node not in candidates:
                    self.stamp += 1
                    candidates[node] = self.stamp
                    self._queues[tier].add(node, self.stamp)
            else:
                candidates.pop(node, None)
            lo = hi

    def discard(self, node: Node) -> None:
        """`node` left the tree: it offers no candidate any more."""
        for candidates in self._sets:
            candidates.pop(node, None)


def victims(
    sets: CandidateSets, residency: Residency, tier: int, owner: bytes | None = None
) -> Iterator[BlockRef]:
    """Yield tier-`tier` victims, by rank (module doc), least recently used first within a
    rank, one block at a time.

    After each yield the caller either removes the block's `tier` copy (`clear_slot` or
    `drop`) or leaves it; a node whose victim was left is not offered again in this pass.
    The caller stops iterating when it has freed enough. Blocks that become victims during the
    pass (a parent whose last child left the tier) join the same pass; other nodes that become
    candidates during it wait for the next. A pass ends when the next pass of the tier begins:
    it must not be resumed after that.
    """
    return cast("Iterator[BlockRef]", _offers(sets, residency, tier, owner, runs=False))


def victim_runs(
    sets: CandidateSets, residency: Residency, tier: int, owner: bytes | None = None
) -> Iterator[VictimRun]:
    """The victims of `victims`, in the same order, as runs of blocks of one node (module
    doc). After each run the caller removes the `tier` copies of a suffix of it
    (the last k blocks, from the end, 0 <= k <= its length) and resumes, or stops iterating;
    if it took fewer than the run offered, the node is not offered again in this pass.

    Cost: O(log candidates) per run offered, plus the lazy upkeep of the queue (`RecencyQueue`).
    It reproduces the heap pass that `victims` ran before the queue existed, entry for entry:
    the pass heap holds, for each namespace that may give blocks, its least recent candidate
    not yet offered (taken from the queue as the previous one leaves the heap), plus the nodes
    pushed back during the pass, which go after every candidate of the same rank and tick.
    """
    return cast("Iterator[VictimRun]", _offers(sets, residency, tier, owner, runs=True))


def _offers(
    sets: CandidateSets, residency: Residency, tier: int, owner: bytes | None, runs: bool
) -> Iterator[VictimRun | BlockRef]:
    """The pass of `victim_runs` (`runs`) or `victims` (runs of one block, as `BlockRef`s:
    one generator, no wrapper, for the per-block callers)."""
    queue = sets.queue(tier)
    members = sets.of(tier)
    token = queue.begin()
    start = sets.stamp + 1  # stamps of the candidates the queue holds are below it
    rank = _ranking(residency, tier, owner)
    floors = bool(residency.floors)
    first: dict[bytes, int | None] = {}  # each namespace's rank when the pass began
    heap: list[tuple[int, int, int, Node]] = []  # (rank, tick, seq, node)
    queued: set[Node] = set()

    def feed(namespace: bytes) -> None:
        entry = queue.take(namespace)
        if entry is not None:
            level = first[namespace]
            assert level is not None
            heapq.heappush(heap, (level, entry[0], entry[1], entry[2]))
            queued.add(entry[2])

    def waiting(node: Node) -> bool:
        """Whether `node` has an entry in the pass: in the heap, or still in the queue."""
        if node in queued:
            return True
        return (
            first.get(node.root.ids) is not None and members[node] < start and not queue.lent(node)
        )

    # Every namespace whose rank is not None, once: all of them without floors; with floors,
    # those over their floor and the owner, not every namespace (whose sum ranked them all,
    # O(tenants) per pass). Entries order totally (stamps are unique), so which namespace is
    # fed first changes nothing.
    if floors:
        names: list[bytes] | set[bytes] = residency.over(tier)
        if owner is not None and owner not in names:
            names = [*names, owner]
    else:
        names = queue.namespaces()
    for namespace in names:
        if queue.holds(namespace):
            first[namespace] = level = rank(namespace)
            if level is not None:
                feed(namespace)
    seq = start
    skipped: set[Node] = set()
    held: tuple[int, int, int, Node] | None = None  # one pass-heap entry kept out of `heap`
    while heap or held is not None:
        if held is not None and (not heap or held < heap[0]):
            (was, tick, order, node), held = held, None
        else:
            was, tick, order, node = heapq.heappop(heap)
        queued.discard(node)
        if order < start:  # a queue entry left the heap: its namespace's next one joins
            feed(node.root.ids)
        if node not in members or node in skipped:
            continue
        now = rank(node.root.ids) if floors else 0
        if now is None:
            continue
        if node.tick != tick or now != was:  # used again, or its namespace fell to its floor
            heapq.heappush(heap, (now, node.tick, seq, node))
            seq += 1
            queued.add(node)
            continue
        hi = node.depth[tier]
        count = hi - (node.depth[tier - 1] if tier else 0) if runs else 1
        if count > 1:
            if floors:
                count = min(count, _above_floor(residency, node.root.ids, tier, was))
            count = min(count, hi - hits_run(node, hi)) if node.steps else count
            top = heap[0] if heap else None
            if held is not None and (top is None or held < top):
                top = held
            if top is not None and (top[0], top[1]) <= (was, tick):  # a tie, or one to re-key
                count = 1
        size, parent = node.size, node.parent
        yield VictimRun(node, hi - count, hi) if runs else BlockRef(node, hi - 1)
        assert queue.passes == token, "a victims pass resumed after another began"
        if node.parent is not None:
            taken = hi - node.depth[tier]
            if taken < count and (taken > 0 or node.size == size):  # it left a victim
                skipped.add(node)
                continue
        for nxt in (node, parent):
            if nxt is not None and nxt in members and nxt not in skipped and not waiting(nxt):
                level = rank(nxt.root.ids) if floors else 0
                if level is not None:
                    entry = (level, nxt.tick, seq, nxt)
                    seq += 1
                    queued.add(nxt)
                    if held is None:  # the common case, a node that gives its next block,
                        held = entry  # costs a compare instead of a push and a pop
                    else:
                        heapq.heappush(heap, entry)


def _above_floor(residency: Residency, namespace: bytes, tier: int, rank: int) -> int:
    """How many blocks a rank-0 namespace gives before it reaches its floor (it then ranks 1
    or none); unbounded for rank 1 or without a floor."""
    floor = residency.floors.get(namespace)
    if rank != 0 or floor is None:
        return 2**62
    return residency.resident_in(namespace, tier) - floor[tier]


def _ranking(residency: Residency, tier: int, owner: bytes | None) -> Callable[[bytes], int | None]:
    """The rank of a namespace's candidates (module doc): 0, 1, or None for not offered."""
    floors = residency.floors
    if not floors:
        return _first
    resident_in = residency.resident_in

    def rank(namespace: bytes) -> int | None:
        floor = floors.get(namespace)
        if floor is None or resident_in(namespace, tier) > floor[tier]:
            return 0
        return 1 if namespace == owner else None

    return rank


def _first(namespace: bytes) -> int:
    return 0


Entry = tuple[int, int, Node]  # (tick, stamp, node)

SLACK = 1024  # dead entries tolerated beyond twice the candidates before a rebuild


class RecencyQueue:
    def __init__(self, members: dict[Node, int]) -> None:
        self._members = members  # the tier's candidate set: node -> stamp
        self._heaps: dict[bytes, list[Entry]] = {}  # namespace -> entries, least recent first
        self._in_heaps = 0  # entries in all the heaps (a sum over them was O(namespaces))
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
        if self._in_heaps + len(pending) > 2 * len(members) + SLACK:
            self.rebuild()
        else:
            by_namespace: dict[bytes, list[Entry]] = defaultdict(list)
            for entry in pending:
                by_namespace[entry[2].root.ids].append(entry)
            self._in_heaps += len(pending)
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
        self._in_heaps = len(self._members)
        self._pending = []
        self._lent = set()

    def namespaces(self) -> list[bytes]:
        """The namespaces whose heaps may hold candidates."""
        return list(self._heaps)

    def holds(self, namespace: bytes) -> bool:
        """Whether `namespace` has a heap (that may hold candidates)."""
        return namespace in self._heaps

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
                self._in_heaps -= 1
            elif tick != node.tick or stamp != now:
                heapq.heapreplace(heap, (node.tick, now, node))
            else:
                heapq.heappop(heap)
                self._in_heaps -= 1
                lent.add(node)
                return tick, stamp, node
        del self._heaps[namespace]
        return None

    def lent(self, node: Node) -> bool:
        """Whether the current pass took `node` out of the queue."""
        return node in self._lent

    def unqueued(self) -> int:
        """Candidates with no entry anywhere (the invariant says none). O(entries). An entry
        count that is off is an `InvariantError`."""
        counted = sum(map(len, self._heaps.values()))
        if counted != self._in_heaps:
            raise InvariantError(f"{counted} entries in the recency heaps, {self._in_heaps} kept")
        held = set(self._lent)
        held.update(entry[2] for entry in self._pending)
        for heap in self._heaps.values():
            held.update(entry[2] for entry in heap)
        return sum(1 for node in self._members if node not in held)
