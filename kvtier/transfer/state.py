"""The cache's shared state: what every part that moves blocks reads and writes.

`CacheState` bundles the index, the tiers' pools (gpu, host[, disk], in tier order), the event
counters per tier, the operation counters, whose blocks they are (`Namespaces`) and the one
lock that serialises every change to them. The store's calls and the mover's thread take
`lock`; the copies themselves run without it (`flights.py`). Nothing here does work: the
parts that do (`demotion.py`, `prefetch.py`, `background.py`, `leasing.py`, `mover.py`,
`persist.py`) each take this one object instead of a handful of the store's fields.

Invariant (checked by `KVStore.check`): a pool's used slots are its blocks resident in the
index plus the slots that flights and reservations hold.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.index import RadixIndex
from kvtier.namespaces import Namespaces
from kvtier.tiers.base import DISK, GPU, HOST, Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import SlotPool

TENANT_OPS = (
    "lookups",
    "lookup_tokens",
    "hit_tokens",
    "stores",
    "stored_tokens",
    "dropped_tokens",
    "loads",
    "loaded_tokens",
    "prefetches",
)
"""The operation counters kept per tenant as well as in the global `ops`."""

OPS = (*TENANT_OPS, "leases_expired", "corrupt_dropped")
"""The global operation counters (`status()["ops"]`)."""


@dataclass
class TierCounters:
    """Events per tier since start. Capacity and residency are read from live objects instead."""

    hits: int = 0  # blocks found by lookups whose fastest copy was here
    promotions: int = 0  # blocks copied up into this tier
    demotions: int = 0  # blocks whose copy here was freed after a copy below existed
    evictions: int = 0  # blocks dropped from the cache while their fastest copy was here


@dataclass(frozen=True, eq=False)
class CacheState:
    index: RadixIndex
    pools: Sequence[Tier]  # gpu, host, then disk when configured
    namespaces: Namespaces
    counters: Sequence[TierCounters] = ()
    ops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        if not self.counters:
            object.__setattr__(self, "counters", [TierCounters() for _ in self.pools])

    @property
    def gpu(self) -> SlotPool:
        pool = self.pools[GPU]
        assert isinstance(pool, SlotPool)
        return pool

    @property
    def host(self) -> SlotPool:
        pool = self.pools[HOST]
        assert isinstance(pool, SlotPool)
        return pool

    @property
    def disk(self) -> DiskTier | None:
        pool = self.pools[DISK] if len(self.pools) > DISK else None
        assert pool is None or isinstance(pool, DiskTier)
        return pool

    @property
    def all_tiers(self) -> tuple[int, ...]:
        return tuple(range(len(self.pools)))

    def free(self, tier: int, slots: Sequence[int]) -> None:
        """Give `slots` of `tier` back to its pool (the index no longer names them)."""
        if slots:
            self.pools[tier].free(list(slots))
