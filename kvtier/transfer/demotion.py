"""Demotion: freeing slots of a tier by moving its least-recently-used leaves down.

`Demoter.make_room(tier, n)` takes victims from `RadixIndex.victims(tier)` (LRU leaves of the
tier, never leased or pinned) until the tier's pool has `n` free slots. For each victim:

    has a copy in a slower tier?        -> forget this tier's copy, free the slot
    lowest tier?                        -> drop the block from the cache
    admitted below (enough hits, or not
      a leaf) and the next tier has (or
      can make) a free slot?            -> copy it down, record the copy, then free this slot
    a leaf of the whole tree?           -> drop it (counted as an eviction)
    otherwise                           -> leave it; try the next victim

Admission: a block enters tier t at demotion only with `admission[t]` hits (the `selective`
write policy for host, `disk_admission_hits` for disk), unless it cannot be dropped because
blocks below it are cached. A copy to disk takes the victim's neighbours along: the blocks of
the same node that will be evicted next and lack a disk copy go in the same group commit
(up to `DISK_BATCH`), so a node's demotion costs one sync, not one per block.

Making room in the next tier recurses into `make_room(tier + 1, 1)`, so a full host tier
drops (or, with a disk tier, demotes) its own leaves to take a block from the GPU. The copy is
complete before the index learns of it (DESIGN invariant 1); the slot of the faster copy is
freed only after the index has forgotten it.

This is the synchronous part of the mover: the store calls it when an allocation needs room
(and, without a background mover, when a tier passes its high watermark). The background mover
(`mover.py`) makes the same decisions in flights. With `sync_disk` off (background mode) a copy
down to disk is never made here, in the caller's thread: a leaf that would need one is dropped
instead and counted in `backpressure_drops`, so that `store()` never waits on the disk; and
before any such drop, the tier's clean leaves (those with a disk copy already) are freed first.
`reserved(tier)` is the number of slots of a tier that flights own (allocated, not yet in the
index, never evictable); room-making leaves them out.

Fair shares: room is made for an `owner` (the namespace of the tenant whose call needs it; None
for the store's own work). Victims come from namespaces above their floor, then from the
owner's own blocks, never from another namespace at or under its floor (`index/eviction.py`);
room made below for a block being demoted is made for the same owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.index import BlockRef, RadixIndex
from kvtier.namespaces import Namespaces
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.transfer.copy import Transfer
from kvtier.transfer.handles import Runner

DISK_BATCH = 32


@dataclass
class TierCounters:
    """Events per tier since start. Capacity and residency are read from live objects instead."""

    hits: int = 0  # blocks found by lookups whose fastest copy was here
    promotions: int = 0  # blocks copied up into this tier
    demotions: int = 0  # blocks whose copy here was freed after a copy below existed
    evictions: int = 0  # blocks dropped from the cache while their fastest copy was here


class Demoter:
    def __init__(
        self,
        index: RadixIndex,
        pools: Sequence[Tier],
        executor: Runner,
        admission: Sequence[int],
        counters: Sequence[TierCounters],
        namespaces: Namespaces,
        reserved: Callable[[int], int] = lambda tier: 0,
        sync_disk: bool = True,
    ) -> None:
        """`admission[t]`: hits a block needs to be copied into tier t at demotion.
        `namespaces`: whose blocks they are, for what a disk copy records (`describe`)."""
        self.index = index
        self.pools = list(pools)
        self.executor = executor
        self.admission = list(admission)
        self.counters = list(counters)
        self.namespaces = namespaces
        self.reserved = reserved
        self.sync_disk = sync_disk
        self.backpressure_drops = 0  # leaves dropped because a disk copy was not made inline

    def describe(self, ref: BlockRef) -> BlockMeta:
        """What a disk copy of block `ref` records about it (demotion, the mover, persist)."""
        return self.namespaces.describe(self.index, ref)

    def make_room(self, tier: int, n: int, owner: bytes | None = None) -> bool:
        """Demote LRU leaves of `tier` (fair shares for `owner`, module doc) until its pool has
        `n` free slots; False if it cannot."""
        pool = self.pools[tier]
        if pool.num_free >= n:
            return True
        if n > pool.num_slots:
            return False
        if self._writes_back(tier):
            # under backpressure, clean leaves first (their disk copy exists: freeing them
            # loses nothing), then the LRU order drops what it must
            for ref in self.index.victims(tier, owner):
                if ref.node.slots[tier + 1][ref.i] is not None:
                    self._demote(ref, tier, owner)
                    if pool.num_free >= n:
                        return True
        for ref in self.index.victims(tier, owner):
            self._demote(ref, tier, owner)
            if pool.num_free >= n:
                return True
        return pool.num_free >= n

    def _writes_back(self, tier: int) -> bool:
        """Whether `tier`'s next tier is a disk that this synchronous path may not write."""
        lower = tier + 1
        return (
            not self.sync_disk
            and lower < len(self.pools)
            and isinstance(self.pools[lower], DiskTier)
        )

    def can_make_room(self, tier: int, n: int, owner: bytes | None = None) -> bool:
        """Whether `make_room(tier, n, owner)` can succeed at all: the free slots plus the
        copies in `tier` that no lease or pin holds (and that fair shares let `owner` take)
        reach `n`. Checked before anything moves, so that a request that cannot fit demotes
        (or drops) nothing."""
        pool = self.pools[tier]
        if pool.num_free >= n:
            return True
        return n <= pool.num_free + self.evictable(tier, owner)

    def evictable(self, tier: int, owner: bytes | None = None) -> int:
        """Copies in `tier` that no lease or pin holds and no flight owns, and, with fair
        shares, at most those that `owner` may take (above floors, or its own)."""
        pool = self.pools[tier]
        free = pool.num_used - self.index.leases.locked_blocks(tier) - self.reserved(tier)
        share = self.index.evictable_share(tier, owner)
        return free if share is None else min(free, share)

    def demote_to(self, tier: int, target_used: int) -> None:
        """Demote LRU leaves of `tier` until at most `target_used` slots are in use (the
        store's own work: only what fair shares leave above floors)."""
        pool = self.pools[tier]
        self.make_room(tier, pool.num_slots - max(target_used, 0))

    def _demote(self, ref: BlockRef, tier: int, owner: bytes | None) -> None:
        index = self.index
        node, i = ref
        slower = [t for t in range(tier + 1, len(self.pools)) if node.slots[t][i] is not None]
        if slower and index.can_clear(ref, tier):
            self.pools[tier].free([index.clear_slot(ref, tier)])
            self.counters[tier].demotions += 1
            return
        lower = tier + 1
        refused = False  # admitted below, but the copy is a disk write we may not make here
        if lower < len(self.pools):
            keep = node.hits >= self.admission[lower] or not is_leaf(ref)
            refused = keep and not self.sync_disk and isinstance(self.pools[lower], DiskTier)
            if keep and not refused and self._copy_down(ref, tier, lower, owner):
                self.pools[tier].free([index.clear_slot(ref, tier)])
                self.counters[tier].demotions += 1
                return
        # making room below may have dropped later blocks of this node: ask again
        if is_leaf(ref) and not any(node.locked(t) for t in range(len(self.pools))):
            for t, slot in index.drop(ref):
                self.pools[t].free([slot])
            self.counters[tier].evictions += 1
            self.backpressure_drops += refused

    def _copy_down(self, ref: BlockRef, tier: int, lower: int, owner: bytes | None) -> bool:
        """Give the victim (and, for disk, its next-to-go neighbours) a copy in `lower`;
        whether the victim has one now."""
        node, i = ref
        batch = [ref]
        if isinstance(self.pools[lower], DiskTier):
            first = node.depth[tier - 1] if tier else 0  # where this node's tier-run starts
            start = max(first, i - DISK_BATCH + 1)
            batch = [BlockRef(node, j) for j in range(start, i + 1) if node.slots[lower][j] is None]
        if not self.make_room(lower, len(batch), owner):
            batch = [ref]
            if not self.make_room(lower, 1, owner):
                return False
        if node.slots[tier][i] is None:  # making room below changed this node: give up on it
            return False
        dst = self.pools[lower].allocate(len(batch))
        src = tuple(self._slot(b.node.slots[tier][b.i]) for b in batch)
        metas = (
            tuple(self.describe(b) for b in batch)
            if isinstance(self.pools[lower], DiskTier)
            else ()
        )
        done = self.executor.run(
            Transfer(self.pools[tier], src, self.pools[lower], tuple(dst), metas)
        )
        for block, slot, ok in zip(batch, dst, done, strict=True):
            if ok:
                self.index.set_slot(block, lower, slot)
            else:
                self.pools[lower].free([slot])
        return node.slots[lower][i] is not None

    @staticmethod
    def _slot(slot: int | None) -> int:
        assert slot is not None
        return slot


def is_leaf(ref: BlockRef) -> bool:
    """The last block of a node without children: nothing in the cache depends on it."""
    return ref.node.children is None and ref.i == ref.node.size - 1
