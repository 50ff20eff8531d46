"""The operator's side of a store: status, check, clear, persist, drain, evict, close, looking
leases and reservations up by id; and the remote tier's fill before a prefetch or load.

`Operations` works on a store's `Parts` (`assembly.py`) under the cache's lock; `KVStore`
forwards its operator methods here, so that the store class itself is the engine contract.
It also owns the store's life: `close()` ends it, and every later call of either raises
`ClosedError` (`ensure_open`), as does every call in another process than the one that built
it (the lock is a `home.HomeLock`). `expire()` ends the leases and reservations past their
expiry, which every call does first.

`check()` verifies DESIGN invariants 2-5 across the parts: the index's own (`RadixIndex.check`),
the mover's and the reservation table's, each pool's, and that a pool's used slots are exactly
its resident blocks plus the slots flights and reservations hold, and that every slot the
index names is one its tier has allocated (so in range: the copies that read a prefix out of
its slots index the pools with them, `transfer/reads.py`); that the index's lease
records are exactly the clients' leases and the pins of flights and reservations; and that every
live lease's block table names the gpu slots (or, pending, the slots in flight) of its blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtier.arguments import check_tenant, check_timeout
from kvtier.assembly import Parts
from kvtier.blocks import BlockId
from kvtier.errors import (
    ClosedError,
    InvalidArgumentError,
    InvariantError,
    LeaseError,
    StorageError,
    shown,
)
from kvtier.home import HomeLock
from kvtier.index import BlockRef, LeaseId
from kvtier.index.helpers import by_fastest, unheld_subtrees
from kvtier.results import Lease, LookupResult, Reservation
from kvtier.status import store_status, tenant_status
from kvtier.tiers.base import DISK, GPU
from kvtier.transfer.persist import persist


class Operations:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.lock = HomeLock(parts.state.lock)  # this process's only (`home.py`)
        self.mover = parts.mover
        self.closed = False
        # one table per tenant, counted in calls and when background writes land alike
        parts.state.tenant_ops.update((t, c.ops) for t, c in parts.tenant_counters.items())

    def ensure_open(self) -> None:
        """`ClosedError` once the store is closed, or in another process than its own."""
        self.lock.ensure_home()
        if self.closed:
            raise ClosedError("the store is closed")

    def namespace(self, tenant: str) -> BlockId:
        """The namespace of configured `tenant` (`InvalidArgumentError` for another type than
        str, `UnknownTenantError` for another name)."""
        self.ensure_open()
        check_tenant(tenant)
        return self.parts.namespaces.seed(tenant)

    def count(self, tenant: str, **events: int) -> None:
        """Add `events` (operation counters, `TENANT_OPS`) to the global and `tenant`'s own."""
        self.parts.state.count(tenant, **events)

    def count_lookup(self, tenant: str, tokens: int, hit: int, by_tier: Sequence[int]) -> None:
        """A lookup of `tokens` tokens hit `hit` tokens, `by_tier[t]` blocks whose fastest copy
        is in tier t (global and `tenant`'s counters; on every lookup, so written out)."""
        own = self.parts.tenant_counters[tenant]
        for ops in (self.parts.state.ops, own.ops):
            ops["lookups"] += 1
            ops["lookup_tokens"] += tokens
            ops["hit_tokens"] += hit
        counters, hits = self.parts.state.counters, own.hits
        for tier, count in enumerate(by_tier):
            counters[tier].hits += count
            hits[tier] += count

    def expire(self) -> None:
        self.parts.state.ops["leases_expired"] += self.mover.expire()
        self.parts.reservations.expire()

    # ---- leases and reservations by id -----------------------------------------------------

    def lease(self, lease_id: int, tenant: str | None) -> Lease:
        if tenant is not None:
            check_tenant(tenant)
        with self.lock:
            self.ensure_open()
            self.expire()
            lease = self.mover.book.get(LeaseId(lease_id)) if type(lease_id) is int else None
            if lease is None or (tenant is not None and lease.tenant != tenant):
                raise LeaseError(f"lease {shown(lease_id)}: unknown, released or expired")
            return lease

    def release_done(self, lease_ids: Sequence[int], tenant: str) -> int:
        """Release those of `lease_ids` that are live leases of `tenant` (the leases a client
        is done with, carried by its next prefetch or reserve: `KVStore.prefetch`); pass over
        the others (released or expired meanwhile, sent twice after a failed request, another
        tenant's: never told apart). How many were released. `InvalidArgumentError`, and
        nothing released, unless `lease_ids` is a list or tuple of ints."""
        check_release(lease_ids)
        with self.lock:
            self.ensure_open()
            self.expire()
            book, released = self.mover.book, 0
            for raw in lease_ids:
                lease = book.get(LeaseId(raw))
                if lease is not None and lease.tenant == tenant:
                    book.release(LeaseId(raw))
                    released += 1
            if released:
                self.mover.executor.mark_engine()  # CUDA: a copy into these slots waits for reads
            return released

    def reservation(self, reservation_id: int, tenant: str | None) -> Reservation:
        if tenant is not None:
            check_tenant(tenant)
        with self.lock:
            self.ensure_open()
            self.expire()
            return self.parts.reservations.get(reservation_id, tenant).reservation

    def leases(self) -> list[Lease]:
        with self.lock:
            self.ensure_open()
            self.expire()
            return self.mover.book.leases()

    # ---- operations ------------------------------------------------------------------------

    def clear(self, tenant: str | None) -> int:
        with self.lock:
            self.ensure_open()
            self.expire()
            self.mover.drain()
            seeds = self.parts.namespaces.seeds
            if tenant is not None:
                check_tenant(tenant)
            if tenant is not None and tenant not in seeds:
                # a tenant taken out of the config: the copies recovery left on disk under its
                # id (`recovery.py`); none: the unknown tenant's error
                retired = _clear(self.parts, {}, [tenant])
                if not retired:
                    self.namespace(tenant)
                return retired
            namespaces = dict(seeds) if tenant is None else {tenant: self.namespace(tenant)}
            return _clear(self.parts, namespaces, None if tenant is None else [tenant])

    def reset(self, tenant: str) -> tuple[int, int]:
        """`clear(tenant)` once `tenant`'s live reservations are void (ended as at expiry: KV
        computed before the reset never commits, and their pins no longer hold the prefix),
        and the blocks of `tenant` left (held by a lease), in one hold of the (reentrant) lock."""
        with self.lock:
            self.namespace(tenant)  # closed, or an unknown tenant: raised, nothing voided
            self.parts.reservations.void(tenant)
            dropped = self.clear(tenant)
            return dropped, sum(
                by_fastest(BlockRef(self.parts.state.index.root(self.namespace(tenant)), 0))
            )

    def persist(self) -> int:
        with self.lock:
            self.ensure_open()
            if self.parts.state.disk is None:
                raise InvalidArgumentError("persist: this store has no disk tier (tiers.disk)")
            self.mover.drain()  # what was stored before this call is in the index
            self.expire()
            return persist(self.parts.demoter, self.parts.executor)

    def with_remote(
        self, hit: LookupResult, key: bytes, namespace: BlockId, tenant: str
    ) -> LookupResult:
        """`hit` extended by the blocks past it that the remote tier holds in a row (one round
        trip, without the lock), when there is one; their tokens counted in `hit_tokens`
        (global and `tenant`'s: a node whose lookups the cluster served read a hit rate of 0)."""
        if self.parts.remote is None:
            return hit
        bt = self.parts.config.layout.block_tokens
        _, run = self.parts.remote.probe(namespace, key, hit.num_tokens // bt)
        if run:
            with self.lock:
                for ops in (self.parts.state.ops, self.parts.tenant_counters[tenant].ops):
                    ops["hit_tokens"] += run * bt
        return hit._replace(num_tokens=hit.num_tokens + run * bt, remote_tokens=run * bt)

    def fill_from_remote(
        self, key: bytes, tenant: str, release: Sequence[int] | None = None
    ) -> None:
        """With a remote tier: store locally what it holds past the cached prefix of `key`
        (`transfer/remote.py`), before a prefetch or load takes the lock.

        `release` (a prefetch's; None for a load): the leases it is done with, released first
        as it would before its quotas are checked. Then nothing is filled when `tenant` holds
        all the leases its quota allows (the prefetch is refused, and changes nothing), else no
        further than it could lease on gpu (`_leasable`): a prefetch is all or nothing, and a
        longer prefix would turn a lease of a shorter one into a `CapacityError`."""
        if self.parts.remote is None:
            return
        if release:
            self.release_done(release, tenant)
        most = None
        with self.lock:
            namespace = self.namespace(tenant)
            if release is not None:
                most = self._leasable(namespace, key, tenant)
                if most is None:
                    return
        self.parts.remote.fill(namespace, tenant, key, most)

    def _leasable(self, namespace: BlockId, key: bytes, tenant: str) -> int | None:
        """How many of `key`'s first blocks a prefetch of `tenant` could lease on gpu now: those
        its leases hold, and as many more as its gpu quota leaves and no lock or reservation
        holds; None when its lease quota is used up (`fill_from_remote`). Under the lock."""
        limits, state = self.parts.shares.limits[tenant], self.parts.state
        if self.mover.book.leases_of(tenant) >= limits.leases:
            return None
        match = state.index.match(namespace, key)
        held_here = match.num_blocks - state.index.leases.unheld_blocks(match.end)
        seeds = self.parts.namespaces.seeds.values()
        locked = sum(state.index.leases.held_blocks(seed) for seed in seeds)
        locked += self.parts.reservations.held(GPU)
        most = held_here + state.gpu.num_slots - locked
        quota = limits.quota[GPU]
        if quota is not None:
            most = min(most, held_here + quota - self.parts.writes.holding(tenant, namespace, GPU))
        return most

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + check_timeout("timeout_s", timeout_s)
        with self.lock:
            self.ensure_open()
            while True:
                self.mover.step()
                if not self.mover.drain(max(0.0, deadline - time.monotonic())):
                    return False
                self.mover.step()
                if self.mover.idle():
                    break
        remote = self.parts.remote  # its writer, without the lock: it takes it for nothing
        return remote is None or remote.drain(max(0.0, deadline - time.monotonic()))

    def evict(self, tier: str, num_blocks: int) -> int:
        names = self.parts.state.index.tiers
        present = tuple(names[t] for t in self.parts.state.present)
        if tier not in present:
            raise InvalidArgumentError(f"tier: got {shown(tier)}, expected one of {present}")
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks: got {shown(num_blocks)}, expected an int >= 0")
        with self.lock:
            self.ensure_open()
            self.expire()
            number = names.index(tier)
            pool = self.parts.state.pools[number]
            self.mover.drain()  # no flight under way: disk copies are made here, as `persist`'s
            before, demoter = pool.num_free, self.parts.demoter
            synced, demoter.sync_disk = demoter.sync_disk, True  # demoted, never dropped for it
            try:
                demoter.make_room(number, min(pool.num_slots, before + num_blocks))
            finally:
                demoter.sync_disk = synced
            return pool.num_free - before

    def status(self, tenant: str | None) -> dict[str, Any]:
        with self.lock:
            self.ensure_open()
            if tenant is not None:
                namespace = self.namespace(tenant)
                self.expire()
                return tenant_status(self.parts, tenant, namespace)
            self.mover.reap()
            self.expire()
            return store_status(self.parts)

    def check(self) -> None:
        with self.lock:
            self.ensure_open()
            _check(self.parts)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.mover.close()  # without the lock: the mover thread takes it to stop
        if self.parts.remote is not None:
            self.parts.remote.close()
        if self.parts.events is not None:
            self.parts.events.close()  # sends what is queued
        with self.lock:
            for pool in self.parts.state.pools:
                pool.close()


def _clear(parts: Parts, namespaces: dict[str, BlockId], tenants: Sequence[str] | None) -> int:
    """Drop every unheld subtree of `namespaces` (tenant -> namespace), a block counted in its
    tenant's `cleared` of its fastest copy's tier; retire their disk copies durably, and those
    recovery left on disk under `tenants`' ids (every tenant's when None) in namespaces the
    config does not know (`recovery.py`). How many blocks and such copies were dropped."""
    index, pools = parts.state.index, parts.state.pools
    dropped = 0
    on_disk: list[int] = []
    for tenant, namespace in namespaces.items():
        root, cleared = index.root(namespace), parts.tenant_counters[tenant].cleared
        for child in unheld_subtrees(root):
            for tier, count in enumerate(by_fastest(BlockRef(child, 0))):
                cleared[tier] += count
            before = index.num_blocks
            for tier, slot in index.drop_subtree(BlockRef(child, 0)):
                if tier == DISK:
                    on_disk.append(slot)
                else:
                    pools[tier].free([slot])
            dropped += before - index.num_blocks
    disk = parts.state.disk
    left = disk.free_durably(on_disk) if disk is not None and on_disk else 0
    copies = len(on_disk)
    if disk is not None:
        kept, kept_left = disk.retire_kept(tenants)
        dropped, copies, left = dropped + kept, copies + kept, left + kept_left
    if left:
        assert disk is not None
        raise StorageError(
            f"clear: {dropped} blocks were dropped, but the disk refused to retire "
            f"{left} of their {copies} disk copies "
            f"({disk.backoff.last_error}): up to {left} of these blocks may come "
            "back after a restart; clear again then"
        )
    return dropped


def _check(parts: Parts) -> None:
    """The module doc's invariants; `InvariantError` naming the first that fails."""
    index, mover, reservations = parts.state.index, parts.mover, parts.reservations
    index.check()
    mover.check()
    if parts.remote is not None:
        parts.remote.check()
    reservations.check()  # its slots allocated, once each: then the sums below
    _check_slots_allocated(parts)
    for tier, pool in enumerate(parts.state.pools):
        pool.check()
        in_index = index.resident(tier)
        reserved = mover.reserved(tier) + reservations.held(tier)
        if pool.num_used != in_index + reserved:
            raise InvariantError(
                f"{pool.name}: {pool.num_used} slots in use but {in_index} blocks "
                f"resident in the index and {reserved} held by flights and reservations "
                f"(live or quarantined) "
                f"({pool.used_bytes} bytes vs "
                f"{(in_index + reserved) * pool.layout.block_bytes})"
            )
    leases = mover.book.ids()
    pins = mover.flights.pin_ids() | reservations.pins()
    indexed = {r.lease_id for r in index.leases}
    if leases | pins != indexed:
        raise InvariantError(
            f"leases: store has {sorted(leases)} and pins {sorted(pins)}, index {sorted(indexed)}"
        )
    for lease in mover.book.leases():
        record = index.leases.get(LeaseId(lease.lease_id))
        now = tuple(
            ref.node.slots[GPU][ref.i]
            if ref.node.slots[GPU][ref.i] is not None or lease.ready()
            else mover.prefetcher.gpu_slot_in_flight(index.block_id(ref))
            for ref in index.blocks(record.end)
        )
        if now != lease.block_table:
            raise InvariantError(
                f"lease {lease.lease_id} ({lease.state.value}): block table "
                f"{lease.block_table} but gpu slots (or slots in flight) are now {now}"
            )


def check_release(lease_ids: object) -> None:
    """`InvalidArgumentError` unless `lease_ids` is a list or tuple of ints (lease ids)."""
    if not isinstance(lease_ids, (list, tuple)) or any(type(r) is not int for r in lease_ids):
        raise InvalidArgumentError(f"release: got {shown(lease_ids)}, expected lease ids (ints)")


def _check_slots_allocated(parts: Parts) -> None:
    """`InvariantError` naming the first block whose slot in a tier is not allocated there."""
    pools = parts.state.pools
    stack = list(parts.state.index.roots())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values() if node.children else ())
        for tier, fields in enumerate(node.slots):
            for i, slot in enumerate(fields):
                if slot is not None and not pools[tier].is_allocated(slot):
                    raise InvariantError(
                        f"{pools[tier].name}: block {i} of {node!r} is in slot {slot}, which "
                        f"the tier has not allocated (of its {pools[tier].num_slots} slots)"
                    )
