"""Rebuilding one namespace of the index from self-describing block copies (disk recovery).

Each entry is one recovered copy: its block id, its parent's id (the namespace seed for a first
block), its tokens and its slot per tier. `restore_namespace` hangs them from the namespace
seed in O(n), building compressed nodes directly (one node per maximal chain of single
children), instead of replaying inserts, which would cost O(depth) per block.

What it refuses, and counts:
- orphans: entries whose chain of parents does not reach the seed (DESIGN invariant 2);
- forged or mismatched ids: an entry whose id is not H(parent id || tokens), or whose tokens
  are not one block long; it and everything below it are refused, since the index names
  blocks by their tokens and a wrong id would break the chain for every descendant. An entry
  whose id is the namespace seed itself is refused before the walk: its children would be the
  seed's, so the walk from the seed would run in a cycle (and grow a chain without end).

Preconditions: the namespace holds no block yet; ids are unique (the caller keeps the newest
copy of a duplicated id). Entries below a refused one are counted as orphans.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.blocks import BlockId
from kvtier.index.forest import Forest
from kvtier.index.node import Node, Slot, depth_of, slowest_counts

if TYPE_CHECKING:
    from kvtier.index.radix import RadixIndex


@dataclass(frozen=True, slots=True)
class RestoreEntry:
    block_id: bytes
    parent_id: bytes
    tokens: bytes
    slots: dict[int, int]  # tier -> slot


@dataclass(frozen=True)
class RestoreReport:
    restored: list[RestoreEntry]
    orphans: list[RestoreEntry]
    bad_ids: list[RestoreEntry]


def restore_namespace(
    index: RadixIndex, namespace: BlockId, entries: Iterable[RestoreEntry]
) -> RestoreReport:
    """Hang `entries` below the root of `namespace`; report what was restored and refused."""
    root = index.root(namespace)
    assert root.children is None, "restore into a namespace that already holds blocks"
    kb, ds = index.key_nbytes, index.digest_size
    num_tiers = len(index.tiers)
    by_parent: dict[bytes, list[RestoreEntry]] = defaultdict(list)
    everything = list(entries)
    seed = bytes(namespace)
    bad: list[RestoreEntry] = [entry for entry in everything if entry.block_id == seed]
    for entry in everything:
        if entry.block_id != seed:  # unique ids, none the seed: the walk visits each once
            by_parent[entry.parent_id].append(entry)
    restored: list[RestoreEntry] = []
    created: list[Node] = []
    stack: list[tuple[Node, bytes]] = [(root, seed)]
    while stack:
        parent, parent_id = stack.pop()
        for first in by_parent.get(parent_id, ()):
            chain = [first]
            while len(by_parent.get(chain[-1].block_id, ())) == 1:
                chain.append(by_parent[chain[-1].block_id][0])
            good = _verified_prefix(index, parent_id, chain)
            bad.extend(chain[good : good + 1])
            chain = chain[:good]
            if not chain or (parent.children is not None and chain[0].tokens in parent.children):
                continue
            node, most = parent, index.forest.node_blocks  # a node holds at most `most` blocks
            tiers = range(num_tiers)
            for at in range(0, len(chain), most):
                part = chain[at : at + most]
                key = b"".join(e.tokens for e in part)
                ids = b"".join(e.block_id for e in part)
                fields: list[list[Slot]] = [[e.slots.get(t) for e in part] for t in tiers]
                above, node = node, Node(node, key, ids, fields, depth_of(fields), 0)
                if above.children is None:
                    above.children = {}
                above.children[key[:kb]] = node
                created.append(node)
            restored.extend(chain)
            if len(chain) == good:  # the whole chain verified: its last block may branch
                stack.append((node, ids[-ds:]))
    adopt(index.forest, root, created)
    seen = {id(e) for e in restored} | {id(e) for e in bad}
    orphans = [e for e in everything if id(e) not in seen]
    return RestoreReport(restored, orphans, bad)


def adopt(forest: Forest, root: Node, nodes: list[Node]) -> None:
    """Have `forest` take in `nodes`, built and hung below `root` here (each in its parent's
    `children`, its slots and `depth` set): register the namespace, count the nodes, blocks
    and copies, and set the parents' `child_res` and every candidacy (`forest.py`'s
    invariants)."""
    if not nodes:
        return
    forest.roots.setdefault(root.ids, root)
    for node in nodes:
        parent = node.parent
        assert parent is not None
        for tier, depth in enumerate(node.depth):
            if depth:
                parent.child_res[tier] += 1
    namespace, residency = root.ids, forest.residency
    for node in nodes:
        forest.candidates.refresh(node)
        forest.num_blocks += node.size
        for tier, fields in enumerate(node.slots):
            copies = len(fields) - fields.count(None)
            if copies:
                residency.add(namespace, tier, copies)
        residency.slowest_counted(slowest_counts(node.slots, 0, node.size), +1)
    forest.num_nodes += len(nodes)


def _verified_prefix(index: RadixIndex, parent_id: bytes, chain: list[RestoreEntry]) -> int:
    """How many leading entries of `chain` have one block of tokens and the id H gives them."""
    kb, ds = index.key_nbytes, index.digest_size
    count = 0
    for entry in chain:
        if len(entry.tokens) != kb or len(entry.block_id) != ds:
            break
        count += 1
    tokens = b"".join(e.tokens for e in chain[:count])
    ids = index.hasher.chain(parent_id, tokens, kb)
    for i in range(count):
        if ids[i * ds : (i + 1) * ds] != chain[i].block_id:
            return i
    return count
