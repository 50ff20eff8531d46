"""One node of the radix index (a run of consecutive blocks with no branch inside it), the
references to its blocks, reading along a path, and the tally of the copies that nodes hold.

A node holds `n` blocks (path compression): their token bytes `key` (n * key_nbytes), the ids
of its first k blocks `ids` (k * digest_size, 0 <= k <= n: ids are chained when first needed,
`Forest.ids_of`, not on every insert) and, per tier, a list of n slot fields. A block has a
copy in tier t exactly when `slots[t][i] is not None`: residency is read from which fields are
set, never from a status flag that could drift.

    tiers:      0=gpu  1=host  2=disk        (fastest first)
    block i:      0      1      2      3     (n = 4)
    slots[0]:   [ 7,     3,   None,  None]   gpu copies of blocks 0 and 1
    slots[1]:   [None,  12,    13,   None]
    slots[2]:   [ 40,   41,    42,    43 ]
    fastest:      0      0      1      2
    depth:      [2, 3, 4]    depth[t] = number of blocks whose fastest copy is in tier <= t

Prefix closure (DESIGN invariant 3) makes `fastest` non-decreasing along a path, so the blocks
whose fastest tier is <= t are always the first `depth[t]` blocks of a node: a lookup splits a
match by tier with one `min()` per tier, no per-block scan.

`child_res[t]` counts the children whose first block has a copy in a tier <= t (their
depth[t] > 0); with it, "is the tail of this node's tier-t run a leaf of tier t?" is O(1).
`tick` is the index's clock reading at the node's last use (recency); `hits` counts the lookups
and matches that walked through its last block (the `selective` write policy, disk admission).
A walk covers whole nodes, but a leaf extended by an insert (`Forest.grow`) holds blocks walked
more often than its new ones, which start at 0: `steps` (None, or `(boundary, extra)` pairs,
boundaries ascending) says that the blocks before `boundary` were walked `extra` times more, so
`block_hits` is exact per block and `hits` is the least count of the node's blocks.
`locks[t]` counts the leases (and the store's short pins) on tier t whose prefix covers this
node; None until the node is first locked, to keep unleased nodes small. `held` counts the locks
taken for a tenant (its leases and reservations, not the store's own pins) that cover it: the
tenant's quota counts the blocks of the nodes where it is > 0 (`shares.py`).
`ev` is the KV-event hash of its first block, block i's `ev + i` (0: none yet): the events
observer gives a node a range of `EVENT_RANGE` numbers, from a multiple of it, when it first
tells of one of its blocks (`IndexEvents`); a split gives the tail `ev + at`, and a leaf grows
only within its range (`ev % EVENT_RANGE + n <= EVENT_RANGE`, `Forest.grow`): ranges never meet.
`root` is the namespace root the node hangs from (itself for a root), so the per-namespace
counts that fair shares need cost O(1) per change.

The root of each namespace is a node with no blocks whose `ids` holds the namespace seed, so the
parent id of any block is the last of `Forest.ids_of(parent)` without a special case.

Only the index writes these fields (`radix.py`, `forest.py`; `restore.py` builds
nodes); `index/check.py` recomputes every derived one.

Small named results passed between the index and the store.

Reading along a path: the nodes and blocks from a namespace root down to one node.

A path is named by its last node `end` (a `Match.end`, a lease's end). Blocks on it are
addressed by `BlockRef(node, i)` or by position, counted from the namespace root:

    root - A[0 1 2] - B[3 4] - C[5 6 7]        path(C) == [A, B, C]
                                               refs_at(C, [1, 3]) == [(A, 1), (B, 0)]

Positions survive splits (a split changes nodes, never the path's blocks), which is why a
caller that lets go of the index between two steps keeps positions rather than refs.
Read-only, no index state: each function follows `parent` links, O(nodes on the path).

`Residency` (`residency.py`): copies counted per tier, in all and per namespace.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, NewType

from kvtier.blocks import BlockId

Slot = int | None


EVENT_RANGE = 1 << 20  # KV-event numbers of a node (`ev`): the most blocks it holds


class Node:
    __slots__ = (
        "child_res",
        "children",
        "depth",
        "ev",
        "held",
        "hits",
        "ids",
        "key",
        "locks",
        "parent",
        "root",
        "slots",
        "steps",
        "tick",
    )

    def __init__(
        self,
        parent: Node | None,
        key: bytes,
        ids: bytes,
        slots: list[list[Slot]],
        depth: list[int],
        tick: int,
    ) -> None:
        self.parent = parent
        self.key = key
        self.ids = ids
        self.ev = 0
        self.slots = slots
        self.children: dict[bytes, Node] | None = None
        self.depth = depth
        self.child_res = [0] * len(slots)
        self.locks: list[int] | None = None
        self.held = 0
        self.root: Node = self if parent is None else parent.root
        self.tick = tick
        self.hits = 0
        self.steps: list[tuple[int, int]] | None = None

    @property
    def size(self) -> int:
        """Number of blocks in this node (0 for a namespace root)."""
        return len(self.slots[0])

    def locked(self, tier: int) -> bool:
        return self.locks is not None and self.locks[tier] > 0

    def fastest(self, i: int) -> int:
        """Index of the fastest tier holding block i; the number of tiers when none does."""
        for tier, fields in enumerate(self.slots):
            if fields[i] is not None:
                return tier
        return len(self.slots)

    def copies(self, i: int) -> list[int]:
        """The tiers holding a copy of block i, fastest first."""
        return [tier for tier, fields in enumerate(self.slots) if fields[i] is not None]

    def fastest_last(self) -> int:
        """`fastest` of the last block; 0 for a namespace root, below which any tier may hang."""
        return self.fastest(self.size - 1) if self.parent is not None else 0

    def __repr__(self) -> str:
        return f"Node(size={self.size}, depth={self.depth}, tick={self.tick})"


def block_hits(ref: BlockRef) -> int:
    """The lookups and matches that walked through block `ref.i` of `ref.node` (module doc)."""
    node, i = ref
    return node.hits + sum(extra for boundary, extra in node.steps or () if i < boundary)


def hits_run(node: Node, hi: int) -> int:
    """The first of blocks ..., hi-1 of `node` that share block hi-1's hit count: a run of
    victims stops there, so that one decision by `hits` holds for all of its blocks."""
    return max((b for b, _ in node.steps or () if b < hi), default=0)


def split_steps(node: Node, at: int) -> tuple[int, list[tuple[int, int]] | None]:
    """For `Forest.split(node, at)`: the head's `hits` and `steps` (the tail keeps the steps
    past `at`, `tail_steps`)."""
    steps = node.steps or ()
    extra = sum(e for b, e in steps if b >= at)
    return node.hits + extra, [(b, e) for b, e in steps if b < at] or None


def tail_steps(node: Node, at: int) -> list[tuple[int, int]] | None:
    """The `steps` of blocks at, at + 1, ... of `node`, counted from `at`."""
    return [(b - at, e) for b, e in node.steps or () if b > at] or None


def cut_steps(node: Node, keep: int) -> None:
    """`node` keeps its first `keep` blocks: steps past them fold into `hits`, whose last
    block is now block keep-1. O(steps removed): boundaries ascend, the node owns its list."""
    steps = node.steps
    assert steps is not None
    while steps and steps[-1][0] >= keep:
        node.hits += steps.pop()[1]
    if not steps:
        node.steps = None


def slowest_counts(slots: list[list[Slot]], lo: int, hi: int) -> list[int]:
    """Blocks lo..hi-1 counted by the tier of their slowest copy (index: tier; a block with no
    copy is not counted). O(tiers) list scans in C when the slowest tier holding any of them
    holds all, else O((hi - lo) * tiers)."""
    counts = [0] * len(slots)
    left: list[int] | None = None  # positions whose slowest copy is not found yet; None: all
    for tier in range(len(slots) - 1, -1, -1):
        tail = slots[tier][lo:hi]
        if left is None:
            missing = tail.count(None)
            counts[tier] = len(tail) - missing
            if missing == len(tail):
                continue
            if not missing:
                break
            left = [j for j, slot in enumerate(tail) if slot is None]
        else:
            still = [j for j in left if tail[j] is None]
            counts[tier] = len(left) - len(still)
            left = still
            if not left:
                break
    return counts


def depth_of(slots: list[list[Slot]]) -> list[int]:
    """`depth` computed from slot fields (see the module docstring). O(n * tiers)."""
    num_tiers = len(slots)
    depth = [0] * num_tiers
    for fields in zip(*slots, strict=True):
        fastest = next((t for t, slot in enumerate(fields) if slot is not None), num_tiers)
        for tier in range(fastest, num_tiers):
            depth[tier] += 1
    return depth


def can_clear(ref: BlockRef, tier: int, copies: list[int] | None = None) -> bool:
    """Whether removing the `tier` copy of a block keeps prefix closure: the block keeps
    another copy, and if `tier` was its fastest, no child block depends on it being there.
    `copies`: the block's `Node.copies`, when the caller has them."""
    node, i = ref
    if copies is None:
        copies = node.copies(i)
    if tier not in copies or len(copies) < 2:
        return False
    if tier != copies[0]:
        return True
    new_fastest = copies[1]
    if i + 1 < node.size:
        return node.fastest(i + 1) >= new_fastest
    return all(node.child_res[t] == 0 for t in range(tier, new_fastest))


