"""Eviction in the index: the copies counted per tier, the floors, and choosing victims.

Copies counted per tier, in all and per namespace, and the fair-share floors they are held to.

`Residency` is the index's tally of where blocks live, kept incrementally, O(1) per change:
every edit of the index that sets or clears a slot field calls `add(namespace, tier, ±n)`, so

    resident(t)           == number of set `slots[t]` fields in the whole index
    resident_in(ns, t)    == the same, counted below the root of namespace `ns` only

    only_in(t)            == number of blocks whose slowest copy is in `t`

(`check.py` recounts them). `only_in(t)` of a memory tier is its dirty data: the copies that
must be written down before their slots can be freed without losing the block (a block whose
slowest copy is in `t` has no copy below it). Every edit that adds or removes a block's slowest
copy moves it with `slowest_moved(old, new)` (-1: no copy). A namespace appears in the
per-namespace table from its first copy until the index removes its last node (`forget`), when
every count must be back at zero.

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
change, and in a recency queue (`recency.py`) that keeps them in LRU order across calls, so a
pass costs O(log candidates) per victim it offers, never O(candidates) and never a tree scan.

    root - A[g g g] - B[g g h]        g: fastest copy on gpu, h: on host
             \
              C[g h h]
    gpu candidates:  B (block 1), C (block 0)      A is not: B and C hang below it on gpu
    host candidates: B (block 2), C (block 2)

Recency is per node: a lookup stamps every node it walks with one tick, so the ancestors of a
used node are at least as recent as it, and a shared trunk outlives the branches below it.
The tier's candidates form an antichain (none hangs below another), and one tick stamps one
path, so two candidates of a tier share a tick only when neither was used since recovery
(`restore.py` stamps 0); those go in the order they became candidates, as `victims` always did.

A pass offers a candidate's blocks as runs (`victim_runs`): `VictimRun(node, lo, hi)` says that
the next victims are blocks hi-1, ..., lo of one node, exactly the blocks that one-at-a-time
`victims` would offer in a row if the caller took each (the run stops where the node's rank
would fall, or where another candidate ties with it), so a caller can free k blocks of one
node in one edit (`RadixIndex.drop_tail`) and one copy.

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

from kvtier.index.node import BlockRef, Node, VictimRun
from kvtier.index.recency import RecencyQueue


class Residency:
    def __init__(self, num_tiers: int) -> None:
        self._num_tiers = num_tiers
        self._resident = [0] * num_tiers
        self._ns_resident: dict[bytes, list[int]] = {}  # namespace -> copies per tier
        self._only = [0] * num_tiers  # blocks by the tier of their slowest copy
        self.floors: dict[bytes, tuple[int, ...]] = {}  # namespace -> floor per tier

    def add(self, namespace: bytes, tier: int, delta: int) -> None:
        """`delta` copies in `tier` of blocks of `namespace` (negative: copies gone)."""
        self._resident[tier] += delta
        counts = self._ns_resident.get(namespace)
        if counts is None:
            counts = self._ns_resident[namespace] = [0] * self._num_tiers
        counts[tier] += delta

    def slowest_moved(self, old: int, new: int, count: int = 1) -> None:
        """`count` blocks' slowest copy went from tier `old` to `new` (-1: no copy)."""
        if old >= 0:
            self._only[old] -= count
        if new >= 0:
            self._only[new] += count

    def only_in(self, tier: int) -> int:
        """Blocks whose slowest copy is in `tier`: its copies with nothing below them."""
        return self._only[tier]

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
    for run in victim_runs(sets, residency, tier, owner, longest=1):
        yield BlockRef(run.node, run.lo)


def victim_runs(
    sets: CandidateSets,
    residency: Residency,
    tier: int,
    owner: bytes | None = None,
    longest: int = 2**62,
) -> Iterator[VictimRun]:
    """The victims of `victims`, in the same order, as runs of at most `longest` blocks of one
    node (module doc). After each run the caller removes the `tier` copies of a suffix of it
    (the last k blocks, from the end, 0 <= k <= its length) and resumes, or stops iterating;
    if it took fewer than the run offered, the node is not offered again in this pass.

    Cost: O(log candidates) per run offered, plus the lazy upkeep of the queue (`recency.py`).
    It reproduces the heap pass that `victims` ran before the queue existed, entry for entry:
    the pass heap holds, for each namespace that may give blocks, its least recent candidate
    not yet offered (taken from the queue as the previous one leaves the heap), plus the nodes
    pushed back during the pass, which go after every candidate of the same rank and tick.
    """
    queue = sets.queue(tier)
    members = sets.of(tier)
    token = queue.begin()
    start = sets.stamp + 1  # stamps of the candidates the queue holds are below it
    rank = _ranking(residency, tier, owner)
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

    for namespace in queue.namespaces():
        first[namespace] = level = rank(namespace)
        if level is not None:
            feed(namespace)
    seq = start
    skipped: set[Node] = set()
    while heap:
        was, tick, order, node = heapq.heappop(heap)
        queued.discard(node)
        if order < start:  # a queue entry left the heap: its namespace's next one joins
            feed(node.root.ids)
        if node not in members or node in skipped:
            continue
        now = rank(node.root.ids)
        if now is None:
            continue
        if node.tick != tick or now != was:  # used again, or its namespace fell to its floor
            heapq.heappush(heap, (now, node.tick, seq, node))
            seq += 1
            queued.add(node)
            continue
        hi = node.depth[tier]
        count = min(longest, hi - (node.depth[tier - 1] if tier else 0))
        if count > 1:
            count = min(count, _above_floor(residency, node.root.ids, tier, was))
            if heap and (heap[0][0], heap[0][1]) <= (was, tick):  # a tie, or one to re-key
                count = 1
        size, parent = node.size, node.parent
        yield VictimRun(node, hi - count, hi)
        assert queue.passes == token, "a victims pass resumed after another began"
        if node.parent is not None:
            taken = hi - node.depth[tier]
            if taken < count and (taken > 0 or node.size == size):  # it left a victim
                skipped.add(node)
                continue
        for nxt in (node, parent):
            if nxt is not None and nxt in members and nxt not in skipped and not waiting(nxt):
                level = rank(nxt.root.ids)
                if level is not None:
                    heapq.heappush(heap, (level, nxt.tick, seq, nxt))
                    seq += 1
                    queued.add(nxt)


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
