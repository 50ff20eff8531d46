"""Small named results passed between the index and the store."""

from __future__ import annotations

from typing import NamedTuple, NewType

from kvtier.index.node import Node

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


class InsertResult(NamedTuple):
    """`new_blocks` blocks were added after the match, with ids `new_ids` (concatenated)."""

    new_blocks: int
    new_ids: bytes
    end: Node
