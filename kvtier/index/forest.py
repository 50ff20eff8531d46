"""The shape of the index: one tree per namespace, its edits, and the leases that lock it.

`Forest` owns the namespace roots (`roots`: seed -> root, for every namespace that holds a
block) and the counts of nodes and blocks, and makes the edits that add or remove nodes:

- `grow` adds blocks after a match: it extends a leaf, or hangs a new child;
- `split` cuts a node in two where a matched prefix ends inside it;
- `cut` removes the last k blocks of a leaf in one edit (`RadixIndex.drop_tail`, `drop`);
- `detach` unhooks a leaf that `cut` emptied, and the namespace root when it was the last;
- `ids_of` completes a node's block ids, which `grow` leaves to be computed on first use.
(`restore.adopt` takes in nodes that recovery hung already.)

Invariants each edit keeps (`check.py` recomputes them): a node hangs from its parent under the
key of its first block; `parent.child_res[t]` counts the children with a block in tier <= t; a
node's `depth` (`node.py`) matches its slot fields; `roots` holds exactly the namespaces with a
child; `num_nodes`/`num_blocks` count the nodes and blocks below the roots; copies are counted
in `Residency` and candidacy refreshed in `CandidateSets` for every node whose shape changed.

It walks nothing and sets no slot of an existing block: walks and residency are `RadixIndex`'s.

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
as locks come and go (the tenant's quota, `tenancy.py`). The store's own pins (room-making,
the mover's flights) are not held.

Lease ids are random 63-bit numbers, unique among live leases (`blocks.py`): an id tells a
client nothing of others' leases; one held across a restart names no lease but by 2**-63 odds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import cast

from kvtier.blocks import BlockHasher, BlockId, fresh_id
from kvtier.errors import LeaseError
from kvtier.index.eviction import CandidateSets
from kvtier.index.node import InsertResult, LeaseId, Match, Node, Residency, Slot, slowest_counts


class Forest:
    def __init__(
        self,
        num_tiers: int,
        key_nbytes: int,
        hasher: BlockHasher,
        candidates: CandidateSets,
        residency: Residency,
    ) -> None:
        self.num_tiers = num_tiers
        self.key_nbytes = key_nbytes
        self.digest_size = hasher.digest_size
        self.hasher = hasher
        self.candidates = candidates
        self.residency = residency
        self.roots: dict[bytes, Node] = {}
        self.num_nodes = 0  # nodes holding blocks (namespace roots not counted)
        self.num_blocks = 0

    def root(self, namespace: BlockId) -> Node:
        """The root of a namespace. A namespace with no block has a fresh root that the forest
        registers only when a block is hung under it, so misses leave nothing behind."""
        root = self.roots.get(namespace)
        if root is None:
            empty: list[list[Slot]] = [[] for _ in range(self.num_tiers)]
            root = Node(None, b"", bytes(namespace), empty, [0] * self.num_tiers, 0)
        return root

    def grow(
        self, match: Match, key: bytes, slots: dict[int, list[int]], tick: int
    ) -> InsertResult:
        """`RadixIndex.insert` (its contract), the nodes touched stamped with `tick`."""
        kb = self.key_nbytes
        start = match.num_blocks * kb
        new_key = key[start : len(key) - len(key) % kb]
        count = len(new_key) // kb
        parent = match.end
        if count == 0:
            return InsertResult(0, parent)
        assert slots and all(len(s) == count for s in slots.values()), "one slot per new block"
        assert min(slots) >= parent.fastest_last(), "new blocks would break prefix closure"
        num_tiers = self.num_tiers
        fields: list[list[Slot]] = [
            list(slots[t]) if t in slots else [None] * count for t in range(num_tiers)
        ]
        fastest = min(slots)  # every new block has copies in exactly the tiers of `slots`
        added = [count if t >= fastest else 0 for t in range(num_tiers)]
        if parent.parent is not None and parent.children is None and not any(parent.locks or ()):
            # extend a leaf instead of hanging a one-child chain under it; never a locked leaf:
            # its leases end at its last block and must not grow to cover the new ones
            node = parent
            node.key += new_key  # its ids stay a prefix of its blocks' (`ids_of`)
            for tier, run in enumerate(fields):
                node.slots[tier].extend(run)
            node.depth = [d + a for d, a in zip(node.depth, added, strict=True)]
            node.tick = tick
        else:
            node = Node(parent, new_key, b"", fields, added, tick)
            if parent.parent is None:
                self.roots.setdefault(parent.ids, parent)
            if parent.children is None:
                parent.children = {}
            parent.children[new_key[:kb]] = node
            self.num_nodes += 1
            for tier, depth in enumerate(node.depth):
                if depth:
                    parent.child_res[tier] += 1
            self.candidates.refresh(parent)
        namespace = node.root.ids
        for tier in slots:
            self.residency.add(namespace, tier, count)
        self.residency.slowest_moved(-1, max(slots), count)
        self.num_blocks += count
        self.candidates.refresh(node)
        return InsertResult(count, node)

    def ids_of(self, node: Node) -> bytes:
        """All of `node`'s block ids, concatenated (the namespace seed for a root). A node holds
        the ids of a prefix of its blocks (`node.py`); the rest, and those of ancestors that
        lack theirs, are chained here from the nearest complete ancestor and kept."""
        kb, ds = self.key_nbytes, self.digest_size
        todo: list[Node] = []
        above = node
        while above.parent is not None and len(above.ids) < len(above.key) // kb * ds:
            todo.append(above)
            above = above.parent
        for below in reversed(todo):  # `above` is a root or holds all its ids
            have = len(below.ids) // ds
            prev = below.ids[-ds:] if have else above.ids[-ds:]
            below.ids += self.hasher.chain(prev, below.key[have * kb :], kb)
            above = below
        return node.ids

    def split(self, node: Node, at: int) -> Node:
        """Cut `node` after block `at`; return the new head (the first `at` blocks). The old
        node keeps the tail, so leases ending at it stay correct; the head inherits its locks.

            parent - node[b0 b1 b2 b3 b4]
                        split(node, 2)
            parent - head[b0 b1] - node[b2 b3 b4]
        """
        assert 0 < at < node.size and node.parent is not None
        kb, ds = self.key_nbytes, self.digest_size
        head = Node(
            node.parent,
            node.key[: at * kb],
            node.ids[: at * ds],
            [fields[:at] for fields in node.slots],
            [min(d, at) for d in node.depth],  # closure: the first depth[t] blocks are <= t
            node.tick,
        )
        head.hits = node.hits
        node.parent.children[head.key[:kb]] = head  # type: ignore[index]
        head.children = {node.key[at * kb : (at + 1) * kb]: node}
        head.locks = list(node.locks) if node.locks is not None else None
        head.held = node.held
        node.parent = head
        node.key = node.key[at * kb :]
        node.ids = node.ids[at * ds :]
        node.slots = [fields[at:] for fields in node.slots]
        node.depth = [d - h for d, h in zip(node.depth, head.depth, strict=True)]
        head.child_res = [1 if d else 0 for d in node.depth]
        self.num_nodes += 1
        self.candidates.refresh(head)
        self.candidates.refresh(node)
        return head

    def detach(self, node: Node, parent: Node) -> None:
        """Unhook `node` from `parent`: a leaf whose last blocks `cut` has just removed and
        uncounted. Forget the namespace when that was its last node."""
        assert parent.children is not None
        del parent.children[node.key[: self.key_nbytes]]
        if not parent.children:
            parent.children = None
        for tier, depth in enumerate(node.depth):
            if depth:
                parent.child_res[tier] -= 1
        self.candidates.discard(node)
        self.num_nodes -= 1
        node.parent = None
        if parent.parent is None and parent.children is None:
            del self.roots[parent.ids]
            self.residency.forget(parent.ids)
        else:
            self.candidates.refresh(parent)

    def cut(self, node: Node, count: int) -> list[list[int]]:
        """Remove the last `count` blocks of `node`, a leaf (`RadixIndex.drop_tail`), uncounted
        and the node detached when that is all of it; return the freed slots per tier, last
        block first (as dropping them one by one would: freed in that order, a pool hands them
        out again in their first order, so runs of slots stay runs for slice copies)."""
        keep = node.size - count
        if count == 1 and keep:  # one block off a node that stays: the per-block hot path
            return self._cut_last(node)
        freed: list[list[Slot]] = []  # no None in them: a list with one is filtered
        namespace, residency = node.root.ids, self.residency
        for tier, fields in enumerate(node.slots):
            slots = fields[: keep - 1 if keep else None : -1]  # the tail, last block first
            if None in slots:
                slots = [s for s in slots if s is not None]
            if slots:
                residency.add(namespace, tier, -len(slots))
            freed.append(slots)
        residency.slowest_counted(slowest_counts(node.slots, keep, keep + count), -1)
        self.num_blocks -= count
        if keep == 0:
            assert node.parent is not None
            self.detach(node, node.parent)
            return cast("list[list[int]]", freed)
        for fields in node.slots:
            del fields[keep:]
        node.key = node.key[: keep * self.key_nbytes]
        node.ids = node.ids[: keep * self.digest_size]
        node.depth = [min(d, keep) for d in node.depth]  # closure: the first depth[t] are <= t
        self.candidates.refresh(node)
        return cast("list[list[int]]", freed)

    def _cut_last(self, node: Node) -> list[list[int]]:
        """`cut(node, 1)` of a node that keeps blocks, without the slices of the general case."""
        namespace, residency = node.root.ids, self.residency
        freed: list[list[int]] = []
        num_tiers = len(node.slots)
        fastest = slowest = num_tiers
        for tier, fields in enumerate(node.slots):
            slot = fields.pop()
            if slot is None:
                freed.append([])
                continue
            freed.append([slot])
            residency.add(namespace, tier, -1)
            fastest = min(fastest, tier)
            slowest = tier
        residency.slowest_moved(slowest if slowest < num_tiers else -1, -1)
        self.num_blocks -= 1
        node.key = node.key[: -self.key_nbytes]
        node.ids = node.ids[: len(node.key) // self.key_nbytes * self.digest_size]
        depth = node.depth
        for tier in range(fastest, num_tiers):  # closure: the block was in these tiers' runs
            depth[tier] -= 1
        self.candidates.refresh(node)
        return freed


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
            heapq.heappush(self._expiry, (expires_at, record.lease_id))
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