def next_fastest(slots: list[list[Slot]], tier: int, lo: int, hi: int) -> list[int]:
    """For each of blocks lo..hi-1, the fastest tier after `tier` holding a copy of it (the
    number of tiers: none). O(tiers) list scans when one tier holds a copy of each."""
    news = [len(slots)] * (hi - lo)
    left: Sequence[int] = range(hi - lo)  # positions whose next copy is not found yet
    for lower in range(tier + 1, len(slots)):
        fields = slots[lower][lo:hi]
        if len(left) == len(news) and None not in fields:
            return [lower] * len(news)
        for j in left:
            if fields[j] is not None:
                news[j] = lower
        left = [j for j in left if fields[j] is None]
    return news


def clearable_tail(node: Node, tier: int, news: list[int]) -> int:
    """How many of the last `len(news)` blocks of `node`'s run in `tier` (the blocks whose
    fastest copy is there), from the end, `can_clear` allows in a row, each once the ones
    after it are gone; `news`: their `next_fastest`. E.g. news [disk, host, host] and no
    child: 2 (block 0 may not sit on disk below block 1 on host)."""
    hi, count, num_tiers = node.depth[tier], len(news), len(node.slots)
    assert count <= hi - (node.depth[tier - 1] if tier else 0)
    if hi < node.size:
        bound = node.fastest(hi)  # each cleared block's new fastest must not pass the next's
    else:
        bound = next((t for t in range(tier, num_tiers) if node.child_res[t]), num_tiers)
    if news and news.count(news[0]) == count:
        return count if news[0] <= bound and news[0] < num_tiers else 0
    taken = 0
    for new in reversed(news):
        if new > bound or new == num_tiers:
            break
        bound = new
        taken += 1
    return taken


