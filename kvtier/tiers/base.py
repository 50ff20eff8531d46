"""What every tier offers the store and the mover: slots and their accounting.

`SlotPool` (gpu, host: tensors in memory) and `DiskTier` (slab files) both satisfy `Tier`. How
bytes get in and out differs (tensor slices for pools, verified file I/O for the disk), and the
mover (`transfer/copy.py`) picks the path by the pair of tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.blocks import KVLayout

GPU, HOST, DISK = 0, 1, 2
"""Tier indices, fastest first (DESIGN "Tier"): the index's slot fields and the store's list of
tiers use this order."""


class Tier(Protocol):
    name: str
    num_slots: int
    layout: KVLayout

    @property
    def location(self) -> str:
        """Where the tier keeps its blocks: a device (`cuda:0`, `cpu`) or a directory."""
        ...

    @property
    def capacity_bytes(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> list[int]: ...
    def free(self, slots: Sequence[int]) -> None: ...
    def is_allocated(self, slot: int) -> bool: ...
    def check(self) -> None: ...
    def close(self) -> None: ...
