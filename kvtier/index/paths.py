"""Reading along a path: the nodes and blocks from a namespace root down to one node.

A path is named by its last node `end` (a `Match.end`, a lease's end). Blocks on it are
addressed by `BlockRef(node, i)` or by position, counted from the namespace root:

    root - A[0 1 2] - B[3 4] - C[5 6 7]        path(C) == [A, B, C]
                                               refs_at(C, [1, 3]) == [(A, 1), (B, 0)]

Positions survive splits (a split changes nodes, never the path's blocks), which is why a
caller that lets go of the index between two steps keeps positions rather than refs.
Read-only, no index state: each function follows `parent` links, O(nodes on the path).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvtier.hashing import BlockId
from kvtier.index.node import Node
from kvtier.index.results import BlockRef


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
    while node.parent is not None:
        node = node.parent
    return BlockId(node.ids)
