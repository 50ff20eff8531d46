"""Helpers of `radix.py`'s walks and edits: the common prefix of a node and a key, a block's
fastest tier moving (`depth` and its parent's `child_res`), and what a subtree drop removes
(its blocks by fastest tier, its copies per tier, whether a lock forbids it or a floor)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtier.index.eviction import CandidateSets
from kvtier.index.node import BlockRef, Node
from kvtier.index.residency import Residency

if TYPE_CHECKING:
    from kvtier.index.leases import LeaseRecord


def common_blocks(node: Node, key: bytes, pos: int, kb: int) -> int:
    """Whole blocks (`kb` bytes each) of `node.key` equal to `key[pos:]`; the first matches."""
    lo, hi = 1, min(len(node.key), len(key) - pos) // kb  # lo blocks match; > hi cannot
    while lo < hi:  # binary search on the length of the common prefix, in blocks
        mid = (lo + hi + 1) // 2
        if key.startswith(node.key[: mid * kb], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


def shift_depth(
    candidates: CandidateSets, node: Node, i: int, lo: int, hi: int, delta: int
) -> None:
    """Block i's fastest tier moved between `lo` and `hi`: depth[lo:hi] changes by delta (and
    the parent's `child_res` with it, when i is the first block); candidacy refreshed."""
    for tier in range(lo, hi):
        node.depth[tier] += delta
        if i == 0 and node.depth[tier] == (1 if delta > 0 else 0):
            parent = node.parent
            assert parent is not None
            parent.child_res[tier] += delta
    if i == 0:
        candidates.refresh(node.parent)  # type: ignore[arg-type]
    candidates.refresh(node)


def subtree_tails(ref: BlockRef) -> list[tuple[Node, int]]:
    """What `drop_subtree(ref)` removes, leaf-first: (node, its last k blocks to drop)."""
    node, i = ref
    below: list[Node] = []  # pre-order: every node before its descendants
    stack = list(node.children.values()) if node.children else []
    while stack:
        child = stack.pop()
        below.append(child)
        stack.extend(child.children.values() if child.children else ())
    return [(child, child.size) for child in reversed(below)] + [(node, node.size - i)]


def subtree_locked(ref: BlockRef) -> bool:
    """Whether a node that `drop_subtree(ref)` would cut is locked in some tier (a lease, a
    flight's or the store's pin): then nothing of it may be dropped yet."""
    return any(any(node.locks or ()) for node, _ in subtree_tails(ref))


def unheld_subtrees(root: Node) -> list[Node]:
    """The top nodes of the largest subtrees below `root` in which no node is locked in any tier
    (a lease, a flight's or the store's pin): what a clear drops whole (`drop_subtree`), each
    apart from the others. A locked node stays with every node above it (prefix closure), and
    so does a node with a lock anywhere below it; what branches off those is dropped."""
    order: list[Node] = []  # pre-order, children in their order: every node before its own
    stack = list(reversed(root.children.values())) if root.children else []
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(node.children.values()) if node.children else ())
    held = {id(root)}  # nodes kept: locked, or a lock below them
    for node in reversed(order):  # children before their parents
        if id(node) in held or any(node.locks or ()):
            held.add(id(node))
            held.add(id(node.parent))
    return [node for node in order if id(node) not in held and id(node.parent) in held]


def by_fastest(ref: BlockRef) -> list[int]:
    """What `drop_subtree(ref)` removes, per tier of each block's fastest copy (`depth[t]`: a
    node's first blocks whose fastest copy is in a tier <= t; a root has none)."""
    counts = [0] * len(ref.node.depth)
    for node, k in subtree_tails(ref):
        above = 0
        for tier, depth in enumerate(node.depth):
            within = max(0, depth - (node.size - k))
            counts[tier] += within - above
            above = within
    return counts


def subtree_copies(ref: BlockRef) -> list[int]:
    """What `drop_subtree(ref)` removes, as copies per tier (`Residency.resident_in`'s unit)."""
    counts = [0] * len(ref.node.slots)
    for node, k in subtree_tails(ref):
        for tier, slots in enumerate(node.slots):
            counts[tier] += sum(slot is not None for slot in slots[node.size - k :])
    return counts


def under_floor(residency: Residency, ref: BlockRef, owner: bytes | None) -> bool:
    """Whether dropping the subtree of `ref`, not of namespace `owner` (None: the store's own
    work), leaves its namespace under its floor in a tier it has copies in (`residency.py`)."""
    namespace = ref.node.root.ids
    floor = residency.floors.get(namespace)
    if floor is None or namespace == owner:
        return False
    return any(
        n and residency.resident_in(namespace, t) - n < floor[t]
        for t, n in enumerate(subtree_copies(ref))
    )


def locked_by_namespace(records: Iterable[LeaseRecord], tier: int) -> dict[bytes, int]:
    """`LeaseTable.locked_blocks(tier)` (pins included) per namespace: the copies in `tier` on
    the paths that leases and pins on `tier` lock, each counted once. Their sum is the total;
    `Residency.locked_share` needs who holds them."""
    seen: set[Node] = set()
    counts: dict[bytes, int] = {}
    for record in records:
        if tier not in record.tiers:
            continue
        node, count = record.end, 0
        while node.parent is not None and node not in seen:
            seen.add(node)
            count += sum(1 for slot in node.slots[tier] if slot is not None)
            node = node.parent
        if count:
            namespace = record.end.root.ids
            counts[namespace] = counts.get(namespace, 0) + count
    return counts
