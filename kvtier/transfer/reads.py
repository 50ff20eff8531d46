"""Reading a cached prefix in the caller's thread, for `KVStore.load`.

`read_prefix(end, into, first, later)` copies the blocks of the path to `end` (from block
`first` on: a caller that holds the head asks for the tail only) out of their fastest copies
(prefix closure: one run per tier) into the caller's memory, in one pass for memory tiers (one
`copy_` per run of slots into whatever layout `into` views, `caller_kv.py`; into contiguous
pages, the copy planner's pick: on CUDA, one gather kernel for all blocks); it stops before
a disk copy that fails verification (disk copies are read, verified, then placed).
`read_disk(refs)` reads and verifies the disk copies of consecutive blocks of one
path. The first that fails verification is never served; it is dropped with everything below it
(`drop_corrupt`: the blocks below would be orphans) and counted, at once when none of that is
locked, else (a pending prefetch, a flight, a pin holds some of it) by `later`, the mover, as
soon as nothing there is locked (`Prefetcher.drop_doomed`). Promotion to gpu (prefetch) is the
mover's (`prefetch.py`), which reads through the executor and drops corrupt copies the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvtier.index import BlockRef, RadixIndex
from kvtier.index.helpers import subtree_locked
from kvtier.index.node import Node
from kvtier.kernels.block_copy import copy_blocks_slices
from kvtier.tiers.base import DISK, Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import SlotPool
from kvtier.tiers.quantized import QuantPool
from kvtier.transfer.copy import InlineExecutor


class Later(Protocol):
    def doom(self, ref: BlockRef) -> None:
        """Drop `ref`, a block whose disk copy failed verification, with everything below it,
        as soon as nothing there is locked; until then it is never served."""


class DiskReader:
    def __init__(
        self,
        index: RadixIndex,
        pools: Sequence[Tier],
        executor: InlineExecutor,
        ops: dict[str, int],
    ) -> None:
        """`ops` is the store's counter table: `corrupt_dropped` is counted there."""
        self.index = index
        self.pools = list(pools)
        self.disk = self.pools[DISK] if len(self.pools) > DISK else None
        self.executor = executor
        self.ops = ops

    def read_prefix(
        self, end: Node, into: Callable[[int], torch.Tensor], first: int, later: Later
    ) -> int:
        """Copy the blocks of the path to `end` from block `first` on (the caller holds those
        before it: `load(start=)`) out of their fastest copies into `into(n)` (a `[n,
        *block_shape]` view of the caller's memory, asked once, any device and strides), one
        copy per run of slots, up to the first corrupt disk copy (dropped, now or by `later`:
        module doc).
        Returns how many leading blocks of the path are held, the `first` included (fewer
        than `first` when the path is shorter; then nothing is copied)."""
        nodes = self.index.path(end)
        total = sum(node.size for node in nodes)
        dest = into(max(0, total - first))
        by_tier: dict[int, tuple[list[int], list[int]]] = {}
        on_disk: list[BlockRef] = []  # the blocks served from disk (prefix closure: the tail)
        base = -first  # the next node's first block, counted in `dest`
        for node in nodes:
            skip = max(0, -base)  # its blocks before `first`
            if skip >= node.size:
                base += node.size
                continue
            whole = _one_tier(node)
            if whole is not None:  # the common case: one list scan per node, not per block
                positions, slots = by_tier.setdefault(whole, ([], []))
                positions.extend(range(base + skip, base + node.size))
                slots.extend(node.slots[whole][skip:])  # type: ignore[arg-type]
                if whole == DISK:
                    on_disk.extend(BlockRef(node, i) for i in range(skip, node.size))
            else:  # a node split between tiers: block by block
                for i in range(skip, node.size):
                    tier = node.fastest(i)
                    positions, slots = by_tier.setdefault(tier, ([], []))
                    positions.append(base + i)
                    slots.append(_slot(node.slots[tier][i]))
                    if tier == DISK:
                        on_disk.append(BlockRef(node, i))
            base += node.size
        count = max(0, base)
        for tier, (positions, slots) in sorted(by_tier.items()):  # disk last: it may cut
            if tier == DISK:
                data, good = self.read_disk(on_disk)
                dest[positions[0] : positions[0] + good].copy_(data[:good])
                count = positions[0] + good
                if good < len(on_disk):
                    self.drop_corrupt(on_disk[good], later)
                continue
            pool = self.pools[tier]
            assert isinstance(pool, SlotPool)
            if isinstance(pool, QuantPool):  # payloads: decoded, then placed
                copy_blocks_slices(pool.read(slots), dest, range(len(slots)), positions)
            elif dest.is_contiguous():  # pages: the copy planner's pick (a kernel on CUDA)
                self.executor.copier.copy(pool.buffer, dest, slots, positions)
            else:  # straight from the slots into the caller's layout, one copy per run
                copy_blocks_slices(pool.buffer, dest, slots, positions)
        return min(total, first) + count

    def read_disk(self, refs: list[BlockRef]) -> tuple[torch.Tensor, int]:
        """Read and verify the disk copies of `refs` (consecutive blocks of one path): the data
        and how many leading blocks verified. Changes nothing in the index."""
        assert isinstance(self.disk, DiskTier)
        slots = [_slot(ref.node.slots[DISK][ref.i]) for ref in refs]
        started = time.monotonic()
        data, ok = self.disk.read_blocks(slots, [self.index.block_id(ref) for ref in refs])
        assert isinstance(data, torch.Tensor)  # no `out` given: one new tensor
        good = ok.index(False) if False in ok else len(ok)
        self.executor.record(("disk", "host"), good * self.disk.layout.block_bytes, started)
        return data, good

    def drop_corrupt(self, ref: BlockRef, later: Later) -> None:
        """A copy failed verification: drop the block and everything below it, and count it;
        while some of that is locked, `later` does (module doc)."""
        if subtree_locked(ref):
            later.doom(ref)
            return
        for tier, slot in self.index.drop_subtree(ref):
            self.pools[tier].free([slot])
        self.ops["corrupt_dropped"] += 1


def _slot(slot: int | None) -> int:
    assert slot is not None
    return slot


def _one_tier(node: Node) -> int | None:
    """The tier that holds the fastest copy of every block of `node`, when it is one tier:
    the first tier with no gap after tiers with no copy at all (`None` scans run in C)."""
    for tier, fields in enumerate(node.slots):
        if None not in fields:
            return tier
        if fields.count(None) != len(fields):
            return None
    return None
