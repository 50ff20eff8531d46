"""KVStore: the public, in-process API of kvtier (DESIGN "Engine contract").

    store = KVStore(load_config("configs/default.yaml"))       # or KVStore() for the defaults
    hit = store.lookup(tokens)                                 # cached prefix, split by tier
    lease = store.prefetch(tokens)                             # prefix on gpu, locked
    ... attention reads store.gpu_pool.buffer[lease.block_table] ...
    store.release(lease)
    store.store(tokens, kv)                                    # the new full blocks
    kv = store.load(tokens).kv                                 # or copy the prefix out

Contract:
- Only whole blocks of `block_tokens` tokens are cached; a partial last block is ignored.
- Blocks are immutable and shared: storing a prefix that is cached stores nothing twice.
- `kv` tensors are `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` in the layout's dtype.
- Every method validates its arguments first: bad input raises a `kvtier.errors` exception
  naming the bad value and changes nothing.
- `lookup` changes only recency; `load` returns a new tensor; `prefetch` is all or nothing.
- When a tier needs room now, its least-recently-used unleased leaves move down (gpu -> host)
  and the lowest tier drops leaves (`transfer/demotion.py`).
- The mover (`transfer/mover.py`, `mover.background`) runs copies on worker threads (CUDA
  streams for a CUDA gpu tier): `prefetch(wait=False)` returns a PENDING lease to wait on,
  watermark demotion and disk writes happen behind the caller, and `store()` never waits on
  the disk (what cannot be placed is dropped and counted). With `background: false` every copy
  runs in the calling thread and every call returns with its copies done.
- Thread-safe: one lock serialises calls; copies run outside it. Leases expire after
  `policy.lease_ttl_s` seconds of the store's clock; no call may ask for more than
  `policy.max_ttl_s`.
- Fair shares (`quotas.py`, DESIGN invariant 9): what a tenant's leases and reservations hold
  is bounded by its quota (`QuotaError` past it, nothing changed), and room made for a
  tenant's call comes from blocks above other tenants' floors, or from its own, never from
  another tenant at or under its floor. `status(tenant)` is that tenant's own figures.
- Zero-copy writers (`reserve`, write the slots, `commit`) publish only what they wrote (DESIGN
  invariant 8): `commit` refuses (`NotWrittenError`) a slot that still holds a canary planted at
  `reserve`, and an expired reservation's slots stay allocated and unread in quarantine for
  `policy.reservation_quarantine_s` before anyone else gets them (`reservations.py`).
- Lease and reservation ids are random 63-bit numbers (`ids.py`): they count nothing and are
  not guessable; another tenant's id is refused exactly like one never issued.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import (
    ClosedError,
    InvalidArgumentError,
    InvariantError,
    LeaseError,
    QuotaError,
    StorageError,
)
from kvtier.hashing import BlockHasher, BlockId
from kvtier.index import BlockRef, LeaseId, Match, RadixIndex
from kvtier.index.node import Node
from kvtier.kvdata import check_device, check_kv, from_blocks, to_blocks
from kvtier.namespaces import Namespaces
from kvtier.policy import write_policy
from kvtier.quotas import TenantShares
from kvtier.recovery import recover
from kvtier.reservations import ReservationTable
from kvtier.results import (
    Lease,
    LeaseState,
    LoadResult,
    LookupResult,
    Reservation,
    StoreResult,
)
from kvtier.status import TENANT_OPS, TenantCounters, store_status, tenant_status
from kvtier.tiers import GpuPool, HostPool, SlotPool, available_host_bytes, free_device_bytes
from kvtier.tiers.base import DISK, GPU, HOST, Tier
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.gpu import resolve_device
from kvtier.tiers.shm import segment_prefix
from kvtier.tokens import TOKEN_NBYTES, Tokens, encode_tokens
from kvtier.transfer import InlineExecutor
from kvtier.transfer.copy import Ledger, Transfer
from kvtier.transfer.demotion import Demoter, TierCounters
from kvtier.transfer.handles import Executor
from kvtier.transfer.mover import Mover
from kvtier.transfer.persist import persist
from kvtier.transfer.reads import DiskReader
from kvtier.transfer.threads import ThreadExecutor

PREFETCH_ATTEMPTS = 4
"""A waiting prefetch that meets a corrupt disk copy drops it and tries again, this often."""


class KVStore:
    def __init__(
        self,
        config: KVTierConfig | None = None,
        *,
        secret: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
        executor: Executor | None = None,
        shared_memory: str | None = None,
    ) -> None:
        """Build the pools and the index of `config` (the embedded default when None).
        `secret` keys the tenant salts (the sidecar persists one); `clock` drives leases.
        `executor` runs the background copies instead of the one the config implies (e.g. a
        throttled `ThreadExecutor`); the store closes it. Needs `mover.background: true`.
        `shared_memory`: a name base; the host pool and a CPU gpu pool then live in POSIX
        shared memory (/dev/shm/<base>-<pid>-<random>-<tier>, mode 0600), which clients map.
        A construction that fails closes the tiers it made (their shared memory unlinked)."""
        try:
            self._construct(config, secret, clock, executor, shared_memory)
        except BaseException:
            for made in ("gpu_pool", "host_pool", "disk"):
                tier = vars(self).get(made)
                if tier is not None:
                    tier.close()
            raise

    def _construct(
        self,
        config: KVTierConfig | None,
        secret: bytes,
        clock: Callable[[], float],
        executor: Executor | None,
        shared_memory: str | None,
    ) -> None:
        self.config = config if config is not None else KVTierConfig()
        self.layout = self.config.layout
        self.block_tokens = self.layout.block_tokens
        self._clock = clock
        self._lock = threading.RLock()
        self._closed = False
        gpu_cfg, host_cfg = self.config.tiers.gpu, self.config.tiers.host
        device = resolve_device(gpu_cfg.device)
        prefix = None if shared_memory is None else segment_prefix(shared_memory)
        self.gpu_pool: SlotPool = GpuPool.create(
            self.layout,
            gpu_cfg.capacity.resolve(free_device_bytes(device)),
            gpu_cfg.device,
            None if prefix is None else f"{prefix}-gpu",
        )
        self.host_pool: SlotPool = HostPool.create(
            self.layout,
            host_cfg.capacity.resolve(available_host_bytes()),
            host_cfg.pinned,
            None if prefix is None else f"{prefix}-host",
        )
        self.memory: list[SlotPool] = [self.gpu_pool, self.host_pool]
        self.pools: list[Tier] = [self.gpu_pool, self.host_pool]
        self.disk: DiskTier | None = None
        disk_cfg = self.config.tiers.disk
        if disk_cfg is not None:
            self.disk = DiskTier(
                self.layout,
                disk_cfg.path,
                disk_cfg.capacity.resolve(0),
                compression=disk_cfg.compression,
                fsync=disk_cfg.fsync,
            )
            self.pools.append(self.disk)
        self.tier_names = self.config.tier_names
        hasher = BlockHasher(self.config.hashing.algorithm)
        self.index = RadixIndex(self.tier_names, self.block_tokens, hasher)
        self.namespaces = Namespaces(self.config.tenants, hasher, self.layout.fingerprint, secret)
        # fair shares (quotas.py): floors steer eviction, quotas bound what a tenant holds
        self.shares = TenantShares(self.config, [pool.num_slots for pool in self.pools])
        self.index.set_floors(self.shares.floors(self.namespaces.seeds))
        self.tenant_counters = {
            tenant: TenantCounters(len(self.pools)) for tenant in self.namespaces.seeds
        }
        self.policy = write_policy(self.config.policy.write, self.config.policy.selective_hits)
        mover_cfg = self.config.mover
        if executor is not None and not mover_cfg.background:
            raise InvalidArgumentError(
                "executor: given, but mover.background is false (copies run in the caller)"
            )
        self.ledger = (
            Ledger() if executor is None else executor.ledger
        )  # every copy, inline or in the background, is counted here
        self.executor = InlineExecutor(self.ledger)  # copies made inside a call
        background = self._background_executor() if executor is None else executor
        # room made inside a call: on CUDA through the copy streams, which see the engine's marks
        runner = background.in_call_runner(self.executor)
        self.counters = [TierCounters() for _ in self.pools]
        admission = [0, self.policy.min_hits_to_keep, self.config.policy.disk_admission_hits]
        self.demoter = Demoter(
            self.index,
            self.pools,
            runner,
            admission,
            self.counters,
            self.namespaces,
            reserved=lambda tier: self.mover.reserved(tier) + self.reservations.held(tier),
            sync_disk=not mover_cfg.background,
        )
        self.ops: dict[str, int] = dict.fromkeys(
            (*TENANT_OPS, "leases_expired", "corrupt_dropped"), 0
        )
        self.reader = DiskReader(self.index, self.pools, self.executor, self.ops)
        self.recovery = recover(self) if self.disk is not None else {}
        self.reservations = ReservationTable(
            self.memory, self.index.leases, self._clock, self.config.policy.reservation_quarantine_s
        )
        self.mover = Mover(
            index=self.index,
            pools=self.pools,
            demoter=self.demoter,
            counters=self.counters,
            ops=self.ops,
            clock=self._clock,
            lock=self._lock,
            executor=background,
            background=mover_cfg.background,
            watermarks=[
                (tier.high_watermark, tier.low_watermark)
                for tier in (self.config.tiers.gpu, self.config.tiers.host)
            ],
            admission=admission,
            layer_groups=mover_cfg.layer_groups,
            keep_host_copy=self.policy.copy_on_store,
            lift_on_lookup=mover_cfg.lift_on_lookup,
        )
        # a store dropped without close(): its copy threads end (the mover's thread ends alone)
        weakref.finalize(self, background.close)

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> KVStore:
        return cls(load_config(path), **kwargs)

    def _background_executor(self) -> Executor:
        cfg = self.config.mover
        if not cfg.background:
            return self.executor
        if self.gpu_pool.device.type == "cuda":
            from kvtier.transfer.cuda import CudaExecutor

            return CudaExecutor(self.gpu_pool.device, ledger=self.ledger)
        return ThreadExecutor(cfg.workers_per_path, ledger=self.ledger)

    # ---- the engine contract -------------------------------------------------------------

    def lookup(self, tokens: Tokens, *, tenant: str = "default") -> LookupResult:
        """Cached leading tokens of `tokens`, split by tier. Changes only recency."""
        key = encode_tokens(tokens)
        with self._lock:
            namespace = self._namespace(tenant)
            hit = self.index.lookup(namespace, key)
            own = self.tenant_counters[tenant]
            for ops in (self.ops, own.ops):
                ops["lookups"] += 1
                ops["lookup_tokens"] += len(key) // TOKEN_NBYTES
                ops["hit_tokens"] += hit.num_blocks * self.block_tokens
            bt = self.block_tokens
            by_tier = hit.tier_blocks
            for tier, count in enumerate(by_tier):
                self.counters[tier].hits += count
                own.hits[tier] += count
            if self.mover.lift_on_lookup and by_tier[0] < hit.num_blocks:
                self.mover.note_lookup(namespace, key[: hit.num_blocks * self.index.key_nbytes])
            disk = by_tier[2] if len(by_tier) > 2 else 0
            return LookupResult(hit.num_blocks * bt, by_tier[0] * bt, by_tier[1] * bt, disk * bt)

    def store(self, tokens: Tokens, kv: torch.Tensor, *, tenant: str = "default") -> StoreResult:
        """Cache the full blocks of `tokens` that are not cached yet, with their KV.

        `kv` is `[num_layers, 2, len(tokens), num_kv_heads, head_dim]`. New blocks go to the
        fastest tier that prefix closure allows (gpu, unless the cached prefix before them has
        left the gpu) and, under `write_through`, to host as well. If no tier can make room for
        all of them (everything evictable is leased), nothing is stored and they are counted as
        dropped. Below a prefix that lives only on disk they go to disk: written in the
        background (`pending_tokens`) with a background mover, in this call without one."""
        key = encode_tokens(tokens)
        num_tokens = len(key) // TOKEN_NBYTES
        check_kv(self.layout, kv, num_tokens)
        with self._lock:
            namespace = self._namespace(tenant)
            self._expire()
            result = self._store_new(namespace, key, kv)
            for ops in (self.ops, self.tenant_counters[tenant].ops):
                ops["stores"] += 1
                ops["stored_tokens"] += result.stored_tokens
                ops["dropped_tokens"] += result.dropped_tokens
            return result

    def _store_new(self, namespace: BlockId, key: bytes, kv: torch.Tensor) -> StoreResult:
        """`store`'s work, lock held. Room is made for `namespace` (fair shares)."""
        bt = self.block_tokens
        match = self.index.match(namespace, key)
        new_blocks = len(key) // self.index.key_nbytes - match.num_blocks
        if new_blocks <= 0:
            return StoreResult(match.num_blocks * bt, 0, 0)
        pin = self.index.leases.acquire(match.end, self._all_tiers, math.inf, 0, resident=False)
        try:
            slots = self._place(match, new_blocks)
        finally:
            # the pin guards the match while room is made; unpinned, a leaf grows in place
            self.index.leases.release(pin.lease_id)
        start = match.num_blocks * bt
        blocks = to_blocks(kv[:, :, start : start + new_blocks * bt], bt)
        if slots is None and self._tail_on_disk(match) and self.mover.background:
            tenant_name = self._tenant_name(namespace)
            pending = self.mover.insert_on_disk(match, key, blocks, namespace, tenant_name)
            return StoreResult(match.num_blocks * bt, 0, (new_blocks - pending) * bt, pending * bt)
        if slots is None and self._tail_on_disk(match):
            stored = self._store_to_disk(match, key, blocks, namespace)
            return StoreResult(
                (match.num_blocks + stored) * bt, stored * bt, (new_blocks - stored) * bt
            )
        if slots is None:
            return StoreResult(match.num_blocks * bt, 0, new_blocks * bt)
        for tier, tier_slots in slots.items():
            self.memory[tier].write(tier_slots, blocks)
        self._mark_engine()  # CUDA: background copies of these slots wait for the writes
        self.index.insert(match, key, slots)
        self._enforce_watermarks()
        return StoreResult((match.num_blocks + new_blocks) * bt, new_blocks * bt, 0)

    def reserve(
        self, tokens: Tokens, *, tenant: str = "default", ttl_s: float | None = None
    ) -> Reservation:
        """Slots for the new full blocks of `tokens`, for a zero-copy writer: write block i's
        KV (`[num_layers, 2, block_tokens, kv_heads, head_dim]`) into slot `slots[i]` of tier
        `tier`'s pool buffer, then `commit` (or `abort`). Placement is `store`'s; nothing is
        visible before the commit. A reservation that cannot be placed (no room, or new blocks
        below a disk-only prefix, which need `store`) reserves nothing (`num_tokens` 0, id 0).

        The id is random (`ids.py`). Before returning, a random canary word is planted in every
        4 KiB page of each slot to write (`canaries.py`): `commit` refuses slots that still hold
        one, so a slot never publishes what an earlier user left there. Unclaimed reservations
        expire like leases; their slots stay allocated in quarantine for
        `policy.reservation_quarantine_s`, so that a late writer writes where no one reads
        (`reservations.py`)."""
        key = encode_tokens(tokens)
        ttl = self._ttl(ttl_s)
        with self._lock:
            namespace = self._namespace(tenant)
            self._expire()
            bt = self.block_tokens
            match = self.index.match(namespace, key)
            new_blocks = len(key) // self.index.key_nbytes - match.num_blocks
            if new_blocks > 0:  # its pin locks the prefix for the tenant: within its quota
                locking = self.index.leases.unheld_blocks(match.end)
                holding = self._holding(tenant, namespace, GPU)
                self.shares.admit(tenant, GPU, holding, locking, "a reservation's prefix")
            pin = self.index.leases.acquire(
                match.end, self._all_tiers, math.inf, 0, resident=False, held=True
            )
            try:
                slots = self._place(match, new_blocks, tenant) if new_blocks > 0 else None
            except QuotaError:
                self.index.leases.release(pin.lease_id)
                raise
            if slots is None:
                self.index.leases.release(pin.lease_id)
                return Reservation(0, tenant, match.num_blocks * bt, 0, "gpu", (), 0.0)
            tier = min(slots)
            reservation = Reservation(
                0,  # the table draws the id
                tenant,
                match.num_blocks * bt,
                new_blocks * bt,
                self.tier_names[tier],
                tuple(slots[tier]),
                self._clock() + ttl,
            )
            return self.reservations.open(reservation, namespace, key, pin.lease_id, slots)

    def commit(self, reservation: Reservation | int) -> StoreResult:
        """Make a reservation's blocks visible after the caller wrote them, as `store` would
        have (under write_through, the host copy is made here, from the written slots).
        `LeaseError` if it is unknown, committed, aborted or expired (commit after expiry always
        fails). `NotWrittenError` if a slot still holds a canary (not written whole): nothing
        is published and the reservation stays live, to be written and committed, or aborted."""
        with self._lock:
            self._ensure_open()
            self._expire()
            entry = self.reservations.take_written(reservation)
            namespace, key, slots = entry.namespace, entry.key, entry.slots
            bt, kb = self.block_tokens, self.index.key_nbytes
            tier = min(slots)
            first_block = len(key) // kb - len(slots[tier])
            for other, other_slots in slots.items():  # write_through: the host copy, now
                if other != tier:
                    self.executor.run(
                        Transfer(
                            self.pools[tier], tuple(slots[tier]), self.pools[other],
                            tuple(other_slots),
                        )
                    )  # fmt: skip
            match = self.index.match(namespace, key)
            skip = max(0, match.num_blocks - first_block)  # stored meanwhile by someone else
            for t, tier_slots in slots.items():
                self.pools[t].free(tier_slots[:skip])
            new = {t: tier_slots[skip:] for t, tier_slots in slots.items()}
            count = len(new[tier])
            if count:
                self.index.insert(match, key, new)
                self._mark_engine()
            for ops in (self.ops, self.tenant_counters[entry.reservation.tenant].ops):
                ops["stores"] += 1
                ops["stored_tokens"] += count * bt
            self._enforce_watermarks()
            return StoreResult((match.num_blocks + count) * bt, count * bt, 0)

    def abort(self, reservation: Reservation | int) -> None:
        """Give a reservation's slots back unwritten, free at once (its holder says it is
        done with them). `LeaseError` if it is not live."""
        with self._lock:
            self._ensure_open()
            self._expire()
            self.reservations.abort(reservation)

    def load(
        self, tokens: Tokens, *, tenant: str = "default", device: torch.device | str | None = None
    ) -> LoadResult:
        """The KV of the cached prefix of `tokens`, read from the fastest copy of each block,
        as a new tensor on `device` (default: the gpu tier's device)."""
        key = encode_tokens(tokens)
        wanted = check_device(device)
        with self._lock:
            namespace = self._namespace(tenant)
            self._expire()
            match = self.index.match(namespace, key)
            target = wanted if wanted is not None else self.gpu_pool.device
            blocks = torch.empty(
                (match.num_blocks, *self.layout.block_shape), dtype=self.layout.dtype, device=target
            )
            by_tier: dict[int, tuple[list[int], list[int]]] = {}
            for position, ref in enumerate(self.index.blocks(match.end)):
                tier = ref.node.fastest(ref.i)
                slot = ref.node.slots[tier][ref.i]
                assert slot is not None
                positions, slots = by_tier.setdefault(tier, ([], []))
                positions.append(position)
                slots.append(slot)
            count = match.num_blocks
            for tier, (positions, slots) in sorted(by_tier.items()):
                if tier == DISK:
                    refs = list(self.index.blocks(match.end))[positions[0] :]
                    data, good = self.reader.read_disk(refs)
                    blocks[positions[0] : positions[0] + good] = data[:good].to(target)
                    count = positions[0] + good
                else:
                    data = self.memory[tier].read(slots).to(target)
                    blocks[positions[0] : positions[-1] + 1] = data  # closure: one run per tier
            self._copy_hot_to_host(match.end)
            for ops in (self.ops, self.tenant_counters[tenant].ops):
                ops["loads"] += 1
                ops["loaded_tokens"] += count * self.block_tokens
            return LoadResult(count * self.block_tokens, from_blocks(blocks[:count]))

    def prefetch(
        self,
        tokens: Tokens,
        *,
        tenant: str = "default",
        ttl_s: float | None = None,
        wait: bool = True,
    ) -> Lease:
        """Bring the whole cached prefix of `tokens` to the gpu tier and lease it there.

        All or nothing: if the gpu tier cannot hold the prefix beside what is leased, raise
        `CapacityError` and lease nothing. A prefix with no cached block gives an empty lease
        (num_tokens 0), which must be released like any other.

        With `wait` (the default) return once the lease is READY; a corrupt disk copy met on the
        way is dropped and the prefix shrinks to what is intact. With `wait=False` return the
        lease at once, PENDING while its copies run: `lease.wait(timeout)`, `await lease` and
        `lease.wait_layer(l)` wait for it (`results.Lease`); a prefix already in flight is
        joined, not copied twice."""
        key = encode_tokens(tokens)
        ttl = self._ttl(ttl_s)
        if type(wait) is not bool:
            raise InvalidArgumentError(f"wait: got {wait!r}, expected True or False")
        for attempt in range(PREFETCH_ATTEMPTS):
            with self._lock:
                namespace = self._namespace(tenant)
                self._expire()
                match = self.mover.match_prefix(namespace, key)
                self.shares.admit_lease(
                    tenant,
                    self.mover.leases_of(tenant),
                    self._holding(tenant, namespace, GPU),
                    self.index.leases.unheld_blocks(match.end),
                )
                lease = self.mover.prefetch(match, tenant, self._clock() + ttl, self.cancel)
                if lease.lease_id in self.index.leases:  # (an inline prefetch may have failed)
                    self._copy_hot_to_host(self.index.leases.get(LeaseId(lease.lease_id)).end)
                self.ops["prefetches"] += 1
                self.tenant_counters[tenant].ops["prefetches"] += 1
            if not wait:
                return lease
            try:
                lease.wait()  # bounded: a lease that never becomes ready expires
                return lease
            except LeaseError:
                if lease.state is not LeaseState.FAILED or attempt + 1 == PREFETCH_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def cancel(self, lease: Lease) -> None:
        """Cancel a pending lease (its copies still land; nothing waits on them) or release a
        ready one. `LeaseError` if it is not live."""
        if not isinstance(lease, Lease):
            raise InvalidArgumentError(f"lease: got {lease!r}, expected a Lease")
        with self._lock:
            self._ensure_open()
            self.mover.cancel(lease)

    def release(self, lease: Lease | int) -> None:
        """Unlock a lease. `LeaseError` if it is unknown, released or expired."""
        raw = lease.lease_id if isinstance(lease, Lease) else lease
        if type(raw) is not int:
            raise InvalidArgumentError(
                f"lease: got {lease!r}, expected a Lease or a lease id (int)"
            )
        lease_id = LeaseId(raw)
        with self._lock:
            self._ensure_open()
            self._expire()
            self.mover.release(lease_id)
            self._mark_engine()  # CUDA: a copy into these slots waits for the engine's reads

    def lease(self, lease_id: int, *, tenant: str | None = None) -> Lease:
        """The live lease `lease_id` (of `tenant`, when given); `LeaseError` otherwise, the
        same for another tenant's lease as for none, so that ids reveal nothing."""
        with self._lock:
            self._ensure_open()
            self._expire()
            lease = self.mover.leases.get(LeaseId(lease_id)) if type(lease_id) is int else None
            if lease is None or (tenant is not None and lease.tenant != tenant):
                raise LeaseError(f"lease {lease_id!r}: unknown, released or expired")
            return lease

    def reservation(self, reservation_id: int, *, tenant: str | None = None) -> Reservation:
        """The live reservation `reservation_id` (of `tenant`, when given), else `LeaseError`,
        the same for another tenant's reservation as for none, so that ids reveal nothing."""
        with self._lock:
            self._ensure_open()
            self._expire()
            return self.reservations.get(reservation_id, tenant).reservation

    def clear(self, tenant: str | None = None) -> int:
        """Drop every cached block (of `tenant`, when given) that no lease, pin or reservation
        holds, in every tier; return how many blocks were dropped. The drop is durable: the
        dropped blocks' disk copies are retired and synced before this returns. Where the disk
        refuses that, the blocks are dropped all the same (nothing serves them) and
        `StorageError` says how many, and how many disk copies may come back at the next start
        (to be cleared again then)."""
        with self._lock:
            self._ensure_open()
            self._expire()
            self.mover.drain()
            namespaces = (
                list(self.namespaces.seeds.values())
                if tenant is None
                else [self._namespace(tenant)]
            )
            dropped = 0
            on_disk: list[int] = []
            for namespace in namespaces:
                root = self.index.root(namespace)
                for child in list(root.children.values()) if root.children else []:
                    if any(child.locked(t) for t in self._all_tiers) or _below_locked(child):
                        continue
                    before = self.index.num_blocks
                    for tier, slot in self.index.drop_subtree(BlockRef(child, 0)):
                        if tier == DISK:
                            on_disk.append(slot)
                        else:
                            self.pools[tier].free([slot])
                    dropped += before - self.index.num_blocks
            left = self.disk.free_durably(on_disk) if self.disk is not None and on_disk else 0
            if left:
                assert self.disk is not None
                raise StorageError(
                    f"clear: {dropped} blocks were dropped, but the disk refused to retire "
                    f"{left} of their {len(on_disk)} disk copies "
                    f"({self.disk.backoff.last_error}): up to {left} of these blocks may come "
                    "back after a restart; clear again then"
                )
            return dropped

    def leased_slots(self) -> frozenset[int]:
        """The gpu slots that READY leases cover now: while one of them lives, each of these
        slots holds one fixed block (what kernels may read, `kernels/attention.py`)."""
        with self._lock:
            self._ensure_open()
            self._expire()
            return frozenset(
                slot
                for lease in self.mover.leases.values()
                if lease.ready()
                for slot in lease.block_table
            )

    def leases(self) -> list[Lease]:
        """The live leases."""
        with self._lock:
            self._ensure_open()
            self._expire()
            return list(self.mover.leases.values())

    # ---- operations ------------------------------------------------------------------------

    def persist(self) -> int:
        """Give every cached block a durable disk copy now; return how many were written.
        Blocks stay where they are; a restart recovers everything persisted (`persist.py`).
        Without a disk tier there is nothing to persist to: `InvalidArgumentError`."""
        with self._lock:
            self._ensure_open()
            if self.disk is None:
                raise InvalidArgumentError("persist: this store has no disk tier (tiers.disk)")
            self.mover.drain()  # what was stored before this call is in the index
            self._expire()
            return persist(self.index, self.pools, self.executor, self.demoter)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Do the mover's pending work now and wait for every copy in flight: watermark
        demotion, disk writes, prefetches. True if it is all in the index within `timeout_s`
        (for checkpoints, benchmarks and tests; the mover does the same on its own)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._ensure_open()
            while True:
                self.mover.step()
                if not self.mover.drain(max(0.0, deadline - time.monotonic())):
                    return False
                self.mover.step()
                if self.mover.idle():
                    return True

    def evict(self, tier: str, num_blocks: int) -> int:
        """Free up to `num_blocks` slots of `tier` by demotion; return how many were freed."""
        if tier not in self.tier_names:
            raise InvalidArgumentError(f"tier: got {tier!r}, expected one of {self.tier_names}")
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks: got {num_blocks!r}, expected an int >= 0")
        with self._lock:
            self._ensure_open()
            self._expire()
            pool = self.pools[self.tier_names.index(tier)]
            before = pool.num_free
            self.demoter.make_room(
                self.tier_names.index(tier), min(pool.num_slots, before + num_blocks)
            )
            return pool.num_free - before

    def status(self, tenant: str | None = None) -> dict[str, Any]:
        """A JSON-able snapshot (`status.py`): with `tenant` None, the global one (tiers, index,
        leases, mover, counters: for the admin); with a tenant, that tenant's own figures only
        (its blocks, quota use and limits, floors, leases and counters)."""
        with self._lock:
            self._ensure_open()
            if tenant is not None:
                namespace = self._namespace(tenant)
                self._expire()
                return tenant_status(self, tenant, namespace)
            self.mover.reap()
            self._expire()
            return store_status(self)

    def check(self) -> None:
        """Verify DESIGN invariants 2-5 across index, pools, mover, leases and reservations
        (each live or quarantined reservation slot allocated and held once; a pool's used slots
        equal to its resident blocks plus flights' and reservations' slots); raise
        `InvariantError`. Safe to call while the mover runs: it holds the store's lock."""
        with self._lock:
            self._ensure_open()
            self.index.check()
            self.mover.check()
            self.reservations.check()  # its slots allocated, once each: then the sums below
            for tier, pool in enumerate(self.pools):
                pool.check()
                in_index = self.index.resident(tier)
                reserved = self.mover.reserved(tier) + self.reservations.held(tier)
                if pool.num_used != in_index + reserved:
                    raise InvariantError(
                        f"{pool.name}: {pool.num_used} slots in use but {in_index} blocks "
                        f"resident in the index and {reserved} held by flights and reservations "
                        f"(live or quarantined) "
                        f"({pool.used_bytes} bytes vs "
                        f"{(in_index + reserved) * self.layout.block_bytes})"
                    )
            leases = self.mover.leases
            pins = self.mover.pin_ids() | self.reservations.pins()
            indexed = {r.lease_id for r in self.index.leases}
            if set(leases) | pins != indexed:
                raise InvariantError(
                    f"leases: store has {sorted(leases)} and pins {sorted(pins)}, "
                    f"index {sorted(indexed)}"
                )
            for lease in leases.values():
                record = self.index.leases.get(LeaseId(lease.lease_id))
                refs = list(self.index.blocks(record.end))
                now = tuple(
                    ref.node.slots[GPU][ref.i]
                    if ref.node.slots[GPU][ref.i] is not None or lease.ready()
                    else self.mover.gpu_slot_in_flight(self.index.block_id(ref))
                    for ref in refs
                )
                if now != lease.block_table:
                    raise InvariantError(
                        f"lease {lease.lease_id} ({lease.state.value}): block table "
                        f"{lease.block_table} but gpu slots (or slots in flight) are now {now}"
                    )

    def close(self) -> None:
        """End every lease, wait (bounded) for copies in flight, free the pools. Later calls
        raise `ClosedError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.mover.close()  # without the lock: the mover thread takes it to stop
        with self._lock:
            for pool in self.pools:
                pool.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------

    def _namespace(self, tenant: str) -> BlockId:
        self._ensure_open()
        return self.namespaces.seed(tenant)

    def _ensure_open(self) -> None:
        if self._closed:
            raise ClosedError("the store is closed")

    def _expire(self) -> None:
        self.ops["leases_expired"] += self.mover.expire()
        self.reservations.expire()

    def _ttl(self, ttl_s: float | None) -> float:
        """The ttl of a lease or reservation: `ttl_s`, or the default; at most
        `policy.max_ttl_s`, so that no one pins a tier for long (DESIGN invariant 9)."""
        ttl = self.config.policy.lease_ttl_s if ttl_s is None else ttl_s
        longest = self.config.policy.max_ttl_s
        if isinstance(ttl, bool) or not (isinstance(ttl, (int, float)) and 0 < ttl <= longest):
            raise InvalidArgumentError(
                f"ttl_s: got {ttl_s!r}, expected a number of seconds in (0, {longest}] "
                f"(policy.max_ttl_s)"
            )
        return float(ttl)

    def _holding(self, tenant: str, namespace: BlockId, tier: int) -> int:
        """What `tenant` holds of `tier` against its quota (`quotas.py`): its reserved slots
        (live or in quarantine) and, on gpu, the blocks its leases and reservation pins lock."""
        reserved = self.reservations.held(tier, tenant)
        return reserved + self.index.leases.held_blocks(namespace) if tier == GPU else reserved

    def _place(
        self, match: Match, count: int, reserver: str | None = None
    ) -> dict[int, list[int]] | None:
        """Slots for `count` new blocks after `match`: the fastest tier that closure allows and
        that can make room, plus host under write_through. None when no tier can. Room is made
        for the namespace of `match` (fair shares). For a reservation of `reserver`, the slots
        count against its quota: `QuotaError` (nothing moved yet) if the tier it would take
        is full to it; a write_through host copy over its host quota is left out."""
        owner = match.end.root.ids
        first = 0 if match.end.parent is None else match.end.fastest(match.end.size - 1)
        for tier in range(first, min(len(self.pools), DISK)):
            if not self.demoter.can_make_room(tier, count, owner):
                continue
            if reserver is not None:
                holding = self._holding(reserver, BlockId(owner), tier)
                self.shares.admit(reserver, tier, holding, count, "a reservation")
            if not self.demoter.make_room(tier, count, owner):
                continue
            slots = {tier: self.pools[tier].allocate(count)}
            copy = tier == GPU and self.policy.copy_on_store
            if copy and reserver is not None:
                holding = self._holding(reserver, BlockId(owner), HOST)
                copy = self.shares.fits(reserver, HOST, holding, count)
            if copy and self.demoter.make_room(HOST, count, owner):
                slots[HOST] = self.pools[HOST].allocate(count)
            return slots
        return None

    def _tail_on_disk(self, match: Match) -> bool:
        end = match.end
        return (
            self.disk is not None and end.parent is not None and end.fastest(end.size - 1) == DISK
        )

    def _store_to_disk(
        self, match: Match, key: bytes, blocks: torch.Tensor, namespace: BlockId
    ) -> int:
        """New blocks below a prefix that lives only on disk go to disk (prefix closure), as one
        group commit; the leading blocks that became durable enter the index. Returns them."""
        assert self.disk is not None
        count = blocks.shape[0]
        owner = bytes(namespace)
        if not (
            self.demoter.can_make_room(DISK, count, owner)
            and self.demoter.make_room(DISK, count, owner)
        ):
            return 0
        kb, ds = self.index.key_nbytes, self.index.digest_size
        start = match.num_blocks * kb
        new_key = key[start : start + count * kb]
        ids = self.index.hasher.chain(match.end.ids[-ds:], new_key, kb)
        tenant = self._tenant_name(namespace)
        metas = [
            BlockMeta(
                ids[i * ds : (i + 1) * ds],
                ids[(i - 1) * ds : i * ds] if i else match.end.ids[-ds:],
                namespace,
                tenant,
                new_key[i * kb : (i + 1) * kb],
            )
            for i in range(count)
        ]
        slots = self.disk.allocate(count)
        ok = self.disk.write_blocks(slots, blocks.contiguous(), metas)
        good = ok.index(False) if False in ok else count
        self.disk.free(slots[good:])
        if good:
            self.index.insert(match, key[: start + good * kb], {DISK: slots[:good]})
        return good

    def _copy_hot_to_host(self, end: Node) -> None:
        """`selective` write policy: a gpu block hit `selective_hits` times gets its host copy
        now (one batched copy), so that its demotion later costs no copy and no drop."""
        if self.policy.copy_on_hits is None:
            return
        wanted = [
            ref
            for ref in self.index.blocks(end)
            if ref.node.hits >= self.policy.copy_on_hits
            and ref.node.slots[GPU][ref.i] is not None
            and ref.node.slots[HOST][ref.i] is None
        ]
        if not wanted or not self.demoter.make_room(HOST, len(wanted), end.root.ids):
            return
        dst = self.host_pool.allocate(len(wanted))
        src = tuple(self._slot(ref.node.slots[GPU][ref.i]) for ref in wanted)
        self.executor.run(Transfer(self.gpu_pool, src, self.host_pool, tuple(dst)))
        for ref, slot in zip(wanted, dst, strict=True):
            self.index.set_slot(ref, HOST, slot)

    def _tenant_name(self, namespace: BlockId) -> str:
        tenant = self.namespaces.tenant_of(namespace)
        assert tenant is not None, "the index holds only configured tenants' namespaces"
        return tenant

    @property
    def _all_tiers(self) -> tuple[int, ...]:
        return tuple(range(len(self.pools)))

    def _mark_engine(self) -> None:
        self.mover.executor.mark_engine()

    def _enforce_watermarks(self) -> None:
        if self.mover.background:  # the mover thread demotes, outside this call
            self.mover.kick()
            return
        for tier, pool in enumerate(self.pools[:DISK]):
            if tier + 1 == len(self.pools):  # nothing below: the lowest tier drops on demand only
                break
            tier_cfg = getattr(self.config.tiers, pool.name)
            if pool.num_used > tier_cfg.high_watermark * pool.num_slots:
                self.demoter.demote_to(tier, int(tier_cfg.low_watermark * pool.num_slots))

    @staticmethod
    def _slot(slot: int | None) -> int:
        assert slot is not None
        return slot


def _below_locked(node: Node) -> bool:
    """Whether anything below `node` is locked in some tier."""
    stack = list(node.children.values()) if node.children else []
    while stack:
        child = stack.pop()
        if child.locks is not None and any(child.locks):
            return True
        stack.extend(child.children.values() if child.children else ())
    return False
