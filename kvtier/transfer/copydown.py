"""Moving a block down: the one decision and the one copy path that every demotion uses.

`decide(...)` is the pure demotion decision for a victim of a tier (an LRU leaf of it):

    has a copy in a slower tier?          -> CLEAR: forget this copy, free the slot
                                             (SKIP if that would break prefix closure)
    a next tier exists and the block is
      admitted there (enough hits, or
      not a leaf of the whole tree)?      -> COPY: copy it down, then free this slot
    a leaf of the whole tree, unlocked?   -> DROP: drop it from the cache (an eviction)
    otherwise                             -> SKIP: leave it; try the next victim

It reads only the index's view of the block; the caller acts on it. The inline `Demoter`
(room a call needs now), the background mover's watermark demotion and `persist()` all copy
through `plan_copy_down` (destination slots allocated, the `Transfer` built, with the metadata
that a disk copy records) and `record_copies` (the index learns each complete copy; the slot of
a failed one is freed). The copy itself runs wherever the caller runs transfers: inline, or in
a flight (`flights.py`). DESIGN invariant 1: the index learns of a copy only once complete.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.index import BlockRef
from kvtier.tiers.disk import DiskTier
from kvtier.transfer.copy import Transfer
from kvtier.transfer.state import CacheState


class Action(enum.Enum):
    CLEAR = "clear"
    COPY = "copy"
    DROP = "drop"
    SKIP = "skip"


def decide(state: CacheState, ref: BlockRef, tier: int, admission: Sequence[int]) -> Action:
    """What demoting the `tier` copy of victim `ref` takes (module doc). `admission[t]`: the
    hits a block needs to be copied into tier t."""
    node, i = ref
    num_tiers = len(state.pools)
    if any(node.slots[t][i] is not None for t in range(tier + 1, num_tiers)):
        return Action.CLEAR if state.index.can_clear(ref, tier) else Action.SKIP
    lower = tier + 1
    if lower < num_tiers and (node.hits >= admission[lower] or not is_leaf(ref)):
        return Action.COPY
    return Action.DROP if droppable(ref, num_tiers) else Action.SKIP


def is_leaf(ref: BlockRef) -> bool:
    """The last block of a node without children: nothing in the cache depends on it."""
    return ref.node.children is None and ref.i == ref.node.size - 1


def droppable(ref: BlockRef, num_tiers: int) -> bool:
    """A leaf of the whole tree that no lease or pin holds in any tier."""
    return is_leaf(ref) and not any(ref.node.locked(t) for t in range(num_tiers))


@dataclass(frozen=True)
class CopyDown:
    """Copies of blocks from `tier` to `lower`: its destination slots (allocated, not in the
    index) and the transfer that fills them."""

    tier: int
    lower: int
    dst: list[int]
    transfer: Transfer


def plan_copy_down(state: CacheState, refs: Sequence[BlockRef], tier: int, lower: int) -> CopyDown:
    """Allocate `len(refs)` slots of `lower` (the caller made room) and build the copy of the
    `tier` copies of `refs` into them; a disk copy carries each block's metadata."""
    pools = state.pools
    dst = pools[lower].allocate(len(refs))
    src = tuple(_slot(ref.node.slots[tier][ref.i]) for ref in refs)
    metas = (
        tuple(state.namespaces.describe(state.index, ref) for ref in refs)
        if isinstance(pools[lower], DiskTier)
        else ()
    )
    return CopyDown(tier, lower, dst, Transfer(pools[tier], src, pools[lower], tuple(dst), metas))


def record_copies(
    state: CacheState, copy: CopyDown, refs: Sequence[BlockRef], ok: Sequence[bool]
) -> int:
    """The index learns each complete copy of `copy` whose block has none in `copy.lower` yet
    (`refs`: its blocks now); every other destination slot is freed. Returns how many it
    learned."""
    lower, pool = copy.lower, state.pools[copy.lower]
    learned = 0
    for ref, slot, good in zip(refs, copy.dst, ok, strict=True):
        if good and ref.node.slots[lower][ref.i] is None:
            state.index.set_slot(ref, lower, slot)
            learned += 1
        else:
            pool.free([slot])
    return learned


def _slot(slot: int | None) -> int:
    assert slot is not None
    return slot
