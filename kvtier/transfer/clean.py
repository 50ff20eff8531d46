"""Clean room: how many of a tier's copies room-making would free without a write below.

`Demoter.clean_room` frees a tier's victims that have a copy in the next tier already (clean:
nothing is lost), before a call that needs room now drops unwritten leaves. Whether a store
will drop such leaves therefore depends on the clean copies among the victims, not on every
copy with a slower one: a clean block that hangs above a dirty one in the same tier (an inner
block of a prefix) or that a lease or pin holds is no victim, and counting it once let a store
go ahead without waiting for the disk and drop unwritten blocks it could have kept (gpu 8,
host 32, write_through, an idle disk: 2 blocks of a 5-block store, `tests/test_mover_audit_AX.py`).

`clean_victims` counts them over one pass of `RadixIndex.victim_runs(tier, owner)` (the same
victims, for the same owner, fair shares included): per run, the blocks from its end that
have a copy in the next tier, which `clean_room` clears in that order. First, in O(1), an
upper bound: the copies offered less those with no slower copy (`Residency`); when even that
falls short, nothing is walked. The count is a lower bound: blocks that become victims only
once those are cleared (a parent whose last child left) are not counted, and a run cut short
(`eviction.victim_runs`) leaves the rest of its node uncounted; so a caller may wait for a
write-down it did not need (bounded by `mover.store_wait_s`), never go ahead on room that is
not there. It stops at `want` and after `MAX_RUNS_PER_BLOCK` runs a block wanted, so that it
costs O(want) runs, not a walk of every candidate under the lock.
Thread: under the cache's lock.
"""

from __future__ import annotations

from kvtier.index import RadixIndex
from kvtier.tiers.base import Tier

MAX_RUNS_PER_BLOCK = 4
"""Runs looked at per block wanted (at least 16 in all), past which the count stops."""


def clean_victims(index: RadixIndex, tier: int, want: int, owner: bytes | None = None) -> int:
    """How many of `tier`'s victims for `owner` (at least; module doc, at most `want`) have a
    copy in `tier + 1`, so that room-making frees their slots without a write below."""
    residency = index.residency
    offered = residency.evictable_share(tier, owner)
    offered = residency.resident(tier) if offered is None else offered
    if want <= 0 or offered - residency.only_in(tier) < want:  # even every clean copy falls short
        return 0
    found, budget, lower = 0, max(16, MAX_RUNS_PER_BLOCK * want), tier + 1
    for node, lo, hi in index.victim_runs(tier, owner):
        slots = node.slots[lower]
        while hi > lo and slots[hi - 1] is not None:
            hi -= 1
            found += 1
        budget -= 1
        if found >= want or budget <= 0:
            break
    return min(found, want)


def has_clean_room(
    index: RadixIndex, pool: Tier, tier: int, need: int, owner: bytes | None = None
) -> bool:
    """Whether `tier` (its `pool`) has `need` slots free or freeable for `owner` without
    dropping a block that has no copy in `tier + 1` (`clean_victims`)."""
    free = pool.num_free
    return free >= need or free + clean_victims(index, tier, need - free, owner) >= need
