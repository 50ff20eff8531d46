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
`host_copy_room` makes room so for a store's write_through host copies (`writes.py`).
Thread: under the cache's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.index import RadixIndex
from kvtier.tiers.base import HOST, Tier

if TYPE_CHECKING:
    from kvtier.transfer.demotion import Demoter

MAX_RUNS_PER_BLOCK = 4
"""Runs looked at per block wanted (at least 16 in all), past which the count stops."""


def clean_victims(
    index: RadixIndex, tier: int, want: int, owner: bytes | None = None, clean: bool = True
) -> int:
    """How many of `tier`'s victims for `owner` (at least; module doc, at most `want`) have a
    copy in `tier + 1`, so that room-making frees their slots without a write below; without
    `clean`, every victim a pass offers (what room-making frees by any means)."""
    residency = index.residency
    offered = residency.evictable_share(tier, owner)
    offered = residency.resident(tier) if offered is None else offered
    dirty = residency.only_in(tier) if clean else 0
    if want <= 0 or offered - dirty < want:  # even every clean copy falls short
        return 0
    found, budget, lower = 0, max(16, MAX_RUNS_PER_BLOCK * want), tier + 1
    for node, lo, hi in index.victim_runs(tier, owner):
        if not clean:
            found += hi - lo
        while clean and hi > lo and node.slots[lower][hi - 1] is not None:
            hi -= 1
            found += 1
        budget -= 1
        if found >= want or budget <= 0:
            break
    return min(found, want)


def has_clean_room(
    index: RadixIndex, pool: Tier, tier: int, need: int, owner: bytes | None = None,
    clean: bool = True,
) -> bool:  # fmt: skip
    """Whether `tier` (its `pool`) has `need` slots free or freeable for `owner` without
    dropping a block that has no copy in `tier + 1` (`clean_victims`; without `clean`, freeable
    at all)."""
    free = pool.num_free
    return free >= need or free + clean_victims(index, tier, need - free, owner, clean) >= need


def host_copy_room(demoter: Demoter, count: int, owner: bytes) -> bool:
    """Room in host for the write_through copies of `count` new gpu blocks, made without
    dropping a host block that has no disk copy (`Demoter.clean_room`): those copies are spares
    of blocks gpu holds, and dropping unwritten KV for them lost 3-7 blocks in random mixes
    (audit AX's F5). Without that room the blocks are gpu-only for now, and leave gpu later as
    any gpu block does (the background mover waits for the disk). Counted first over a victim
    pass (`has_clean_room`; without a disk to spare, or with one written inline, any victim),
    so that a refusal clears, copies or drops nothing for nothing: `can_make_room` counts host
    copies of gpu blocks, which no pass offers, and a copy then dropped host-only blocks and
    made no room (30 of 524 such calls in random mixes, a `/tmp` driver)."""
    if not demoter.can_make_room(HOST, count, owner):
        return False
    state = demoter.state
    writes_back = not demoter.sync_disk and state.disk is not None  # count before any moves
    return has_clean_room(
        demoter.index, state.host, HOST, count, owner, writes_back
    ) and demoter.clean_room(HOST, count, owner)
