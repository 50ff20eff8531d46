"""The slab files of one disk tier seen as a single array of fixed slots, and the I/O run on them.

    slot s  ->  slab s // S, byte offset (s % S) * slot_bytes        (S = slots_per_slab)

    slab-00000.kvt  [ slot 0 | slot 1 | ... | slot S-1 ]
    slab-00001.kvt  [ slot S | slot S+1 | ...           ]      (the last slab may be shorter)

Contract:
- `where(slot)` is arithmetic over a geometry fixed when the tier opened: the slab file that
  holds a slot and the slot's byte offset in it.
- `run(jobs)` runs I/O jobs on the tier's `IOPool`: results in job order, an `OSError` in place
  of a failed job's result (`IOPool.run`).
- `sync_slabs_of(slots)` makes a batch durable as `fsync` says: under `batch` every slab that
  holds one of `slots` is synced once; under `none` nothing is synced and nothing fails. It
  names the slabs whose sync failed, so that a caller fails exactly the copies in them.
- The set neither opens nor closes anything: the tier opens the slabs and the pool and closes
  them (`DiskTier.close`).
`direct_ready(tensor)` says whether a tensor's memory can go to O_DIRECT as it is (`io.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvtier.tiers.disk.io import ALIGN, IOPool, SlabFile

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SlabSync:
    """The outcome of syncing the slabs of a batch."""

    results: list[OSError | None]
    """One per synced slab, in slab order: None, or the `OSError` its sync raised."""
    failed: frozenset[int]
    """The indexes of the slabs whose sync failed."""
    slots_per_slab: int

    def lost(self, slots: Sequence[int]) -> int:
        """How many of `slots` lie in a slab whose sync failed."""
        return sum(slot // self.slots_per_slab in self.failed for slot in slots)


class SlabSet:
    """Slots over the slab files of one tier; every I/O of the tier goes through `run`."""

    def __init__(
        self,
        files: list[SlabFile],
        slot_bytes: int,
        slots_per_slab: int,
        fsync: str,
        io: IOPool,
    ) -> None:
        """`files` in slab order, all but the last holding `slots_per_slab` slots of
        `slot_bytes` bytes; `fsync` is `batch` or `none`; `io` runs the jobs."""
        self.files = files
        self.slot_bytes = slot_bytes
        self.slots_per_slab = slots_per_slab
        self.fsync = fsync
        self.io = io
        self.num_slots = sum(slab.size // slot_bytes for slab in files)

    def where(self, slot: int) -> tuple[SlabFile, int]:
        """The slab file that holds `slot`, and the slot's byte offset in it."""
        slab, index = divmod(slot, self.slots_per_slab)
        return self.files[slab], index * self.slot_bytes

    def run(self, jobs: Sequence[Callable[[], T]]) -> list[T | OSError]:
        """Run `jobs` on the I/O threads and wait for all (`IOPool.run`)."""
        return self.io.run(jobs)

    def sync_slabs_of(self, slots: Sequence[int]) -> SlabSync:
        """Sync each slab that holds one of `slots` once (`fsync: batch`; nothing under
        `none`), in parallel; which syncs failed."""
        if self.fsync != "batch":
            return SlabSync([], frozenset(), self.slots_per_slab)
        touched = sorted({slot // self.slots_per_slab for slot in slots})
        synced = self.io.run([self.files[i].sync for i in touched])
        failed = frozenset(i for i, r in zip(touched, synced, strict=True) if r is not None)
        return SlabSync(synced, failed, self.slots_per_slab)


def direct_ready(tensor: torch.Tensor) -> bool:
    """Whether a tensor's memory can be handed to O_DIRECT as it is."""
    return tensor.data_ptr() % ALIGN == 0 and tensor.numel() * tensor.element_size() % ALIGN == 0
