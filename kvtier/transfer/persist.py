"""Persisting: giving every cached block a durable disk copy now (a checkpoint).

`persist(...)` walks the index root-first and copies each block that has no disk copy yet to
disk, in group commits of up to `BATCH` blocks per source tier. Root-first means a block's
parent is durable no later than the block itself, so a crash in the middle leaves at worst a
few orphans, which recovery discards and counts. Admission rules do not apply: persisting is
an explicit request (an engine's checkpoint, a graceful shutdown, a test's acknowledgement).
When the disk tier is full, its own least-recently-used leaves make room; what still does not
fit (a disk smaller than what is cached, writes the disk refused) is left in memory, not counted
as persisted, and counted in `Persisted.left_blocks` (`persisted`): the caller learns what a
restart would not recover.
"""

from __future__ import annotations

from kvtier.index import BlockRef
from kvtier.transfer.demotion import Demoter, plan_copy_down, run_copy
from kvtier.transfer.shared import CacheState, Runner

BATCH = 64


class Persisted(int):
    """What `KVStore.persist()` returns: the blocks it wrote (the int itself, as it always
    was), and `left_blocks`, the cached blocks still without a durable disk copy just after it
    (0 when every block has one; blocks stored meanwhile by other threads count too)."""

    left_blocks: int

    def __new__(cls, written: int, left_blocks: int) -> Persisted:
        result = super().__new__(cls, written)
        result.left_blocks = left_blocks
        return result

    def __repr__(self) -> str:
        return f"Persisted({int(self)}, left_blocks={self.left_blocks})"


def persisted(written: int, state: CacheState) -> Persisted:
    """`written` with the blocks of the index that have no disk copy now (the index's own
    counts, under the cache's lock, taken here: it is reentrant)."""
    with state.lock:
        index = state.index
        return Persisted(written, index.num_blocks - index.resident(len(state.pools) - 1))


def persist(demoter: Demoter, runner: Runner) -> int:
    """Copy every block without a disk copy to disk; return how many became durable."""
    state = demoter.state
    disk_tier = len(state.pools) - 1
    assert state.disk is not None
    pending: dict[int, list[BlockRef]] = {}
    durable = 0
    for root in list(state.index.roots()):
        stack = list(root.children.values()) if root.children else []
        stack.reverse()
        while stack:
            node = stack.pop()
            for i in range(node.size):
                if node.slots[disk_tier][i] is None:
                    tier = node.fastest(i)
                    pending.setdefault(tier, []).append(BlockRef(node, i))
                    if len(pending[tier]) >= BATCH:
                        durable += _flush(demoter, runner, tier, pending.pop(tier))
            if node.children:
                stack.extend(reversed(list(node.children.values())))
    for tier, refs in pending.items():
        durable += _flush(demoter, runner, tier, refs)
    return durable


def _flush(demoter: Demoter, runner: Runner, tier: int, refs: list[BlockRef]) -> int:
    state = demoter.state
    disk_tier = len(state.pools) - 1
    if not demoter.make_room(disk_tier, len(refs)):
        refs = refs[: state.pools[disk_tier].num_free]
    refs = [ref for ref in refs if ref.node.slots[tier][ref.i] is not None]
    if not refs:
        return 0
    copy = plan_copy_down(state, refs, tier, disk_tier)
    return run_copy(state, copy, refs, runner)
