"""Persisting: giving every cached block a durable disk copy now (a checkpoint).

`persist(...)` walks the index root-first and copies each block that has no disk copy yet to
disk, in group commits of up to `BATCH` blocks per source tier. Root-first means a block's
parent is durable no later than the block itself, so a crash in the middle leaves at worst a
few orphans, which recovery discards and counts. Admission rules do not apply: persisting is
an explicit request (an engine's checkpoint, a graceful shutdown, a test's acknowledgement).
When the disk tier is full, its own least-recently-used leaves make room; what still does not
fit is left in memory and not counted as persisted.
"""

from __future__ import annotations

from kvtier.index import BlockRef, RadixIndex
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.transfer.copy import InlineExecutor, Transfer
from kvtier.transfer.demotion import Demoter

BATCH = 64


def persist(
    index: RadixIndex,
    pools: list[Tier],
    executor: InlineExecutor,
    demoter: Demoter,
) -> int:
    """Copy every block without a disk copy to disk; return how many became durable."""
    disk_tier = len(pools) - 1
    disk = pools[disk_tier]
    assert isinstance(disk, DiskTier)
    pending: dict[int, list[BlockRef]] = {}
    durable = 0
    for root in list(index.roots()):
        stack = list(root.children.values()) if root.children else []
        stack.reverse()
        while stack:
            node = stack.pop()
            for i in range(node.size):
                if node.slots[disk_tier][i] is None:
                    tier = node.fastest(i)
                    pending.setdefault(tier, []).append(BlockRef(node, i))
                    if len(pending[tier]) >= BATCH:
                        durable += _flush(index, pools, executor, demoter, tier, pending.pop(tier))
            if node.children:
                stack.extend(reversed(list(node.children.values())))
    for tier, refs in pending.items():
        durable += _flush(index, pools, executor, demoter, tier, refs)
    return durable


def _flush(
    index: RadixIndex,
    pools: list[Tier],
    executor: InlineExecutor,
    demoter: Demoter,
    tier: int,
    refs: list[BlockRef],
) -> int:
    disk_tier = len(pools) - 1
    if not demoter.make_room(disk_tier, len(refs)):
        refs = refs[: pools[disk_tier].num_free]
    refs = [ref for ref in refs if ref.node.slots[tier][ref.i] is not None]
    if not refs:
        return 0
    dst = pools[disk_tier].allocate(len(refs))
    src = tuple(_slot(ref.node.slots[tier][ref.i]) for ref in refs)
    metas = tuple(demoter.describe(ref) for ref in refs)
    done = executor.run(Transfer(pools[tier], src, pools[disk_tier], tuple(dst), metas))
    for ref, slot, ok in zip(refs, dst, done, strict=True):
        if ok:
            index.set_slot(ref, disk_tier, slot)
        else:
            pools[disk_tier].free([slot])
    return done.count(True)


def _slot(slot: int | None) -> int:
    assert slot is not None
    return slot
