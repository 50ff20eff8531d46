"""The radix index: which token prefixes are cached, as which blocks, in which tiers.

Token-keyed (canonical uint32 bytes, `tokens.py`), block-granular (a key is cut into blocks of
`block_tokens`; a partial last block is never indexed), path-compressed (`node.py`). One tree
per namespace (model geometry + tenant): tenants share no node, so no lookup can see another
tenant's blocks (DESIGN invariant 6).

What the index does, and what it leaves to its caller (the store):
- `lookup` walks a key to its longest cached prefix and splits it by the fastest tier of each
  block. It changes nothing but recency.
- `match` does the same walk but splits the last node so the prefix ends on a node boundary,
  which `lock` (leases and pins), `insert` and `path` need.
- `insert` adds the blocks of a key after a match, with ids chained from the last matched one.
- `set_slot`/`clear_slot`/`drop` record copies that the caller has made or freed. The caller
  makes a copy complete before `set_slot` (DESIGN invariant 1) and frees the pool slot that
  `clear_slot`/`drop` return. Each asserts that prefix closure (invariant 3) still holds.
- `victims(tier, owner)` (see `eviction.py`) proposes least-recently-used leaves of a tier,
  with fair shares: a namespace at or under its floor (`set_floors`) gives blocks last.
- `resident_in(namespace, tier)` counts a namespace's copies per tier, kept up to date by
  every change, O(1): what fair shares and a tenant's status read.
- Leases (`leases.py`) lock prefixes so their copies are never proposed as victims.

Pure Python, no I/O, no threads, no clocks: time arrives as arguments. Not thread-safe; the
store serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvtier.hashing import BlockHasher, BlockId
from kvtier.index.eviction import victims
from kvtier.index.leases import LeaseTable
from kvtier.index.node import Node, Slot
from kvtier.index.results import BlockRef, InsertResult, Match, PrefixHit
from kvtier.tokens import TOKEN_NBYTES


class RadixIndex:
    def __init__(
        self,
        tiers: Sequence[str],
        block_tokens: int,
        hasher: BlockHasher,
    ) -> None:
        assert len(tiers) >= 1 and block_tokens >= 1
        self.tiers = tuple(tiers)
        self.block_tokens = block_tokens
        self.hasher = hasher
        self.key_nbytes = block_tokens * TOKEN_NBYTES
        self.digest_size = hasher.digest_size
        self._roots: dict[bytes, Node] = {}
        self._candidates: list[dict[Node, None]] = [{} for _ in self.tiers]
        self._resident = [0] * len(self.tiers)
        self._ns_resident: dict[bytes, list[int]] = {}  # namespace -> copies per tier
        self.floors: dict[bytes, tuple[int, ...]] = {}  # namespace -> floor per tier
        self._num_blocks = 0
        self._num_nodes = 0
        self._tick = 0
        self.leases = LeaseTable(self)

    # ---- sizes --------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_nodes(self) -> int:
        """Nodes holding blocks (namespace roots not counted)."""
        return self._num_nodes

    @property
    def num_namespaces(self) -> int:
        return len(self._roots)

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

    def _count(self, node: Node, tier: int, delta: int) -> None:
        """`delta` copies in `tier` of blocks of `node`'s namespace."""
        self._resident[tier] += delta
        namespace = node.root.ids
        counts = self._ns_resident.get(namespace)
        if counts is None:
            counts = self._ns_resident[namespace] = [0] * len(self.tiers)
        counts[tier] += delta

    def roots(self) -> Iterator[Node]:
        return iter(self._roots.values())

    # ---- walking ------------------------------------------------------------------------

    def root(self, namespace: BlockId) -> Node:
        """The root of a namespace. A namespace with no block has a fresh root that the index
        registers only when a block is inserted under it, so misses leave nothing behind."""
        root = self._roots.get(namespace)
        if root is None:
            empty: list[list[Slot]] = [[] for _ in self.tiers]
            root = Node(None, b"", bytes(namespace), empty, [0] * len(self.tiers), 0)
        return root

    def lookup(self, namespace: BlockId, key: bytes) -> PrefixHit:
        """Longest cached prefix of `key`, split by tier. Marks the matched nodes as used."""
        root = self._roots.get(namespace)
        num_tiers = len(self.tiers)
        if root is None or root.children is None:
            return PrefixHit(0, (0,) * num_tiers)
        self._tick += 1
        tick = self._tick
        kb = self.key_nbytes
        end = len(key) - len(key) % kb
        counts = [0] * num_tiers
        pos = 0
        children: dict[bytes, Node] | None = root.children
        while children is not None and pos < end:
            node = children.get(key[pos : pos + kb])
            if node is None:
                break
            node.tick = tick
            node.hits += 1
            size = len(node.key) // kb
            matched = size if key.startswith(node.key, pos) else self._common_blocks(node, key, pos)
            prev = 0
            for tier, depth in enumerate(node.depth):
                upto = depth if depth < matched else matched
                counts[tier] += upto - prev
                prev = upto
            pos += matched * kb
            if matched < size:
                break
            children = node.children
        return PrefixHit(pos // kb, tuple(counts))

    def match(self, namespace: BlockId, key: bytes) -> Match:
        """Longest cached prefix of `key`, ending on a node boundary (the last node is split if
        the prefix ends inside it). Marks the matched nodes as used."""
        root = self.root(namespace)
        self._tick += 1
        kb = self.key_nbytes
        end = len(key) - len(key) % kb
        node = root
        pos = 0
        while node.children is not None and pos < end:
            child = node.children.get(key[pos : pos + kb])
            if child is None:
                break
            child.tick = self._tick
            child.hits += 1
            size = len(child.key) // kb
            matched = (
                size if key.startswith(child.key, pos) else self._common_blocks(child, key, pos)
            )
            if matched < size:
                child = self._split(child, matched)
            node = child
            pos += matched * kb
            if matched < size:
                break
        return Match(node, pos // kb)

    def _common_blocks(self, node: Node, key: bytes, pos: int) -> int:
        """Whole blocks of `node.key` equal to `key[pos:]`; the first is known to match."""
        kb = self.key_nbytes
        lo, hi = 1, min(len(node.key), len(key) - pos) // kb  # lo blocks match; > hi cannot
        while lo < hi:  # binary search on the length of the common prefix, in blocks
            mid = (lo + hi + 1) // 2
            if key.startswith(node.key[: mid * kb], pos):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def path(self, end: Node) -> list[Node]:
        """The nodes from the namespace root's child down to `end`, in order."""
        nodes = []
        node: Node | None = end
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def blocks(self, end: Node) -> Iterator[BlockRef]:
        """Every block from the root down to the end of `end`, in order."""
        for node in self.path(end):
            for i in range(node.size):
                yield BlockRef(node, i)

    def refs_at(self, end: Node, positions: Sequence[int]) -> list[BlockRef]:
        """The blocks at `positions` (ascending, counted from the namespace root) along the
        path to `end`. Positions survive splits, which change nodes but not the path."""
        refs: list[BlockRef] = []
        wanted = iter(positions)
        nxt = next(wanted, None)
        start = 0
        for node in self.path(end):
            while nxt is not None and nxt < start + node.size:
                refs.append(BlockRef(node, nxt - start))
                nxt = next(wanted, None)
            start += node.size
        assert nxt is None, f"position {nxt} is past the end of the path ({start} blocks)"
        return refs

    def block_id(self, ref: BlockRef) -> BlockId:
        ds = self.digest_size
        return BlockId(ref.node.ids[ref.i * ds : (ref.i + 1) * ds])

    # ---- changing the tree --------------------------------------------------------------

    def insert(self, match: Match, key: bytes, slots: dict[int, list[int]]) -> InsertResult:
        """Add the whole blocks of `key` after `match` (which must be current), each with a copy
        in the tiers of `slots` (tier -> one slot per new block). The new blocks must not be in
        a faster tier than the last matched block (prefix closure); the caller places them so.
        Ids are chained from the last matched block. Returns the new blocks' ids."""
        kb = self.key_nbytes
        start = match.num_blocks * kb
        new_key = key[start : len(key) - len(key) % kb]
        count = len(new_key) // kb
        parent = match.end
        if count == 0:
            return InsertResult(0, b"", parent)
        assert slots and all(len(s) == count for s in slots.values()), "one slot per new block"
        assert min(slots) >= self._fastest_last(parent), "new blocks would break prefix closure"
        new_ids = self.hasher.chain(parent.ids[-self.digest_size :], new_key, kb)
        num_tiers = len(self.tiers)
        fields: list[list[Slot]] = [
            list(slots[t]) if t in slots else [None] * count for t in range(num_tiers)
        ]
        fastest = min(slots)  # every new block has copies in exactly the tiers of `slots`
        added = [count if t >= fastest else 0 for t in range(num_tiers)]
        self._tick += 1
        if parent.parent is not None and parent.children is None and not any(parent.locks or ()):
            # extend a leaf instead of hanging a one-child chain under it; never a locked leaf:
            # its leases end at its last block and must not grow to cover the new ones
            node = parent
            node.key += new_key
            node.ids += new_ids
            for tier, run in enumerate(fields):
                node.slots[tier].extend(run)
            node.depth = [d + a for d, a in zip(node.depth, added, strict=True)]
            node.tick = self._tick
        else:
            node = Node(parent, new_key, new_ids, fields, added, self._tick)
            if parent.parent is None:
                self._roots.setdefault(parent.ids, parent)
            if parent.children is None:
                parent.children = {}
            parent.children[new_key[:kb]] = node
            self._num_nodes += 1
            for tier, depth in enumerate(node.depth):
                if depth:
                    parent.child_res[tier] += 1
            self._refresh(parent)
        for tier in slots:
            self._count(node, tier, count)
        self._num_blocks += count
        self._refresh(node)
        return InsertResult(count, new_ids, node)

    def _fastest_last(self, node: Node) -> int:
        if node.parent is None:
            return 0
        return node.fastest(node.size - 1)

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after block `at`; return the new head (the first `at` blocks). The old
        node keeps the tail, so leases ending at it stay correct; the head inherits its locks."""
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
        self._num_nodes += 1
        self._refresh(head)
        self._refresh(node)
        return head

    def set_slot(self, ref: BlockRef, tier: int, slot: int) -> None:
        """Record a complete copy of a block in `tier`. If it becomes the block's fastest copy,
        the block's parent must already have a copy in `tier` or faster (prefix closure)."""
        node, i = ref
        assert node.slots[tier][i] is None, f"block already has a {self.tiers[tier]} copy"
        old = node.fastest(i)
        if tier < old:
            prev_ok = node.fastest(i - 1) <= tier if i else self._fastest_last_or_root(node, tier)
            assert prev_ok, "promotion must bring whole prefixes: parent block is slower"
        node.slots[tier][i] = slot
        self._count(node, tier, +1)
        if tier < old:
            self._shift_depth(node, i, tier, old, +1)

    def _fastest_last_or_root(self, node: Node, tier: int) -> bool:
        parent = node.parent
        assert parent is not None
        return parent.parent is None or parent.fastest(parent.size - 1) <= tier

    def can_clear(self, ref: BlockRef, tier: int) -> bool:
        """Whether removing the `tier` copy of a block keeps prefix closure: the block keeps
        another copy, and if `tier` was its fastest, no child block depends on it being there."""
        node, i = ref
        if node.slots[tier][i] is None:
            return False
        others = [t for t, fields in enumerate(node.slots) if t != tier and fields[i] is not None]
        if not others:
            return False
        new_fastest = others[0]
        if tier > new_fastest or node.fastest(i) != tier:
            return True
        if i + 1 < node.size:
            return node.fastest(i + 1) >= new_fastest
        return all(node.child_res[t] == 0 for t in range(tier, new_fastest))

    def clear_slot(self, ref: BlockRef, tier: int) -> int:
        """Forget the `tier` copy of a block (see `can_clear`); return its slot to free."""
        assert self.can_clear(ref, tier), "clearing this copy would break prefix closure"
        node, i = ref
        old = node.fastest(i)
        slot = node.slots[tier][i]
        assert slot is not None
        node.slots[tier][i] = None
        self._count(node, tier, -1)
        new = node.fastest(i)
        if new != old:
            self._shift_depth(node, i, old, new, -1)
        else:
            self._refresh(node)
        return slot

    def _shift_depth(self, node: Node, i: int, lo: int, hi: int, delta: int) -> None:
        """Block i's fastest tier moved between `lo` and `hi`: depth[lo:hi] changes by delta."""
        for tier in range(lo, hi):
            node.depth[tier] += delta
            if i == 0 and node.depth[tier] == (1 if delta > 0 else 0):
                parent = node.parent
                assert parent is not None
                parent.child_res[tier] += delta
        if i == 0:
            self._refresh(node.parent)  # type: ignore[arg-type]
        self._refresh(node)

    def drop(self, ref: BlockRef) -> list[tuple[int, int]]:
        """Remove a leaf block (the last block of a node without children, not locked) from
        the index; return its copies as (tier, slot) pairs for the caller to free."""
        node, i = ref
        parent = node.parent
        assert parent is not None and node.children is None and i == node.size - 1
        assert not any(node.locked(t) for t in range(len(self.tiers))), "dropping a leased block"
        freed = [(t, f[i]) for t, f in enumerate(node.slots) if f[i] is not None]
        for tier, _ in freed:
            self._count(node, tier, -1)
        self._num_blocks -= 1
        if node.size == 1:
            self._detach(node, parent)
        else:
            fastest = node.fastest(i)
            for fields in node.slots:
                fields.pop()
            node.key = node.key[: -self.key_nbytes]
            node.ids = node.ids[: -self.digest_size]
            for tier in range(fastest, len(self.tiers)):
                node.depth[tier] -= 1
            self._refresh(node)
        return [(t, s) for t, s in freed if s is not None]

    def drop_subtree(self, ref: BlockRef) -> list[tuple[int, int]]:
        """Remove a block and everything cached below it, leaf-first (e.g. a copy found corrupt
        takes its descendants with it: they would be orphans). Nothing in it may be locked.
        Returns the freed copies as (tier, slot) pairs."""
        node, i = ref
        below: list[Node] = []  # pre-order: every node before its descendants
        stack = list(node.children.values()) if node.children else []
        while stack:
            child = stack.pop()
            below.append(child)
            stack.extend(child.children.values() if child.children else ())
        freed: list[tuple[int, int]] = []
        for child in reversed(below):
            while child.parent is not None:
                freed += self.drop(BlockRef(child, child.size - 1))
        while node.parent is not None and node.size > i:
            freed += self.drop(BlockRef(node, node.size - 1))
        return freed

    def parent_id(self, ref: BlockRef) -> bytes:
        """The id before a block: the previous block's, or the namespace seed for a first one."""
        node, i = ref
        ds = self.digest_size
        if i:
            return node.ids[(i - 1) * ds : i * ds]
        assert node.parent is not None
        return node.parent.ids[-ds:]

    def namespace_of(self, node: Node) -> BlockId:
        while node.parent is not None:
            node = node.parent
        return BlockId(node.ids)

    def _detach(self, node: Node, parent: Node) -> None:
        """Unhook a node whose last block is being dropped."""
        assert parent.children is not None
        del parent.children[node.key[: self.key_nbytes]]
        if not parent.children:
            parent.children = None
        for tier, depth in enumerate(node.depth):
            self._candidates[tier].pop(node, None)
            if depth:
                parent.child_res[tier] -= 1
        self._num_nodes -= 1
        node.parent = None
        if parent.parent is None and parent.children is None:
            del self._roots[parent.ids]
            counts = self._ns_resident.pop(parent.ids, None)
            assert counts is None or not any(counts), f"an empty namespace holds {counts}"
        else:
            self._refresh(parent)

    # ---- eviction candidates ------------------------------------------------------------

    def _refresh(self, node: Node) -> None:
        """Re-decide, per tier, whether `node` offers an eviction candidate (see eviction.py)."""
        if node.parent is None:
            return
        size = node.size
        lo = 0
        for tier, hi in enumerate(node.depth):
            candidates = self._candidates[tier]
            if (
                hi > lo
                and (hi < size or node.child_res[tier] == 0)
                and not (node.locks is not None and node.locks[tier])
            ):
                candidates[node] = None
            else:
                candidates.pop(node, None)
            lo = hi

    def set_floors(self, floors: dict[bytes, tuple[int, ...]]) -> None:
        """Fair shares: each namespace's floor per tier, in blocks (absent: 0). Empty: plain
        LRU, as with a single tenant. A namespace holding no more than its floor in a tier is
        protected there (see `eviction.victims`)."""
        self.floors = dict(floors)

    def victims(self, tier: int, owner: bytes | None = None) -> Iterator[BlockRef]:
        """Least-recently-used leaves of `tier`, never locked; with floors set, first those of
        namespaces above their floor, then `owner`'s own (see `eviction.victims`)."""
        return victims(self, tier, self._candidates[tier], owner)

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

    def candidates(self, tier: int) -> dict[Node, None]:
        return self._candidates[tier]

    # ---- consistency --------------------------------------------------------------------

    def check(self) -> None:
        """Verify DESIGN invariants 2-5 over the whole index; raise InvariantError with the
        numbers that disagree (see `check.py`)."""
        from kvtier.index.check import check_index

        check_index(self)
