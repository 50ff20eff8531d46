"""What a tenant is to the store: its namespace seed, its quotas and its fair-share floors.

`Namespaces`: each tenant's namespace seed, and what a disk copy records about a block.

A tenant's blocks hang from its own root in the index, keyed by a seed derived from the model's
fingerprint and the tenant's salt (`hashing.tenant_salt`, keyed by the server secret): the same
tokens give other block ids in another namespace (DESIGN invariant 6). The seeds are fixed when
the store is built; nothing here changes afterwards.

`describe(index, ref)` is the metadata a disk copy of block `ref` carries (`BlockMeta`): its id,
its parent's id, its namespace seed, its tenant's identifier (never a secret) and its tokens.
The demoter, the mover and `persist` take this object rather than a callback into the store, so
calls run down the floors (STYLE 14).

Per-tenant quotas and fair-share floors (DESIGN invariant 9: no tenant pins a tier or
evicts another below its floor).

`TenantShares` is resolved once, when the store is built, from `tenants.<id>.quota` and
`tenants.<id>.floor` and the slots of each tier (a size is whole blocks of it, rounded down; a
fraction is of the tier's slots, rounded down). Unset values default to an equal split among
the configured tenants: with n >= 2 tenants, each one's quota and floor in a tier are
`slots // n`; a single tenant has no quota but the tiers themselves and no floor, so nothing
changes for it. The floors of one tier must fit in it (`ConfigError` otherwise).

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

Pure data and arithmetic: the store hands in the figures it reads from the index, the mover
and the reservation table, under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.blocks import BlockHasher, BlockId, tenant_salt
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, QuotaError, UnknownTenantError
from kvtier.index import BlockRef, RadixIndex
from kvtier.sizes import Capacity
from kvtier.tiers.disk import BlockMeta

QUOTA_TIERS = ("gpu", "host")
"""The tiers a tenant can hold slots in: leases and reservations never hold disk slots."""


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits, in blocks per tier (by tier index; `quota` is None where the tier
    has no quota: disk) and in live leases."""

    quota: tuple[int | None, ...]
    floor: tuple[int, ...]
    leases: int


class TenantShares:
    def __init__(self, config: KVTierConfig, slots: Sequence[int]) -> None:
        """Limits of every tenant of `config`, over tiers of `slots[t]` slots (fastest
        first, as `config.tier_names`). `ConfigError` if a tier's floors exceed it."""
        tenants = config.tenants
        split = len(tenants) >= 2
        block_bytes = config.layout.block_bytes
        self.tier_names = config.tier_names
        self.limits: dict[str, TenantLimits] = {}
        for tenant, settings in tenants.items():
            quota: list[int | None] = []
            floor: list[int] = []
            for tier, name in enumerate(self.tier_names):
                share = slots[tier] // len(tenants)
                given = getattr(settings.quota, name) if name in QUOTA_TIERS else None
                if given is not None:
                    quota.append(_blocks(given, slots[tier], block_bytes))
                else:  # a single tenant: the tier itself is its bound (CapacityError past it)
                    quota.append(share if split and name in QUOTA_TIERS else None)
                given = getattr(settings.floor, name)
                default = share if split else 0
                floor.append(default if given is None else _blocks(given, slots[tier], block_bytes))
            self.limits[tenant] = TenantLimits(tuple(quota), tuple(floor), settings.quota.leases)
        for tier, name in enumerate(self.tier_names):
            total = sum(limits.floor[tier] for limits in self.limits.values())
            if total > slots[tier]:
                raise ConfigError(
                    f"tenants.*.floor.{name}",
                    f"{total} blocks in all",
                    f"floors that fit in the {name} tier's {slots[tier]} slots",
                )

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


def _blocks(value: Capacity, slots: int, block_bytes: int) -> int:
    """Blocks of a tier of `slots` slots that a size or a fraction stands for."""
    if value.nbytes is not None:
        return value.nbytes // block_bytes
    assert value.fraction is not None
    return int(value.fraction * slots)


class Namespaces:
    def __init__(
        self, tenants: Iterable[str], hasher: BlockHasher, fingerprint: bytes, secret: bytes
    ) -> None:
        """The seed of each of `tenants`, from the model's `fingerprint` and the server
        `secret` that keys the tenant salts."""
        self._seeds: dict[str, BlockId] = {
            tenant: hasher.seed(fingerprint, tenant_salt(tenant, secret)) for tenant in tenants
        }
        self._tenants: dict[bytes, str] = {seed: tenant for tenant, seed in self._seeds.items()}

    @property
    def seeds(self) -> Mapping[str, BlockId]:
        """Tenant -> namespace seed, for every configured tenant."""
        return self._seeds

    def seed(self, tenant: str) -> BlockId:
        """The namespace of `tenant`; `UnknownTenantError` naming the tenants there are."""
        seed = self._seeds.get(tenant)
        if seed is None:
            raise UnknownTenantError(
                f"tenant {tenant!r}: unknown, expected one of {sorted(self._seeds)}"
            )
        return seed

    def tenant_of(self, namespace: bytes) -> str | None:
        """The tenant whose namespace `namespace` is, or None (another server secret's, or a
        tenant no longer configured)."""
        return self._tenants.get(namespace)

    def describe(self, index: RadixIndex, ref: BlockRef) -> BlockMeta:
        """What a disk copy of block `ref` of `index` records about it."""
        kb = index.key_nbytes
        namespace = index.namespace_of(ref.node)
        return BlockMeta(
            block_id=index.block_id(ref),
            parent_id=index.parent_id(ref),
            namespace=namespace,
            tenant=self._tenants.get(namespace, ""),
            tokens=ref.node.key[ref.i * kb : (ref.i + 1) * kb],
        )
