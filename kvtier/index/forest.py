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
(Leases, which lock its paths, are `leases.py`'s.)
"""

from __future__ import annotations

from typing import cast

from kvtier.blocks import BlockHasher, BlockId
from kvtier.index.eviction import CandidateSets
from kvtier.index.node import (
    EVENT_RANGE,
    InsertResult,
    Match,
    Node,
    Slot,
    cut_steps,
    slowest_counts,
    split_steps,
    tail_steps,
)
from kvtier.index.residency import Residency


class Forest:
    def __init__(
        self,
        num_tiers: int,
        key_nbytes: int,
        hasher: BlockHasher,
        candidates: CandidateSets,
        residency: Residency,
        node_blocks: int = EVENT_RANGE,
    ) -> None:
        self.num_tiers = num_tiers
        self.node_blocks = node_blocks  # the most blocks a node holds (node.py: `EVENT_RANGE`)
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
        if (
            parent.parent is not None
            and parent.children is None
            and not any(parent.locks or ())
            and parent.ev % self.node_blocks + parent.size + count <= self.node_blocks
        ):
            # extend a leaf instead of hanging a one-child chain under it; never a locked leaf:
            # its leases end at its last block and must not grow to cover the new ones
            node = parent
            if node.hits:  # the new blocks were never walked: the old ones keep their count
                node.steps = [*(node.steps or ()), (node.size, node.hits)]
                node.hits = 0
            node.key += new_key  # its ids stay a prefix of its blocks' (`ids_of`)
            for tier, run in enumerate(fields):
                node.slots[tier].extend(run)
            node.depth = [d + a for d, a in zip(node.depth, added, strict=True)]
            node.tick = tick
        else:
            at = 0
            while at < count:  # a chain of nodes of at most `node_blocks` blocks each
                n = min(count - at, self.node_blocks)
                if n == count:
                    node = Node(parent, new_key, b"", fields, added, tick)
                else:
                    part = [f[at : at + n] for f in fields]
                    node = Node(
                        parent,
                        new_key[at * kb : (at + n) * kb],
                        b"",
                        part,
                        [n if a else 0 for a in added],
                        tick,
                    )
                if parent.parent is None:
                    self.roots.setdefault(parent.ids, parent)
                if parent.children is None:
                    parent.children = {}
                parent.children[node.key[:kb]] = node
                self.num_nodes += 1
                for tier, depth in enumerate(node.depth):
                    if depth:
                        parent.child_res[tier] += 1
                self.candidates.refresh(parent)
                parent, at = node, at + n
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
        if node.steps:  # blocks of an extended leaf counted apart (node.py)
            head.hits, head.steps = split_steps(node, at)
            node.steps = tail_steps(node, at)
        head.ev = node.ev
        node.parent.children[head.key[:kb]] = head  # type: ignore[index]
        head.children = {node.key[at * kb : (at + 1) * kb]: node}
        head.locks = list(node.locks) if node.locks is not None else None
        head.held = node.held
        node.parent = head
        node.key = node.key[at * kb :]
        node.ids = node.ids[at * ds :]
        node.ev = node.ev + at if node.ev else 0
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
        if node.steps:
            cut_steps(node, keep)
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
        if node.steps:
            cut_steps(node, len(node.slots[0]))
        node.ids = node.ids[: len(node.key) // self.key_nbytes * self.digest_size]
        depth = node.depth
        for tier in range(fastest, num_tiers):  # closure: the block was in these tiers' runs
            depth[tier] -= 1
        self.candidates.refresh(node)
        return freed
