"""Demotion: freeing slots of a tier by moving its least-recently-used leaves down.

`Demoter.make_room(tier, n)` takes victims from `RadixIndex.victims(tier)` (LRU leaves of the
tier, never leased or pinned) until the tier's pool has `n` free slots. For each victim:

    has a copy in a slower tier?        -> forget this tier's copy, free the slot
    lowest tier?                        -> drop the block from the cache
    policy keeps it and the next tier
      has (or can make) a free slot?    -> copy it down, record the copy, then free this slot
    a leaf of the whole tree?           -> drop it (counted as an eviction)
    otherwise                           -> leave it; try the next victim

Making room in the next tier recurses into `make_room(tier + 1, 1)`, so a full host tier
drops (or, with a disk tier, demotes) its own leaves to take a block from the GPU. The copy is
complete before the index learns of it (DESIGN invariant 1); the slot of the faster copy is
freed only after the index has forgotten it.

This is the synchronous part of the mover: the store calls it when an allocation needs room
and when a tier passes its high watermark. The async mover (issue 4) runs the same decisions in
the background, with its executors in place of `InlineExecutor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.index import BlockRef, RadixIndex
from kvtier.policy import WritePolicy
from kvtier.tiers import SlotPool
from kvtier.transfer.copy import InlineExecutor, Transfer


@dataclass
class TierCounters:
    """Events per tier since start. Capacity and residency are read from live objects instead."""

    hits: int = 0  # blocks found by lookups whose fastest copy was here
    promotions: int = 0  # blocks copied up into this tier
    demotions: int = 0  # blocks whose copy here was freed after a copy below existed
    evictions: int = 0  # blocks dropped from the cache while their fastest copy was here
    extra: dict[str, int] = field(default_factory=dict)


class Demoter:
    def __init__(
        self,
        index: RadixIndex,
        pools: Sequence[SlotPool],
        executor: InlineExecutor,
        policy: WritePolicy,
        counters: Sequence[TierCounters],
    ) -> None:
        self.index = index
        self.pools = list(pools)
        self.executor = executor
        self.policy = policy
        self.counters = list(counters)

    def make_room(self, tier: int, n: int) -> bool:
        """Demote LRU leaves of `tier` until its pool has `n` free slots; False if it cannot."""
        pool = self.pools[tier]
        if pool.num_free >= n:
            return True
        if n > pool.num_slots:
            return False
        for ref in self.index.victims(tier):
            self._demote(ref, tier)
            if pool.num_free >= n:
                return True
        return pool.num_free >= n

    def can_make_room(self, tier: int, n: int) -> bool:
        """Whether `make_room(tier, n)` can succeed at all: the free slots plus the copies in
        `tier` that no lease or pin holds reach `n`. Checked before anything moves, so that a
        request that cannot fit demotes (or drops) nothing."""
        pool = self.pools[tier]
        if pool.num_free >= n:
            return True
        return n <= pool.num_free + pool.num_used - self.index.leases.locked_blocks(tier)

    def demote_to(self, tier: int, target_used: int) -> None:
        """Demote LRU leaves of `tier` until at most `target_used` slots are in use."""
        pool = self.pools[tier]
        self.make_room(tier, pool.num_slots - max(target_used, 0))

    def _demote(self, ref: BlockRef, tier: int) -> None:
        index = self.index
        node, i = ref
        slower = [t for t in range(tier + 1, len(self.pools)) if node.slots[t][i] is not None]
        if slower and index.can_clear(ref, tier):
            self.pools[tier].free([index.clear_slot(ref, tier)])
            self.counters[tier].demotions += 1
            return
        lower = tier + 1
        keep = self.policy.keep_on_demote(node.hits) or not _is_leaf(ref)
        if lower < len(self.pools) and keep and self.make_room(lower, 1):
            self._copy_down(ref, tier, lower)
            return
        # making room below may have dropped later blocks of this node: ask again
        if _is_leaf(ref) and not any(node.locked(t) for t in range(len(self.pools))):
            for t, slot in index.drop(ref):
                self.pools[t].free([slot])
            self.counters[tier].evictions += 1

    def _copy_down(self, ref: BlockRef, tier: int, lower: int) -> None:
        (dst_slot,) = self.pools[lower].allocate(1)
        src_slot = ref.node.slots[tier][ref.i]
        assert src_slot is not None
        self.executor.run(Transfer(self.pools[tier], (src_slot,), self.pools[lower], (dst_slot,)))
        self.index.set_slot(ref, lower, dst_slot)
        self.pools[tier].free([self.index.clear_slot(ref, tier)])
        self.counters[tier].demotions += 1


def _is_leaf(ref: BlockRef) -> bool:
    """The last block of a node without children: nothing in the cache depends on it."""
    return ref.node.children is None and ref.i == ref.node.size - 1
