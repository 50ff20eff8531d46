"""The shape of the index: one tree per namespace, and the edits that add or cut nodes.

`Forest` owns the namespace roots (`roots`: seed -> root, for every namespace that holds a
block) and the counts of nodes and blocks, and makes the edits that add or remove nodes:

- `grow` adds blocks after a match: it extends a leaf, or hangs a new child;
- `split` cuts a node in two where a matched prefix ends inside it;
- `detach` unhooks a leaf whose last block `RadixIndex.drop` removed, and the namespace root
  when that was its last node;
- `adopt` takes in nodes that a builder outside hung already (`restore.py`).

One edit stays in `RadixIndex.drop`, on its per-block hot path: trimming the last block off a
leaf that keeps others, and uncounting it from `num_blocks`.

Invariants each edit keeps (`check.py` recomputes them): a node hangs from its parent under the
key of its first block; `parent.child_res[t]` counts the children with a block in tier <= t; a
node's `depth` (`node.py`) matches its slot fields; `roots` holds exactly the namespaces with a
child; `num_nodes`/`num_blocks` count the nodes and blocks below the roots; copies are counted
in `Residency` and candidacy refreshed in `CandidateSets` for every node whose shape changed.

The forest walks nothing and changes no slot of an existing block: lookups and residency edits
are `RadixIndex`'s.
"""

from __future__ import annotations

from kvtier.hashing import BlockHasher, BlockId
from kvtier.index.eviction import CandidateSets
from kvtier.index.node import Node, Slot
from kvtier.index.residency import Residency
from kvtier.index.results import InsertResult, Match


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
            return InsertResult(0, b"", parent)
        assert slots and all(len(s) == count for s in slots.values()), "one slot per new block"
        assert min(slots) >= parent.fastest_last(), "new blocks would break prefix closure"
        new_ids = self.hasher.chain(parent.ids[-self.digest_size :], new_key, kb)
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
            node.key += new_key
            node.ids += new_ids
            for tier, run in enumerate(fields):
                node.slots[tier].extend(run)
            node.depth = [d + a for d, a in zip(node.depth, added, strict=True)]
            node.tick = tick
        else:
            node = Node(parent, new_key, new_ids, fields, added, tick)
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
        self.num_blocks += count
        self.candidates.refresh(node)
        return InsertResult(count, new_ids, node)

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
        """Unhook `node` from `parent`: a leaf whose last block `RadixIndex.drop` has just
        removed and uncounted. Forget the namespace when that was its last node."""
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

    def adopt(self, root: Node, nodes: list[Node]) -> None:
        """Take in `nodes`, built and hung below `root` by a caller outside the index (each in
        its parent's `children`, its slots and `depth` set): register the namespace, count the
        nodes, blocks and copies, and set the parents' `child_res` and every candidacy."""
        if not nodes:
            return
        self.roots.setdefault(root.ids, root)
        for node in nodes:
            parent = node.parent
            assert parent is not None
            for tier, depth in enumerate(node.depth):
                if depth:
                    parent.child_res[tier] += 1
        namespace = root.ids
        for node in nodes:
            self.candidates.refresh(node)
            self.num_blocks += node.size
            for tier, fields in enumerate(node.slots):
                copies = sum(1 for slot in fields if slot is not None)
                if copies:
                    self.residency.add(namespace, tier, copies)
        self.num_nodes += len(nodes)
