"""The write path's route below a disk-only prefix (`Writes.store_new`, `make_room_ahead`):
new blocks there are staged and written to disk in an insert flight (`transfer/background.py`).

- `insert_on_disk`: the insert, keeping what a failed room-making freed (`Writes.place`'s rule).
- `stage_ahead`: the host staging room, written down ahead of the call (`Mover.throttle`).
Thread: under the cache's lock.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvtier.blocks import BlockId
from kvtier.index import Match
from kvtier.tiers.base import DISK, HOST

if TYPE_CHECKING:
    from kvtier.writes import Writes


def insert_on_disk(
    writes: Writes, match: Match, key: bytes, blocks: torch.Tensor, namespace: BlockId, tenant: str
) -> tuple[int, int]:
    """`Mover.insert_on_disk`; where its room-making ran and fell short (its check counts
    copies the pass then leaves, another tenant's at its floor: a store dropped 3 disk blocks
    of another tenant and stored none, audit BN), the first blocks again, as many as the slots
    it freed take (`place`'s rule: what moved is used)."""
    state, insert = writes.state, writes.mover.insert_on_disk
    pools = (state.host, state.pools[DISK]) if writes.mover.background else (state.pools[DISK],)
    before = min(pool.num_free for pool in pools)
    taken, landed = insert(match, key, blocks, namespace, tenant)
    room = min(pool.num_free for pool in pools)
    if taken or not before < room < len(blocks):
        return taken, landed
    return insert(match, key, blocks[:room], namespace, tenant)


def stage_ahead(writes: Writes, match: Match, count: int, namespace: BlockId) -> int:
    """`Writes.make_room_ahead` for `count` new blocks below the disk-only prefix `match`: the
    host slots `insert_on_disk` stages them in, whose room it makes by dropping unwritten host
    leaves, written down ahead (before, a 2-block tail dropped 2 blocks with an idle disk), only
    when the insert will take place (room for them in host and disk); the prefix pinned on disk
    meanwhile, as the insert pins it. Returns as `make_room_ahead`."""
    owner, work, leases = bytes(namespace), writes.mover.work, writes.index.leases
    if not all(writes.demoter.can_make_room(t, count, owner) for t in (HOST, DISK)):
        return 0
    need = min(count, writes.state.host.num_slots)
    pin = leases.acquire(match.end, (DISK,), math.inf, 0, resident=False)
    try:
        work.make_room_ahead(need, owner)
    finally:
        leases.release(pin.lease_id)
    return 0 if work.has_room(need, owner) else need
