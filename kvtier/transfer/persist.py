"""Persisting: giving every cached block a durable disk copy now (a checkpoint).

`persist(...)` walks the index root-first and copies each block that has no disk copy yet to
disk, in group commits of up to `BATCH` blocks per source tier. Root-first means a block is
queued after its parent; a batch of one source tier may still be synced before its parents'
batch of another (a host child flushed while its gpu parent's batch fills), so a crash in the
middle leaves at worst a few orphans, which recovery discards and counts: nothing `persist`
returned as durable is lost, since it returns once every batch is synced. Admission rules do
not apply: persisting is an explicit request (an engine's checkpoint, a graceful shutdown, a
test's acknowledgement).
It writes into the disk tier's free slots only and makes no room there: every block on disk is
durable already (a disk-only one is the cache's only copy), so dropping one to write another
would lose a cached block and gain no durable one. When the free slots run out the walk stops,
so the blocks it took are the first ones of the walk, their parents among them (a restart
finds none of them an orphan unless a write failed); what does not fit (a disk with fewer
free slots than blocks to write, writes the disk refused) is left in memory, not counted as
persisted, and counted in `Persisted.left_blocks` (`persisted`): the caller learns what a
restart would not recover.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.index import BlockRef, RadixIndex
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
    """Copy the blocks without a disk copy to disk, root-first, into its free slots (none is
    made: nothing is dropped or demoted); return how many became durable. `demoter` gives the
    cache's state; the copies go through the one copy-down path (`plan_copy_down`)."""
    state = demoter.state
    disk_tier = len(state.pools) - 1
    assert state.disk is not None
    disk = state.pools[disk_tier]
    pending: dict[int, list[BlockRef]] = {}
    queued = 0  # blocks in `pending`: each takes one of the free slots when flushed
    durable = 0
    for ref in _unwritten(state.index, disk_tier):
        if queued >= disk.num_free:
            break  # the disk is full: the rest stays in memory, in `left_blocks`
        tier = ref.node.fastest(ref.i)
        batch = pending.setdefault(tier, [])
        batch.append(ref)
        queued += 1
        if len(batch) >= BATCH:
            queued -= len(batch)
            durable += _flush(state, runner, tier, pending.pop(tier))
    for tier, refs in pending.items():
        durable += _flush(state, runner, tier, refs)
    return durable


def _unwritten(index: RadixIndex, disk_tier: int) -> Iterator[BlockRef]:
    """The blocks without a disk copy, root-first (each after its parent), read as the walk
    goes: the caller's flushes between two of them only add disk copies."""
    for root in list(index.roots()):
        stack = list(reversed(list(root.children.values()))) if root.children else []
        while stack:
            node = stack.pop()
            for i in range(node.size):
                if node.slots[disk_tier][i] is None:
                    yield BlockRef(node, i)
            if node.children:
                stack.extend(reversed(list(node.children.values())))


def _flush(state: CacheState, runner: Runner, tier: int, refs: list[BlockRef]) -> int:
    """Copy the `tier` copies of `refs` to disk, as many as it has free slots (the first ones),
    those still in `tier` and not on disk; how many the index learned."""
    disk_tier = len(state.pools) - 1
    refs = [
        ref
        for ref in refs
        if ref.node.slots[tier][ref.i] is not None and ref.node.slots[disk_tier][ref.i] is None
    ][: state.pools[disk_tier].num_free]
    if not refs:
        return 0
    copy = plan_copy_down(state, refs, tier, disk_tier)
    return run_copy(state, copy, refs, runner)
