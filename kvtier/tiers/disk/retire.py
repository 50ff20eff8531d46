"""Retiring disk copies: the header region of a freed slot is zeroed, so that a restart does not
bring back a block the store dropped (evicted, or found corrupt).

    [ header region | payload ]  ->  [ 0 0 0 ... 0 | payload (left as it was) ]

A zeroed header reads as an empty slot (`format.decode_header` -> None) at the next scan.

Contract:
- `retire(slots)` zeroes the header regions in parallel and says, per slot, whether the write
  was done. Not synced: a copy that comes back after a power loss is still a valid copy of its
  block, and a copy left behind by a refused retire is still verified when read.
- `retire_durably(slots)` also syncs the retirement, under `fsync: none` too, and says how
  many copies may still come back at the next start (refused, or in a slab whose sync
  failed): 0 means that the drop is durable. A clear needs to know, and a reset after new
  weights must not have the old KV come back after a power loss (under `none` it could, while
  the reset said none was left).
- Refused retires and syncs are counted (`retire_errors`, `sync_errors`) and fed to the
  backoff; nothing raises. Freeing the slots themselves is the caller's (`DiskTier.free`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.tiers.disk.io import aligned_buffer
from kvtier.tiers.disk.slab_set import DiskHealth, SlabSet


class CopyRetirer:
    """Zeroes the header regions of freed slots of one tier."""

    def __init__(self, header_region: int, slabs: SlabSet, health: DiskHealth) -> None:
        self.header_region = header_region
        self._slabs = slabs
        self._health = health

    def retire(self, slots: Sequence[int]) -> list[bool]:
        """Zero the header regions of `slots`; True where the write was done."""
        blank = aligned_buffer(self.header_region)
        results = self._slabs.run([self._retire_job(slot, blank) for slot in slots])
        self._health.count("retire_errors", sum(isinstance(r, OSError) for r in results))
        self._health.note_writes(results)
        return [not isinstance(r, OSError) for r in results]

    def retire_durably(self, slots: Sequence[int]) -> int:
        """Retire `slots` and sync the slabs that hold them (whatever `fsync` says: module
        doc); how many of the copies may come back at the next start."""
        retired = [slot for slot, ok in zip(slots, self.retire(slots), strict=True) if ok]
        sync = self._slabs.sync_slabs_of(retired, always=True)
        self._health.count("sync_errors", len(sync.failed))
        self._health.note_writes(sync.results)
        return len(slots) - len(retired) + sync.lost(retired)

    def _retire_job(self, slot: int, blank: memoryview) -> Callable[[], None]:
        slab, offset = self._slabs.where(slot)
        return lambda: slab.write(offset, [blank])
