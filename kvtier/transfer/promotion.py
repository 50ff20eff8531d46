"""Promotion: bringing a cached prefix up to the gpu tier, and reading verified disk copies.

`Promoter.promote(match)` copies the blocks of a pinned prefix that are not on gpu up to gpu,
all or nothing (DESIGN "Movement policy"). By prefix closure they are a suffix of the prefix,
host copies first, then disk copies. Disk copies are read and verified before anything moves
(`read_disk`): if one is corrupt, nothing is promoted and the corrupt block is returned so
the caller can drop it (`drop_corrupt`, which takes its descendants along: they would be
orphans) and try again. Copies reach the index root first, so closure holds at every step.

Synchronous here; the async mover (issue 4) runs the same plan on its streams and threads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvtier.errors import CapacityError
from kvtier.index import BlockRef, Match, RadixIndex
from kvtier.tiers import SlotPool
from kvtier.tiers.base import DISK, GPU, Tier
from kvtier.tiers.disk import DiskTier
from kvtier.transfer.copy import InlineExecutor, Transfer
from kvtier.transfer.demotion import Demoter, TierCounters


class Promoter:
    def __init__(
        self,
        index: RadixIndex,
        pools: Sequence[Tier],
        executor: InlineExecutor,
        demoter: Demoter,
        counters: Sequence[TierCounters],
        ops: dict[str, int],
    ) -> None:
        """`ops` is the store's counter table: `corrupt_dropped` is counted there."""
        self.index = index
        self.pools = list(pools)
        gpu = self.pools[GPU]
        assert isinstance(gpu, SlotPool)
        self.gpu = gpu
        self.disk = self.pools[DISK] if len(self.pools) > DISK else None
        self.executor = executor
        self.demoter = demoter
        self.counters = list(counters)
        self.ops = ops

    def promote(self, match: Match) -> BlockRef | None:
        """Bring every block of the (pinned) `match` to gpu; `CapacityError` if the gpu tier
        cannot hold them beside what is leased. Returns a corrupt disk block instead of
        promoting anything, when there is one."""
        missing = [r for r in self.index.blocks(match.end) if r.node.slots[GPU][r.i] is None]
        if not missing:
            return None
        on_disk = [ref for ref in missing if ref.node.fastest(ref.i) == DISK]
        staged = None
        if on_disk:
            staged, good = self.read_disk(on_disk, drop=False)
            if good < len(on_disk):
                return on_disk[good]
        if not (
            self.demoter.can_make_room(GPU, len(missing))
            and self.demoter.make_room(GPU, len(missing))
        ):
            raise CapacityError(
                f"prefetch: {len(missing)} blocks must come up to gpu, but only "
                f"{self.gpu.num_slots - self.index.leases.locked_blocks(GPU)} of "
                f"{self.gpu.num_slots} gpu slots can be freed "
                "(the rest hold leased or pinned blocks)"
            )
        dst = self.gpu.allocate(len(missing))
        sources: dict[int, tuple[list[int], list[int]]] = {}
        for ref, slot in zip(missing, dst, strict=True):
            tier = ref.node.fastest(ref.i)
            src_slots, dst_slots = sources.setdefault(tier, ([], []))
            src_slots.append(_slot(ref.node.slots[tier][ref.i]))
            dst_slots.append(slot)
        for tier, (src_slots, dst_slots) in sources.items():
            if tier == DISK:
                assert staged is not None
                self.gpu.write(dst_slots, staged)  # verified above: no second read
            else:
                self.executor.run(
                    Transfer(self.pools[tier], tuple(src_slots), self.gpu, tuple(dst_slots))
                )
        for ref, slot in zip(missing, dst, strict=True):  # root first: closure holds each step
            self.index.set_slot(ref, GPU, slot)
        self.counters[GPU].promotions += len(missing)
        return None

    def read_disk(self, refs: list[BlockRef], drop: bool = True) -> tuple[torch.Tensor, int]:
        """Read and verify the disk copies of `refs` (consecutive blocks of one path): the data
        and how many leading blocks verified. With `drop`, the first corrupt copy is dropped
        with everything below it."""
        assert isinstance(self.disk, DiskTier)
        slots = [_slot(ref.node.slots[DISK][ref.i]) for ref in refs]
        started = time.monotonic()
        data, ok = self.disk.read_blocks(slots, [self.index.block_id(ref) for ref in refs])
        assert isinstance(data, torch.Tensor)  # no `out` given: one new tensor
        good = ok.index(False) if False in ok else len(ok)
        self.executor.record(("disk", "host"), good * self.disk.layout.block_bytes, started)
        if drop and good < len(refs):
            self.drop_corrupt(refs[good])
        return data, good

    def drop_corrupt(self, ref: BlockRef) -> None:
        """A copy failed verification: drop the block and everything below it, and count it."""
        for tier, slot in self.index.drop_subtree(ref):
            self.pools[tier].free([slot])
        self.ops["corrupt_dropped"] += 1


def _slot(slot: int | None) -> int:
    assert slot is not None
    return slot
