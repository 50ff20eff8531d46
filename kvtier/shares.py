"""Tenant shares: each tenant's quotas and floors, in blocks per tier, and the check that a
config's shares fit its tiers.

Quotas and fair-share floors (DESIGN invariant 9: no tenant pins a tier or evicts another
below its floor). `TenantShares` is resolved once, when the store is built, from
`tenants.<id>.quota`, `tenants.<id>.floor` and each tier's room (`TierRoom`: its slots and slot
bytes; a size is whole slots of that tier's slot bytes, a fraction is of its slots, both rounded
down). Unset: an equal split among the configured tenants (n >= 2: `slots // n` of a tier each;
a single tenant has no quota but the tiers and no floor, so nothing changes for it).

Refused (`ConfigError`, by `check_shares` and so by `TenantShares`): a tier's floors that do
not fit in it (`tenants.*.floor.<tier>`), and a quota that is given but rounds to no block
or a gpu split of no block (more tenants than gpu slots) (`tenants.<id>.quota.<tier>`: every
prefetch and reservation of that tenant would be refused; a host quota of 0 refuses nothing
that needs one). `check_shares`
takes the rooms a config plans (`preflight.py`), so that a config is refused before any tier
is made (a disk tier opened at a lower capacity cuts its slabs); a room that is not known
without the machine (None: a fraction of its free memory, in `kvtier validate`) is not checked.

What a tenant holds, and what its quota bounds (checked before anything changes; over it, the
call raises `QuotaError` naming the tenant, the tier, what it asked and the limit):
- gpu: the blocks its leases (pending or ready) and its reservations' pins lock, each counted
  once however many of its locks cover it (`LeaseTable.held_blocks`), plus the gpu slots its
  reservations hold (live, and expired ones in quarantine);
- host: the host slots its reservations hold (live or in quarantine);
- leases: its live leases, counted one by one (empty ones included), so that a flood of leases
  on one prefix cannot grow the lease table without bound.
Blocks it merely has cached are bounded by the tiers, not by its quota; the floor of each
other tenant decides what its stores and prefetches may evict (`index/eviction.py`).

Pure data and arithmetic: the store hands in what it reads from the index, the mover and the
reservations, under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, QuotaError
from kvtier.tiers.base import Tier

QUOTA_TIERS = ("gpu", "host")
"""The tiers a tenant can hold slots in: leases and reservations never hold disk slots."""


@dataclass(frozen=True)
class TierRoom:
    """A tier's size as shares count it: `slots` slots of `slot_bytes` each."""

    slots: int
    slot_bytes: int

    @classmethod
    def of(cls, tier: Tier) -> TierRoom:
        """The room of a tier that exists (its slot bytes as its status reports them)."""
        return cls(tier.num_slots, tier.capacity_bytes // max(1, tier.num_slots))


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits: blocks per tier (by tier index; `quota` None: none, as disk), leases."""

    quota: tuple[int | None, ...]
    floor: tuple[int, ...]
    leases: int


def _column(config: KVTierConfig, name: str, room: TierRoom) -> list[tuple[int | None, int]]:
    """(quota, floor) in blocks of tier `name` for each tenant, in config order; `ConfigError`
    for a given quota of no block, or floors that do not fit in the tier."""
    tenants = config.tenants
    split = len(tenants) >= 2
    share = room.slots // len(tenants)
    column: list[tuple[int | None, int]] = []
    for tenant, settings in tenants.items():
        given = getattr(settings.quota, name) if name in QUOTA_TIERS else None
        if given is None:  # a single tenant: the tier itself is its bound (CapacityError past it)
            quota = share if split and name in QUOTA_TIERS else None
            if quota == 0 and room.slots and name == "gpu":  # none could prefetch or reserve
                raise ConfigError(
                    f"tenants.{tenant}.quota.{name}",
                    f"{room.slots} slots // {len(tenants)} tenants = 0 blocks",
                    f"a {name} tier of at least one block per tenant, or quotas given "
                    "(tenants.<id>.quota)",
                )
        else:
            quota = given.blocks(room.slots, room.slot_bytes)
            if quota == 0 and room.slots:  # a tier of no slots (no host tier): moot
                raise ConfigError(
                    f"tenants.{tenant}.quota.{name}",
                    given.to_config(),
                    f"at least one block of the {name} tier (a block is {room.slot_bytes} "
                    f"bytes there, a fraction counts of its {room.slots} slots)",
                )
        given = getattr(settings.floor, name)
        floor = (
            (share if split else 0) if given is None else given.blocks(room.slots, room.slot_bytes)
        )
        column.append((quota, floor))
    total = sum(floor for _, floor in column)
    if total > room.slots:
        raise ConfigError(
            f"tenants.*.floor.{name}",
            f"{total} blocks in all",
            f"floors that fit in the {name} tier's {room.slots} slots",
        )
    return column


def check_shares(config: KVTierConfig, rooms: Sequence[TierRoom | None]) -> None:
    """`ConfigError` (module doc) for the first tier of `config` whose shares do not fit its
    room in `rooms` (fastest first, as `config.tier_names`; None: not known, not checked)."""
    for name, room in zip(config.tier_names, rooms, strict=True):
        if room is not None:
            _column(config, name, room)


class TenantShares:
    def __init__(self, config: KVTierConfig, rooms: Sequence[TierRoom]) -> None:
        """Limits of every tenant of `config` over tiers of `rooms` (fastest first, as
        `config.tier_names`). `ConfigError` as `check_shares`."""
        self.tier_names = config.tier_names
        columns = [_column(config, n, r) for n, r in zip(self.tier_names, rooms, strict=True)]
        self.limits: dict[str, TenantLimits] = {}
        for row, (tenant, settings) in enumerate(config.tenants.items()):
            quota = tuple(column[row][0] for column in columns)
            floor = tuple(column[row][1] for column in columns)
            self.limits[tenant] = TenantLimits(quota, floor, settings.quota.leases)

    def floors(self, namespaces: Mapping[str, bytes]) -> dict[bytes, tuple[int, ...]]:
        """Each tenant's floors by namespace, for `RadixIndex.set_floors`; empty when no
        tenant has a floor (plain LRU)."""
        if not any(any(limits.floor) for limits in self.limits.values()):
            return {}
        return {namespaces[tenant]: limits.floor for tenant, limits in self.limits.items()}

    def admit_lease(self, tenant: str, leases: int, holding: int, adding: int) -> None:
        """A new lease of `tenant`, which holds `leases` leases and `holding` gpu blocks, and
        whose lease would lock `adding` more: `QuotaError` if either would pass its quota."""
        limits = self.limits[tenant]
        if leases + 1 > limits.leases:
            raise QuotaError(
                f"tenant {tenant!r}: a prefetch asked for lease {leases + 1}, over its quota "
                f"of {limits.leases} live leases (tenants.{tenant}.quota.leases); "
                f"release leases first"
            )
        self.admit(tenant, 0, holding, adding, "a prefetch")

    def admit(self, tenant: str, tier: int, holding: int, adding: int, what: str) -> None:
        """`what` (a prefetch, a reservation) of `tenant` would hold `adding` more blocks of
        `tier` beside the `holding` it holds: `QuotaError` if that passes its quota."""
        limit = self.limits[tenant].quota[tier]
        if limit is not None and holding + adding > limit:
            name = self.tier_names[tier]
            raise QuotaError(
                f"tenant {tenant!r}: {what} asked for {adding} more {name} blocks beside the "
                f"{holding} it holds, over its quota of {limit} (tenants.{tenant}.quota.{name}); "
                f"release leases or end reservations first"
            )

    def fits(self, tenant: str, tier: int, holding: int, adding: int) -> bool:
        """Whether `adding` more blocks of `tier` stay within `tenant`'s quota."""
        limit = self.limits[tenant].quota[tier]
        return limit is None or holding + adding <= limit
