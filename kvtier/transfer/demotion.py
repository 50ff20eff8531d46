"""Demotion: the one decision and copy path every demotion uses, and freeing slots now.

`decide(...)` is the pure demotion decision for a victim of a tier (an LRU leaf of it):

    has a copy in a slower tier?          -> CLEAR: forget this copy, free the slot
                                             (SKIP if that would break prefix closure)
    a next tier exists and the block is
      admitted there (enough hits, or
      not a leaf of the whole tree)?      -> COPY: copy it down, then free this slot
    a leaf of the whole tree, unlocked?   -> DROP: drop it from the cache (an eviction)
    otherwise                             -> SKIP: leave it; try the next victim

The next tier is `CacheState.below(tier)`: none below the lowest tier, nor below gpu in a
store without a host tier (`tiers.host: null`), whose gpu victims are dropped. It reads only
the index's view of the block; the caller acts on it. The inline `Demoter` (room a call needs
now), the background mover's watermark demotion and `persist()` all copy through
`plan_copy_down` (destination slots allocated, the `Transfer` built, with the metadata that a
disk copy records) and `record_copies` (the index learns each complete copy; the slot of a
failed one is freed). The copy runs wherever the caller runs transfers: inline, or in a flight
(`flights.py`). DESIGN invariant 1: the index learns of a copy only once complete. A copy that
failed because the next tier's codec cannot keep the block (NaN, or past fp16's range:
`encoded.unkeepable`) can never be made: `drop_unkeepable` drops it with all cached below it
(each an eviction of its fastest tier), unless some is locked or it would take another
namespace than the owner under a floor, so that it does not hold its slot for good.

Freeing slots of a tier now (the synchronous half): `Demoter.make_room(tier, n)` takes victims
from `RadixIndex.victim_runs(tier)` (LRU leaves of the tier, never leased or pinned, as runs of
one node's tail) until the tier's pool has `n` free slots, and acts on each as `decide` says, a
run at a time where the whole run takes one action: a run dropped is one `drop_tail`, a run
copied down one `Transfer` after one `make_room` below for all of it (the index learns the
copies in one `add_copies`), a run cleared one `clear_tail`; anything else (a mixed run, a
copy that cannot get its room below) goes block by block. So freeing k blocks costs O(k) plus
O(log candidates) per run, whatever the size of the cache. A copy to disk takes the victim's
neighbours along: the blocks of the same node that will be evicted next and lack a disk copy
go in the same group commit (up to `DISK_BATCH`), one sync per node, not per block. Making room
in the next tier recurses into `make_room(tier + 1, ...)`, so a full host tier drops (or, with
a disk tier, demotes) its own leaves to take a block from the GPU. The slot of the faster copy
is freed only after the index has forgotten it.

"Can I?" then "do it": `room({tier: n, ...}, owner)` checks every tier the caller needs
(`can_make_room`: free slots plus what no lease, pin, flight or reservation holds and fair
shares let `owner` take) before it moves anything, so that a call refused for room leaves the
cache as it was; only then does it make room, fastest tier first.

The store calls it when an allocation needs room (with an inline mover, the only way a block
leaves a tier); the background mover (`background.py`) makes the same decisions in flights.
With `sync_disk` off (background mode) a copy down to disk is never made here, in the caller's
thread: a leaf that would need one is dropped instead and counted in `backpressure_drops`, so
that `store()` does not wait on the disk here (it may wait before it starts, at most
`mover.store_wait_s`: `Mover.throttle`); before any such drop the tier's clean leaves (a disk
copy already) are freed first: `clean_room`, all the mover's own demotions make (they
can wait for the disk; before, gpu's watermark demotion dropped host blocks an idle disk could
keep). `reserved(tier)`: slots held outside the index (flights', reservations'): left out.

Fair shares: room is made for an `owner` (the namespace of the tenant whose call needs it; None
for the store's own work). Victims come from namespaces above their floor, then from the
owner's own blocks, never from another namespace at or under its floor (`index/eviction.py`);
room made below for a block being demoted is made for the same owner.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.index import BlockRef, Node
from kvtier.index.helpers import by_fastest, locked_by_namespace, subtree_locked, under_floor
from kvtier.index.node import VictimRun, slowest_counts
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import SlotPool
from kvtier.transfer.copy import Transfer
from kvtier.transfer.encoded import unkeepable
from kvtier.transfer.shared import CacheState, Runner, TierCounters


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
    lower = state.below(tier)
    if lower is not None and (node.hits >= admission[lower] or not is_leaf(ref)):
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
        state.namespaces.describe(state.index, refs) if isinstance(pools[lower], DiskTier) else ()
    )
    return CopyDown(tier, lower, dst, Transfer(pools[tier], src, pools[lower], tuple(dst), metas))


def record_copies(
    state: CacheState, copy: CopyDown, refs: Sequence[BlockRef], ok: Sequence[bool]
) -> int:
    """The index learns each complete copy of `copy` whose block has none in `copy.lower` yet
    (`refs`: its blocks now); every other destination slot is freed. Returns how many it
    learned."""
    lower, pool = copy.lower, state.pools[copy.lower]
    node, first = refs[0] if refs else (None, 0)
    if (
        node is not None
        and all(ok)
        and all(ref.node is node and ref.i == first + k for k, ref in enumerate(refs))
        and node.depth[lower - 1] >= first + len(refs)  # each still has a faster copy
        and node.slots[lower][first : first + len(refs)].count(None) == len(refs)
    ):  # one run of a node, all copied: the index learns them in one edit
        state.index.add_copies(node, lower, first, copy.dst)
        return len(refs)
    learned = 0
    for ref, slot, good in zip(refs, copy.dst, ok, strict=True):
        if good and ref.node.slots[lower][ref.i] is None:
            state.index.set_slot(ref, lower, slot)
            learned += 1
        else:
            pool.free([slot])
    return learned


def run_copy(state: CacheState, copy: CopyDown, refs: Sequence[BlockRef], runner: Runner) -> int:
    """Run `copy` inline and `record_copies` its outcome. Should the transfer raise (a bug
    below, a tier closed under it), its destination slots are freed before the error goes
    on: a copy that failed in any way holds no slot (`check()`: slots in use = resident)."""
    try:
        ok = runner.run(copy.transfer)
    except BaseException:
        state.pools[copy.lower].free(list(copy.dst))
        raise
    return record_copies(state, copy, refs, ok)


def drop_unkeepable(
    state: CacheState, ref: BlockRef, tier: int, lower: int, owner: bytes | None = None
) -> int:
    """If `ref` has a `tier` copy and none in `lower`, and `lower`'s codec cannot keep it (module
    doc), drop it and everything cached below it, free their slots and count each as an eviction
    of its fastest tier; the blocks dropped (0: nothing changed: some of it is locked, or it is
    not `owner`'s (None: the mover's own work) and would leave its namespace under a floor)."""
    node, i = ref
    if node.parent is None or i >= node.size or node.slots[lower][i] is not None:
        return 0
    src, slot = state.pools[tier], node.slots[tier][i]
    if slot is None or subtree_locked(ref) or under_floor(state.index.residency, ref, owner):
        return 0
    assert isinstance(src, SlotPool)
    if not unkeepable(src, state.pools[lower], slot):
        return 0
    counts = by_fastest(ref)
    for t, freed in state.index.drop_subtree(ref):
        state.free(t, [freed])
    for t, count in enumerate(counts):
        state.counters[t].evictions += count
    return sum(counts)


def _slot(slot: int | None) -> int:
    assert slot is not None
    return slot


DISK_BATCH = 32


class Demoter:
    def __init__(
        self,
        state: CacheState,
        runner: Runner,
        admission: Sequence[int],
        reserved: Callable[[int], int] = lambda tier: 0,
        sync_disk: bool = True,
    ) -> None:
        """`runner` makes the copies (inline: the call waits for them). `admission[t]`: hits a
        block needs to be copied into tier t at demotion."""
        self.state = state
        self.index = state.index
        self.pools = list(state.pools)
        self.counters: Sequence[TierCounters] = state.counters
        self.runner = runner
        self.admission = list(admission)
        self.reserved = reserved
        self.sync_disk = sync_disk
        self.backpressure_drops = 0  # leaves dropped because a disk copy was not made inline

    def room(self, needs: Mapping[int, int], owner: bytes | None = None) -> bool:
        """Make `needs[t]` slots free in each tier t, for `owner`; False, with nothing moved,
        if any tier cannot (every tier is checked before any moves)."""
        if not all(self.can_make_room(tier, n, owner) for tier, n in needs.items()):
            return False
        return all(self.make_room(tier, n, owner) for tier, n in sorted(needs.items()))

    def make_room(self, tier: int, n: int, owner: bytes | None = None) -> bool:
        """Demote LRU leaves of `tier` (fair shares for `owner`, module doc) until its pool has
        `n` free slots; False if it cannot."""
        pool = self.pools[tier]
        if pool.num_free >= n:
            return True
        if n > pool.num_slots:
            return False
        if self._writes_back(tier) and self.clean_room(tier, n, owner):
            return True  # under backpressure clean leaves first, then LRU drops what it must
        for run in self.index.victim_runs(tier, owner):
            self._demote_run(run, tier, n - pool.num_free, owner)
            if pool.num_free >= n:
                return True
        return pool.num_free >= n

    def clean_room(self, tier: int, n: int, owner: bytes | None = None) -> bool:
        """`make_room` without its backpressure drops: where `tier`'s next tier is a disk this
        path may not write, only its clean leaves go (a disk copy already: nothing lost)."""
        if not self._writes_back(tier):
            return self.make_room(tier, n, owner)
        for ref in self.index.victims(tier, owner):
            if self.pools[tier].num_free >= n:
                return True
            if ref.node.slots[tier + 1][ref.i] is not None:
                self._demote(ref, tier, owner)
        return self.pools[tier].num_free >= n

    def _demote_run(self, run: VictimRun, tier: int, want: int, owner: bytes | None) -> None:
        """Demote the last `want` blocks of `run` (at most), from the end: in one edit or one
        copy where they all take one action, else block by block until one is left."""
        node, hi = run.node, run.hi
        lo = max(run.lo, hi - want)
        action = self._run_action(node, lo, hi, tier)
        if action is Action.DROP:
            for t, slots in enumerate(self.index.drop_tail(node, hi - lo)):
                if slots:
                    self.pools[t].free(slots)
            self.counters[tier].evictions += hi - lo
            return
        tried = False  # a copy of these blocks failed just now: not tried again, block by block
        if action is Action.COPY:
            tried = self._copy_run(node, lo, hi, tier, owner)
        elif action is Action.CLEAR:
            self._clear_run(node, lo, hi, tier)
        while node.parent is not None and node.depth[tier] > lo:
            i = node.depth[tier] - 1
            if tried and drop_unkeepable(self.state, BlockRef(node, i), tier, tier + 1, owner):
                tried = False  # its codec failed it, not the tier below: the rest may go down
                continue
            self._demote(BlockRef(node, i), tier, owner, may_copy=not tried)
            if node.parent is not None and node.depth[tier] == i + 1:
                return  # left: the pass moves on

    def _run_action(self, node: Node, lo: int, hi: int, tier: int) -> Action | None:
        """The action `decide` gives each of blocks hi-1, ..., lo of `node` in turn, the later
        ones gone when its turn comes, if it is one for all (COPY: one that this path may make);
        None when they differ (CLEAR: each has a slower copy; `can_clear` decides in turn)."""
        num_tiers, lower = len(self.pools), self.state.below(tier)
        slower = sum(slowest_counts(node.slots, lo, hi)[tier + 1 :])  # blocks with a slower copy
        if slower:
            return Action.CLEAR if slower == hi - lo else None
        leaf_tail = node.children is None and hi == node.size
        if lower is not None and (node.hits >= self.admission[lower] or not leaf_tail):
            return None if self._refuses(lower) else Action.COPY
        unlocked = not any(node.locked(t) for t in range(num_tiers))
        return Action.DROP if leaf_tail and unlocked else None

    def _copy_run(self, node: Node, lo: int, hi: int, tier: int, owner: bytes | None) -> bool:
        """Copy blocks lo..hi-1 of `node` down in one transfer (a disk copy takes neighbours
        along, as `_copy_down` does) after making room below for all of them, then free their
        `tier` copies from the end; stops where a block has no copy below (no room below, a
        failed copy, or this node changed while room was made). Whether the copy was made
        (whatever its outcome)."""
        lower = tier + 1
        start = lo
        if isinstance(self.pools[lower], DiskTier):
            start = max(node.depth[tier - 1] if tier else 0, min(lo, hi - DISK_BATCH))
        batch = [BlockRef(node, j) for j in range(start, hi) if node.slots[lower][j] is None]
        if not self.make_room(lower, len(batch), owner):
            return False
        if node.parent is None or node.depth[tier] != hi:
            return False
        copy = plan_copy_down(self.state, batch, tier, lower)
        run_copy(self.state, copy, batch, self.runner)
        self._clear_run(node, lo, hi, tier)  # stops at the last block left without a copy below
        return True

    def _clear_run(self, node: Node, lo: int, hi: int, tier: int) -> None:
        """Forget the `tier` copies of blocks hi-1, ..., lo of `node`, the tail of its run in
        `tier`, from the end while each has a slower copy and closure allows, in one edit, and
        free their slots in one call."""
        freed = self.index.clear_tail(node, tier, hi - lo)
        if freed:
            self.pools[tier].free(freed)
            self.counters[tier].demotions += len(freed)

    def _refuses(self, lower: int) -> bool:
        """Whether a copy into `lower` is a disk write this synchronous path may not make."""
        return not self.sync_disk and isinstance(self.pools[lower], DiskTier)

    def _writes_back(self, tier: int) -> bool:
        """Whether `tier`'s next tier is a disk that this synchronous path may not write."""
        lower = self.state.below(tier)
        return not self.sync_disk and lower is not None and isinstance(self.pools[lower], DiskTier)

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
        locked = locked_by_namespace(self.index.leases, tier)  # the share counts them too
        free = self.pools[tier].num_used - sum(locked.values()) - self.reserved(tier)
        share = self.index.residency.evictable_share(tier, owner, locked)
        return free if share is None else min(free, share)

    def _demote(self, ref: BlockRef, tier: int, owner: bytes | None, may_copy: bool = True) -> None:
        """Act on one victim as `decide` says; without `may_copy` (its copy down failed just
        now), a block to copy is dropped where it may be, else left; one whose copy down its
        codec refuses is dropped with what is below it (`drop_unkeepable`)."""
        action = decide(self.state, ref, tier, self.admission)
        if action is Action.CLEAR:
            self.pools[tier].free([self.index.clear_slot(ref, tier)])
            self.counters[tier].demotions += 1
            return
        refused = False  # admitted below, but the copy is a disk write we may not make here
        if action is Action.COPY:
            refused = self._refuses(tier + 1)
            copied = (
                self._copy_down(ref, tier, tier + 1, owner) if may_copy and not refused else None
            )
            if copied:
                self.pools[tier].free([self.index.clear_slot(ref, tier)])
                self.counters[tier].demotions += 1
                return
            if copied is False and drop_unkeepable(self.state, ref, tier, tier + 1, owner):
                return  # its copy ran and failed: its codec may refuse it
        elif action is Action.SKIP:
            return
        # making room below may have dropped later blocks of this node: ask again
        if droppable(ref, len(self.pools)):
            for t, slot in self.index.drop(ref):
                self.pools[t].free([slot])
            self.counters[tier].evictions += 1
            self.backpressure_drops += refused

    def _copy_down(self, ref: BlockRef, tier: int, lower: int, owner: bytes | None) -> bool | None:
        """Give the victim (and, for disk, its next-to-go neighbours) a copy in `lower`;
        whether the victim has one now, None where no copy ran (no room below, node changed)."""
        node, i = ref
        batch = [ref]
        if isinstance(self.pools[lower], DiskTier):
            first = node.depth[tier - 1] if tier else 0  # where this node's tier-run starts
            start = max(first, i - DISK_BATCH + 1)
            batch = [BlockRef(node, j) for j in range(start, i + 1) if node.slots[lower][j] is None]
        if not self.make_room(lower, len(batch), owner):
            batch = [ref]
            if not self.make_room(lower, 1, owner):
                return None
        if node.slots[tier][i] is None:  # making room below changed this node: give up on it
            return None
        copy = plan_copy_down(self.state, batch, tier, lower)
        run_copy(self.state, copy, batch, self.runner)
        return node.slots[lower][i] is not None
