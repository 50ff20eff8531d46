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

from kvtier.index import BlockRef
from kvtier.transfer.demotion import Demoter, plan_copy_down, run_copy
from kvtier.transfer.shared import Runner

BATCH = 64


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
