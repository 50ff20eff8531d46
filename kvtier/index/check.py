"""`RadixIndex.check()`: recompute everything the index keeps incrementally and compare.

Verifies DESIGN invariants 2-5 as far as the index holds them:
2. no orphans: every node hangs from its parent under the key of its first block, and every
   node holds at least one block;
3. prefix closure per tier: along every path, the fastest tier of each block is non-decreasing
   (so for each tier, the blocks with a copy there or faster form a tree from the root), and
   every block has at least one copy;
4. every live lease still finds a copy of each of its blocks in each leased tier, and each
   node's lock counts equal the leases covering it;
5. per-tier resident counts (and counts of blocks by their slowest copy) equal a recount, and
   no slot holds two blocks of one tier.
9. (what the index keeps of it) each namespace's copies per tier and its held blocks (covered
   by a tenant's leases and reservation pins) equal a recount.
Also the derived fields (`depth`, `child_res`, eviction candidates and their recency queues,
block and node counts).
The store checks the pools' byte accounting against `resident()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import InvariantError
from kvtier.index.node import Node, depth_of

if TYPE_CHECKING:
    from kvtier.index.radix import RadixIndex


def check_index(index: RadixIndex) -> None:
    num_tiers = len(index.tiers)
    kb, ds = index.key_nbytes, index.digest_size
    resident = [0] * num_tiers
    only = [0] * num_tiers  # blocks by the tier of their slowest copy
    seen_slots: list[set[int]] = [set() for _ in range(num_tiers)]
    blocks = nodes = 0
    expected_locks: dict[Node, list[int]] = {}
    expected_held: dict[Node, int] = {}
    for record in index.leases:
        node = record.end
        while node.parent is not None:
            counts = expected_locks.setdefault(node, [0] * num_tiers)
            for tier in record.tiers:
                counts[tier] += 1
            expected_held[node] = expected_held.get(node, 0) + record.held
            for tier in record.tiers if record.resident else ():
                missing = sum(1 for slot in node.slots[tier] if slot is None)
                _expect(
                    missing == 0,
                    f"lease {record.lease_id}: {missing} blocks of a leased "
                    f"node lost their {index.tiers[tier]} copy",
                )
            node = node.parent
    for namespace, root in index.forest.roots.items():
        _expect(
            root.parent is None and root.key == b"" and root.ids == namespace,
            f"namespace root {namespace.hex()} is malformed",
        )
        _expect(root.children is not None, f"namespace {namespace.hex()} has an empty root")
        ns_resident = [0] * num_tiers
        ns_held = 0
        stack = [(root, -1)]
        while stack:
            node, parent_fastest = stack.pop()
            if node.parent is not None:
                nodes += 1
                size = node.size
                blocks += size
                _expect(size > 0, "node {!r} holds no block", node)
                _expect(
                    len(node.key) == size * kb
                    and len(node.ids) <= size * ds
                    and len(node.ids) % ds == 0,  # the ids of a prefix of its blocks
                    f"node key/ids lengths {len(node.key)}/{len(node.ids)} for {size} blocks",
                )
                most = index.forest.node_blocks  # its blocks' event numbers stay in its range
                _expect(
                    node.ev >= 0 and node.ev % most + size <= most,
                    f"node of {size} blocks from event number {node.ev}: past its range of "
                    f"{most} (node.py)",
                )
                _expect(
                    all(len(f) == size for f in node.slots),
                    "slot field lengths {} for {} blocks",
                    [len(f) for f in node.slots],
                    size,
                )
                steps = node.steps
                if steps is not None and not (
                    [b for b, _ in steps] == sorted({b for b, _ in steps})
                    and all(0 < b < size and e > 0 for b, e in steps)
                ):
                    _expect(False, f"{node!r}: hit steps {steps} for {size} blocks (node.py)")
                prev = parent_fastest
                for i in range(size):  # per block: messages are built only on a failure
                    fastest = node.fastest(i)
                    if fastest >= num_tiers:
                        _expect(False, f"block {i} of {node!r} has no copy anywhere")
                    if fastest < prev:
                        _expect(
                            False,
                            f"prefix closure broken: block {i} of {node!r} is on "
                            f"tier {fastest} below a parent block on tier {prev}",
                        )
                    prev = fastest
                for i in range(node.size):
                    only[node.copies(i)[-1]] += 1
                for tier, fields in enumerate(node.slots):
                    for slot in fields:
                        if slot is not None:
                            resident[tier] += 1
                            ns_resident[tier] += 1
                            if slot in seen_slots[tier]:
                                _expect(False, f"{index.tiers[tier]} slot {slot} holds two blocks")
                            seen_slots[tier].add(slot)
                depth = depth_of(node.slots)
                _expect(
                    node.depth == depth, "{!r}: depth {} != recount {}", node, node.depth, depth
                )
                locks = node.locks or [0] * num_tiers
                want = expected_locks.get(node, [0] * num_tiers)
                _expect(locks == want, "{!r}: locks {} != leases covering it {}", node, locks, want)
                held = expected_held.get(node, 0)
                _expect(node.held == held, "{!r}: held {} != held locks {}", node, node.held, held)
                _expect(node.root is root, "{!r} names another namespace root", node)
                ns_held += size if held else 0
                parent_fastest = prev
            children = node.children or {}
            _expect(node.children is None or len(children) > 0, "{!r}: empty children dict", node)
            res = [sum(1 for c in children.values() if c.depth[t] > 0) for t in range(num_tiers)]
            _expect(node.child_res == res, "{!r}: child_res {} != {}", node, node.child_res, res)
            for first, child in children.items():
                _expect(child.parent is node, "{!r} does not point back to its parent", child)
                _expect(child.key[:kb] == first, "{!r} is filed under another key", child)
                stack.append((child, parent_fastest))
            _check_candidacy(index, node)
        kept = [index.resident_in(namespace, t) for t in range(num_tiers)]
        _expect(
            kept == ns_resident,
            f"namespace {namespace.hex()}: copies per tier {kept} != recount {ns_resident}",
        )
        _expect(
            index.leases.held_blocks(namespace) == ns_held,
            f"namespace {namespace.hex()}: held blocks {index.leases.held_blocks(namespace)} "
            f"!= recount {ns_held}",
        )
    _expect(
        resident == [index.resident(t) for t in range(num_tiers)],
        f"resident blocks per tier {[index.resident(t) for t in range(num_tiers)]} "
        f"!= recount {resident}",
    )
    if index.residency.floors:
        above = [index.residency.above(t) for t in range(num_tiers)]
        recount = [index.residency.above(t, recount=True) for t in range(num_tiers)]
        _expect(above == recount, f"copies above floors {above} != recount {recount}")
        for t in range(num_tiers):
            over, again = index.residency.over(t), index.residency.over(t, recount=True)
            _expect(over == again, f"tier {t}: {len(over)} namespaces over floors, {len(again)}")
    kept_only = [index.residency.only_in(t) for t in range(num_tiers)]
    _expect(kept_only == only, f"blocks by slowest copy {kept_only} != recount {only}")
    _expect(blocks == index.num_blocks, f"num_blocks {index.num_blocks} != recount {blocks}")
    _expect(nodes == index.num_nodes, f"num_nodes {index.num_nodes} != recount {nodes}")
    extra = set(index.namespaces_resident()) - set(index.forest.roots)
    _expect(not extra, f"copies counted for {len(extra)} namespaces that hold no block")
    for tier in range(num_tiers):
        stale = [n for n in index.candidates(tier) if n.parent is None]
        _expect(not stale, f"{len(stale)} detached nodes are still {index.tiers[tier]} candidates")
        lost = index.unqueued(tier)
        _expect(not lost, f"{lost} {index.tiers[tier]} candidates are missing from its LRU queue")


def _check_candidacy(index: RadixIndex, node: Node) -> None:
    if node.parent is None:
        return
    lo = 0
    for tier, hi in enumerate(node.depth):
        want = hi > lo and (hi < node.size or node.child_res[tier] == 0) and not node.locked(tier)
        have = node in index.candidates(tier)
        _expect(
            want == have,
            "{!r}: {} candidate is {}, expected {}",
            node,
            index.tiers[tier],
            have,
            want,
        )
        lo = hi


def _expect(ok: bool, message: str, *args: object) -> None:
    """InvariantError(message) unless `ok`; `args` fill `message`'s fields (`str.format`), only
    on a failure: a check of every node builds no text for the ones that pass."""
    if not ok:
        raise InvariantError(message.format(*args) if args else message)