LeaseId = NewType("LeaseId", int)


class PrefixHit(NamedTuple):
    """What `RadixIndex.lookup` found: `num_blocks` cached leading blocks, split by the fastest
    tier holding each (`tier_blocks[t]`, tiers fastest first; they sum to `num_blocks`)."""

    num_blocks: int
    tier_blocks: tuple[int, ...]


class Match(NamedTuple):
    """A cached prefix that ends on a node boundary: the first `num_blocks` blocks of the key,
    held by the nodes from the namespace root down to `end` (`end` is the root when nothing
    matched). Valid until the next change to the index; a lease on `end` keeps it."""

    end: Node
    num_blocks: int


class BlockRef(NamedTuple):
    """Block `i` of `node`. Valid until the next change to the index."""

    node: Node
    i: int


class VictimRun(NamedTuple):
    """The next victims of a tier, all from one node: blocks `hi - 1`, `hi - 2`, ..., `lo`, in
    that order (each the tail of the node's run in the tier when its turn comes). Valid until
    the next change to the index."""

    node: Node
    lo: int
    hi: int


class InsertResult(NamedTuple):
    """`new_blocks` blocks were added after the match; they end `end`'s blocks."""

    new_blocks: int
    end: Node


def path(end: Node) -> list[Node]:
    """The nodes from the namespace root's child down to `end`, in order."""
    nodes = []
    node: Node | None = end
    while node is not None and node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


def blocks(end: Node) -> Iterator[BlockRef]:
    """Every block from the root down to the end of `end`, in order."""
    for node in path(end):
        for i in range(node.size):
            yield BlockRef(node, i)


def refs_at(end: Node, positions: Sequence[int]) -> list[BlockRef]:
    """The blocks at `positions` (ascending, counted from the namespace root) along the
    path to `end`. Positions survive splits, which change nodes but not the path."""
    refs: list[BlockRef] = []
    wanted = iter(positions)
    nxt = next(wanted, None)
    start = 0
    for node in path(end):
        while nxt is not None and nxt < start + node.size:
            refs.append(BlockRef(node, nxt - start))
            nxt = next(wanted, None)
        start += node.size
    assert nxt is None, f"position {nxt} is past the end of the path ({start} blocks)"
    return refs


def namespace_of(node: Node) -> BlockId:
    """The namespace (seed) of the tree `node` hangs in."""
    return BlockId(node.root.ids)
