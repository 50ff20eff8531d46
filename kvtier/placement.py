"""The slots `Writes.place` takes (`writes.py`): `take`, a tier's free slots for the first
blocks and their write_through host copies; `fewer`, where no tier can make room for all the
blocks of a call. Thread: under the cache's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.blocks import BlockId
from kvtier.index import Match
from kvtier.tiers.base import DISK, GPU, HOST
from kvtier.tiers.quantized import QuantPool
from kvtier.transfer.clean import host_copy_room

if TYPE_CHECKING:
    from kvtier.writes import Writes

Slots = dict[int, list[int]]
"""Slot numbers per tier (gpu, host) of a call's new blocks, the first ones first."""


def fewer(writes: Writes, match: Match, count: int, reserver: str | None) -> Slots | None:
    """No tier can make room for all `count` blocks: the first ones, as many as the tier
    with the most room (free slots and copies room-making may take, within a reserver's
    quota; the fastest of equals) takes, the rest dropped. Before, all were dropped where
    host had room for 3 of 4 (a prefix cache keeps the head of a prompt)."""
    owner, best, most = match.end.root.ids, -1, 0
    for tier in range(match.end.fastest_last(), min(len(writes.state.pools), DISK)):
        pool = writes.state.pools[tier]
        if reserver is not None and isinstance(pool, QuantPool):
            continue  # (`_tiers`)
        room = min(count - 1, pool.num_free + writes.demoter.evictable(tier, owner))
        if reserver is not None:
            holding = writes.holding(reserver, BlockId(owner), tier)
            room = min(room, writes.shares.headroom(reserver, tier, holding))
        if room > most:
            best, most = tier, room
    if best < 0:
        return None
    writes.demoter.make_room(best, most, owner)  # (short of it: the slots it freed)
    taken = min(most, writes.state.pools[best].num_free)
    return take(writes, best, taken, owner, reserver) if taken else None


def take(writes: Writes, tier: int, count: int, owner: bytes, reserver: str | None) -> Slots:
    """`Writes.place`'s slots: `count` free ones of `tier`, and their write_through host
    copies' where those fit (the reserver's quota, `host_copy_room`)."""
    state, shares = writes.state, writes.shares
    slots = {tier: state.pools[tier].allocate(count)}
    copy = tier == GPU and writes.policy.copy_on_store
    if copy and reserver is not None:
        copy = shares.fits(reserver, HOST, writes.holding(reserver, BlockId(owner), HOST), count)
    if copy and host_copy_room(writes.demoter, count, owner):
        slots[HOST] = state.pools[HOST].allocate(count)
    return slots
