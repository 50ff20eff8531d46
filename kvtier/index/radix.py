"""The radix index: which token prefixes are cached, as which blocks, in which tiers.

Token-keyed (canonical uint32 bytes, `blocks.py`), block-granular (a key is cut into blocks of
`block_tokens`; a partial last block is never indexed), path-compressed (`node.py`). One tree
per namespace (model geometry + tenant): tenants share no node, so no lookup can see another
tenant's blocks (DESIGN invariant 6).

What the index does, and what it leaves to its caller (the store):
- `lookup` walks a key to its longest cached prefix and splits it by the fastest tier of each
  block. It changes nothing but recency.
- `match` does the same walk but splits the last node so the prefix ends on a node boundary,
  which `lock` (leases and pins), `insert` and `path` need.
- `insert` adds the blocks of a key after a match; their ids chain from the last matched one.
- `set_slot`/`clear_slot`/`drop`/`drop_tail` record copies that the caller has made or freed.
  The caller makes a copy complete before `set_slot` (DESIGN invariant 1) and frees the pool
  slots that `clear_slot`/`drop`/`drop_tail` return. Each asserts that prefix closure
  (invariant 3) still holds. `drop_tail` removes a leaf node's last k blocks in one edit;
  `clear_tail` and `add_copies` forget or record one tier's copies of a run in one edit.
- `victims(tier, owner)` (see `eviction.py`) proposes least-recently-used leaves of a tier,
  with fair shares: a namespace at or under its floor (`set_floors`) gives blocks last;
  `victim_runs` proposes the same blocks as runs of one node, for callers that free in bulk.
  A pass costs O(log candidates) per victim, never O(size of the cache).
- `resident_in(namespace, tier)` counts a namespace's copies per tier, kept up to date by
  every change, O(1): what fair shares and a tenant's status read.
- Leases (`forest.py`) lock prefixes so their copies are never proposed as victims.

How it is built: `RadixIndex` walks keys (`lookup`, `match`) and records copies (`set_slot`,
`clear_slot`, `drop`) itself, since those are the hot paths, per call and per block. The rest
lives in named parts, public for `check.py` and `restore.py`: `forest` (`forest.py`: the roots,
node and block counts, the structural edits: grow, split, detach), `residency` (`node.py`:
copies per tier and per namespace, floors) and `leases` (`forest.py`); the eviction candidates
(`eviction.CandidateSets`) are refreshed by all of them, and read by the eviction queries
(`queries.py`). Reading along a path is `node.py`; small helpers are `helpers.py`. An
`observer` (`TierObserver`; KV events) is told of every copy a block gains or loses.

Pure Python, no I/O, no threads, no clocks: time arrives as arguments. Not thread-safe; the
store serialises calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, cast

from kvtier.blocks import TOKEN_NBYTES, BlockHasher, BlockId
from kvtier.index import node
from kvtier.index.eviction import CandidateSets
from kvtier.index.forest import Forest
from kvtier.index.helpers import common_blocks, shift_depth, subtree_locked, subtree_tails
from kvtier.index.leases import LeaseTable
from kvtier.index.node import (
    EVENT_RANGE,
    BlockRef,
    InsertResult,
    Match,
    Node,
    PrefixHit,
    can_clear,
    clearable_tail,
    next_fastest,
    slowest_counts,
)
from kvtier.index.queries import EvictionQueries
from kvtier.index.residency import Residency


class TierObserver(Protocol):
    """Told of each change of where blocks live (`RadixIndex.observer`; KV events): blocks
    lo..hi-1 of `node` gained a copy in each of `tiers` (after the edit), or those of them that
    have a copy in one of `tiers` are about to lose it (before the edit, so their ids can still
    be read). One call per edit, whatever the number of tiers: the call is most of the cost."""

    def gained(self, node: Node, lo: int, hi: int, tiers: tuple[int, ...]) -> None: ...

    def lost(self, node: Node, lo: int, hi: int, tiers: tuple[int, ...]) -> None: ...


def tell_chain(observer: TierObserver, result: InsertResult, tiers: tuple[int, ...]) -> None:
    """Tell `observer` of an insert's new blocks when they are more than `result.end` holds: a
    chain of new nodes ending there (a run longer than a node may be, `Forest.grow`), parents
    first. (New blocks within one node are told by `RadixIndex.insert` itself.)"""
    end, new = result.end, result.new_blocks
    chain = []
    while new > 0:
        chain.append(end)
        new -= end.size
        assert end.parent is not None
        end = end.parent
    for link in reversed(chain):
        observer.gained(link, 0, link.size, tiers)


class RadixIndex(EvictionQueries):
    """The index of every namespace, and the one object its users hold (module doc)."""

    def __init__(
        self,
        tiers: Sequence[str],
        block_tokens: int,
        hasher: BlockHasher,
        node_blocks: int = EVENT_RANGE,
    ) -> None:
        assert 1 <= node_blocks <= EVENT_RANGE  # the most blocks a node holds (node.py)
        assert len(tiers) >= 1 and block_tokens >= 1
        self.tiers = tuple(tiers)
        self.tier_numbers = tuple(range(len(self.tiers)))
        self.block_tokens = block_tokens
        self.hasher = hasher
        self.key_nbytes = block_tokens * TOKEN_NBYTES
        self.digest_size = hasher.digest_size
        num_tiers = len(self.tiers)
        self._candidates = CandidateSets(num_tiers)
        self.residency = Residency(num_tiers)
        self.forest = Forest(
            num_tiers, self.key_nbytes, hasher, self._candidates, self.residency, node_blocks
        )
        self.leases = LeaseTable(num_tiers, self._candidates)
        self._tick = 0
        self.observer: TierObserver | None = None  # told of every copy gained or lost

    # ---- sizes --------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.forest.num_blocks

    @property
    def num_nodes(self) -> int:
        """Nodes holding blocks (namespace roots not counted)."""
        return self.forest.num_nodes

    @property
    def num_namespaces(self) -> int:
        return len(self.forest.roots)

    def resident(self, tier: int) -> int:
        """Number of blocks with a copy in `tier`."""
        return self.residency.resident(tier)

    def resident_in(self, namespace: bytes, tier: int) -> int:
        """Number of blocks of `namespace` with a copy in `tier`."""
        return self.residency.resident_in(namespace, tier)

    def namespaces_resident(self) -> dict[bytes, tuple[int, ...]]:
        """Copies per tier of every namespace that holds blocks."""
        return self.residency.namespaces_resident()

    def roots(self) -> Iterator[Node]:
        return iter(self.forest.roots.values())

    # ---- walking ------------------------------------------------------------------------

    def root(self, namespace: BlockId) -> Node:
        """The root of a namespace (`Forest.root`: a miss leaves nothing behind)."""
        return self.forest.root(namespace)

    def lookup(self, namespace: BlockId, key: bytes) -> PrefixHit:
        """Longest cached prefix of `key`, split by tier. Marks the matched blocks as used: a
        node matched in part is split first, so that its unused tail keeps its recency."""
        root = self.forest.roots.get(namespace)
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
            size = len(node.key) // kb
            matched = size if key.startswith(node.key, pos) else common_blocks(node, key, pos, kb)
            if matched < size:
                node = self.forest.split(node, matched)
            node.tick = tick
            node.hits += 1
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
        the prefix ends inside it). Marks the matched blocks as used (not a split tail)."""
        root = self.forest.root(namespace)
        self._tick += 1
        kb = self.key_nbytes
        end = len(key) - len(key) % kb
        node = root
        pos = 0
        while node.children is not None and pos < end:
            child = node.children.get(key[pos : pos + kb])
            if child is None:
                break
            size = len(child.key) // kb
            matched = size if key.startswith(child.key, pos) else common_blocks(child, key, pos, kb)
            if matched < size:
                child = self.forest.split(child, matched)
            child.tick = self._tick
            child.hits += 1
            node = child
            pos += matched * kb
            if matched < size:
                break
        return Match(node, pos // kb)

    path = staticmethod(node.path)
    blocks = staticmethod(node.blocks)
    refs_at = staticmethod(node.refs_at)
    namespace_of = staticmethod(node.namespace_of)

    def block_id(self, ref: BlockRef) -> BlockId:
        ds = self.digest_size
        return BlockId(self.forest.ids_of(ref.node)[ref.i * ds : (ref.i + 1) * ds])

    def block_ids(self, node: Node) -> bytes:
        """The ids of all of `node`'s blocks, concatenated (`digest_size` bytes each; the
        namespace seed for a root): one read for many blocks of a node."""
        return self.forest.ids_of(node)

    def parent_id(self, ref: BlockRef) -> bytes:
        """The id before a block: the previous block's, or the namespace seed for a first one."""
        node, i = ref
        ds = self.digest_size
        if i:
            return self.forest.ids_of(node)[(i - 1) * ds : i * ds]
        assert node.parent is not None
        return self.forest.ids_of(node.parent)[-ds:]

    # ---- changing the tree --------------------------------------------------------------

    def insert(self, match: Match, key: bytes, slots: dict[int, list[int]]) -> InsertResult:
        """Add the whole blocks of `key` after `match` (which must be current), each with a copy
        in the tiers of `slots` (tier -> one slot per new block), none in a faster tier than the
        last matched block (prefix closure: the caller places them so); their ids chain from
        it, computed when first read (`block_id`)."""
        self._tick += 1
        result = self.forest.grow(match, key, slots, self._tick)
        observer, new, end = self.observer, result.new_blocks, result.end
        if observer is not None and new:  # one node (most often): told without a frame more
            if new <= (size := len(end.slots[0])):
                observer.gained(end, size - new, size, tuple(slots))
            else:
                tell_chain(observer, result, tuple(slots))
        return result

    def set_slot(self, ref: BlockRef, tier: int, slot: int) -> None:
        """Record a complete copy of a block in `tier`. If it becomes the block's fastest copy,
        the block's parent must already have a copy in `tier` or faster (prefix closure)."""
        node, i = ref
        slots = node.slots
        assert slots[tier][i] is None, f"block already has a {self.tiers[tier]} copy"
        old = node.fastest(i)
        if tier < old:
            parent = node.parent
            assert parent is not None
            before = node.fastest(i - 1) if i else parent.fastest_last()
            assert before <= tier, "promotion must bring whole prefixes: parent block is slower"
        below = tier + 1
        while below < len(slots) and slots[below][i] is None:
            below += 1
        if below == len(slots):  # no copy below it: it becomes the block's slowest
            held = node.copies(i)
            self.residency.slowest_moved(held[-1] if held else -1, tier)
        slots[tier][i] = slot
        self.residency.add(node.root.ids, tier, +1)
        if tier < old:
            shift_depth(self._candidates, node, i, tier, old, +1)
        if self.observer is not None:
            self.observer.gained(node, i, i + 1, (tier,))

    can_clear = staticmethod(can_clear)

    def clear_slot(self, ref: BlockRef, tier: int) -> int:
        """Forget the `tier` copy of a block (see `can_clear`); return its slot to free."""
        node, i = ref
        copies = node.copies(i)
        assert can_clear(ref, tier, copies), "clearing this copy would break prefix closure"
        fields = node.slots[tier]
        slot = fields[i]
        assert slot is not None
        if self.observer is not None:
            self.observer.lost(node, i, i + 1, (tier,))
        fields[i] = None
        self.residency.add(node.root.ids, tier, -1)
        if tier == copies[-1]:  # it was the slowest copy: the one before it is now
            self.residency.slowest_moved(tier, copies[-2])
        if tier == copies[0]:  # it was the fastest: the block's fastest moves down to copies[1]
            shift_depth(self._candidates, node, i, tier, copies[1], -1)
        else:
            self._candidates.refresh(node)
        return slot

    def clear_tail(self, node: Node, tier: int, count: int) -> list[int]:
        """Forget the `tier` copies of the last blocks of `node`'s run in `tier`, at most
        `count`, from the end while `can_clear` allows (`node.clearable_tail`), in one edit, as
        `clear_slot` would one at a time; return their slots, the last block's first, to free
        (none: nothing changed). O(count + tiers) when the next tier holds a copy of each.

            gpu  [3 4 5 6]   depth [4, 4]   clear_tail(node, gpu, 2)   gpu  [3 4 - -]
            host [7 8 9 10]                 -> [6, 5]                  depth [2, 4]
        """
        hi = node.depth[tier]
        news = next_fastest(node.slots, tier, hi - count, hi)
        count = clearable_tail(node, tier, news)
        if not count:
            return []
        news, lo = news[len(news) - count :], hi - count
        if self.observer is not None:
            self.observer.lost(node, lo, hi, (tier,))
        fields = node.slots[tier]
        freed = fields[lo:hi]
        freed.reverse()
        fields[lo:hi] = [None] * count
        self.residency.add(node.root.ids, tier, -count)  # each keeps its slowest copy
        depth = node.depth
        had = [d > 0 for d in depth]
        for new in set(news):  # each block's fastest copy moves from `tier` to `new`
            moved = news.count(new)
            for t in range(tier, new):
                depth[t] -= moved
        if lo == 0:
            parent = node.parent
            assert parent is not None
            for t in range(tier, len(depth)):
                parent.child_res[t] -= had[t] and not depth[t]
            self._candidates.refresh(parent)
        self._candidates.refresh(node)
        return cast("list[int]", freed)  # the run had a copy of each in `tier`

    def add_copies(self, node: Node, tier: int, lo: int, slots: list[int]) -> None:
        """Record complete copies in `tier` of blocks lo, lo + 1, ... of `node` (one slot each),
        none of which has one there yet and each of which has a faster copy (copies made
        down: no depth moves): `set_slot` for each, in one edit. O(count + tiers) usually."""
        hi = lo + len(slots)
        fields = node.slots[tier]
        assert tier and node.depth[tier - 1] >= hi, "a copy down: each block has a faster one"
        assert fields[lo:hi].count(None) == len(slots), f"a block has a {self.tiers[tier]} copy"
        residency = self.residency
        residency.slowest_counted(slowest_counts(node.slots, lo, hi), -1)
        fields[lo:hi] = slots
        residency.slowest_counted(slowest_counts(node.slots, lo, hi), +1)
        residency.add(node.root.ids, tier, len(slots))
        if self.observer is not None:
            self.observer.gained(node, lo, hi, (tier,))

    def drop(self, ref: BlockRef) -> list[tuple[int, int]]:
        """Remove a leaf block (the last block of a node without children, not locked) from
        the index; return its copies as (tier, slot) pairs for the caller to free."""
        node, i = ref
        assert i == node.size - 1, "only the last block of a node is a leaf"
        return [(t, slots[0]) for t, slots in enumerate(self.drop_tail(node, 1)) if slots]

    def drop_tail(self, node: Node, count: int) -> list[list[int]]:
        """Remove the last `count` blocks of a leaf node (no children, not locked) in one edit,
        the node itself when that is all of it; return the freed slots per tier (index: tier,
        last block first), for the caller to free. O(count + tiers), whatever the node's size.

            node[b0 b1 b2 b3 b4]   drop_tail(node, 2)   node[b0 b1 b2]
        """
        assert node.parent is not None and node.children is None and 0 < count <= node.size
        assert not any(node.locks or ()), "dropping a leased block"
        if self.observer is not None:
            self.observer.lost(node, node.size - count, node.size, self.tier_numbers)
        return self.forest.cut(node, count)

    def drop_subtree(self, ref: BlockRef) -> list[tuple[int, int]]:
        """Remove a block and everything cached below it, leaf-first, e.g. a copy found corrupt
        with the orphans it would leave; the freed copies as (tier, slot) pairs. None of it may
        be locked (`subtree_locked`, asserted before anything changes)."""
        assert not subtree_locked(ref), "dropping a leased block"
        dropped = [self.drop_tail(tail, count) for tail, count in subtree_tails(ref)]
        return [(t, s) for per_tier in dropped for t, slots in enumerate(per_tier) for s in slots]

    # ---- consistency --------------------------------------------------------------------

    def check(self) -> None:
        """DESIGN invariants 2-5 over the whole index (`check.py`), or InvariantError."""
        from kvtier.index.check import check_index

        check_index(self)
