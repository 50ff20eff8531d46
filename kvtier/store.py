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
- `lookup` changes only recency; `load` returns a new tensor, or the part of `out` it wrote;
  `prefetch` is all or nothing.
- When a tier needs room now, its least-recently-used unleased leaves move down (gpu -> host)
  and the lowest tier drops leaves (`transfer/demotion.py`); in a store without a host tier
  (`tiers.host: null`, then without disk too) gpu is the lowest.
- The mover (`transfer/mover.py`, `mover.background`) runs copies on worker threads (CUDA
  streams for a CUDA gpu tier): `prefetch(wait=False)` returns a PENDING lease to wait on,
  watermark demotion and disk writes happen behind the caller, and `store()` never waits on
  the disk (what cannot be placed is dropped and counted). With `background: false` every copy
  runs in the calling thread and every call returns with its copies done.
- Per process (`home.py`): in another than the one that built it (a forked child), every call
  raises `ClosedError` before it reads or writes anything; build one store per process.
- Thread-safe: one lock serialises calls; copies run outside it. Leases expire after
  `policy.lease_ttl_s` seconds of the store's clock; no call may ask for more than
  `policy.max_ttl_s`.
- Fair shares (`shares.py`, DESIGN invariant 9): what a tenant's leases and reservations hold
  is bounded by its quota (`QuotaError` past it, nothing changed), and room made for a
  tenant's call comes from blocks above other tenants' floors, or from its own, never from
  another tenant at or under its floor. `status(tenant)` is that tenant's own figures.
- Zero-copy writers (`reserve`, write the slots, `commit`) publish only what they wrote (DESIGN
  invariant 8): `commit` refuses (`NotWrittenError`) a slot that still holds a canary planted at
  `reserve`, and an expired reservation's slots stay allocated and unread in quarantine for
  `policy.reservation_quarantine_s` before anyone else gets them (`tenancy.py`).
- Lease and reservation ids are random 63-bit numbers (`blocks.py`): they count nothing and are
  not guessable; another tenant's id is refused exactly like one never issued.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.arguments import check_flags, check_store_args, ttl_of
from kvtier.assembly import Parts
from kvtier.blocks import TOKEN_NBYTES, Tokens, check_device, check_start, encode_tokens
from kvtier.caller_kv import Destination, KVKind, kv_layout, pool_buffers, store_blocks
from kvtier.config import KVTierConfig, load_config
from kvtier.errors import InvalidArgumentError, LeaseError, shown
from kvtier.index import LeaseId
from kvtier.operations import Operations, check_release
from kvtier.results import Lease, LeaseState, LoadResult, LookupResult, Reservation, StoreResult
from kvtier.tiers.base import GPU
from kvtier.transfer.mover import Landing
from kvtier.transfer.persist import Persisted, persisted
from kvtier.transfer.shared import Executor
from kvtier.writes import gpu_need

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
        """Build the pools and index of `config` (None: the embedded default) by `assembly.Parts`,
        whose public names are this store's too; a failed construction closes its tiers. `secret`
        keys the tenant salts unless `tiers.remote.secret` does (b"" if none: such stores share
        them, in a cluster too); `clock` drives leases; `executor` runs background copies
        (`mover.background`; closed with the store). `shared_memory`: a name base, the host and
        a CPU gpu pool then in /dev/shm/<base>-<pid>-<random>-<tier> (0600). Per process only."""
        check_store_args(config, secret, clock)
        self.parts = parts = Parts(config, secret, clock, executor, shared_memory)
        self.config, self.layout = parts.config, parts.config.layout
        self.block_tokens, self.tier_names = self.layout.block_tokens, self.config.tier_names
        self.index, self.pools, self.memory = parts.state.index, parts.pools, parts.memory
        state = parts.state  # host: a pool of no slots in a store without one (`NoHostPool`)
        self.gpu_pool, self.host_pool, self.disk = state.gpu, state.host, state.disk
        self.namespaces, self.shares, self.policy = parts.namespaces, parts.shares, parts.policy
        self.ops, self.counters = parts.state.ops, parts.state.counters
        self.tenant_counters, self.recovery = parts.tenant_counters, parts.recovery
        self.executor, self.demoter, self.mover = parts.executor, parts.demoter, parts.mover
        self.reservations, self.residency = parts.reservations, parts.mover.residency
        self._writes, self._clock, self.operations = parts.writes, clock, Operations(parts)
        self._lock = self.operations.lock  # the cache's lock, in this process only (`home.py`)
        # a store dropped without close(): its copy threads end (the mover's thread ends alone)
        weakref.finalize(self, parts.mover.executor.close)

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> KVStore:
        return cls(load_config(path), **kwargs)

    # ---- the engine contract -------------------------------------------------------------

    def lookup(self, tokens: Tokens, *, tenant: str = "default") -> LookupResult:
        """Cached leading tokens of `tokens`, split by tier (a remote tier's past the local ones).
        Changes only recency (the blocks it matched are used now; a node matched in part is
        split so that its tail is not)."""
        key = encode_tokens(tokens)
        with self._lock:
            namespace = self.operations.namespace(tenant)
            hit = self.index.lookup(namespace, key)
            bt, by_tier = self.block_tokens, hit.tier_blocks
            self.operations.count_lookup(
                tenant, len(key) // TOKEN_NBYTES, hit.num_blocks * bt, by_tier
            )
            if self.mover.lift_on_lookup and by_tier[0] < hit.num_blocks:
                self.mover.note_lookup(namespace, key[: hit.num_blocks * self.index.key_nbytes])
            disk = by_tier[2] if len(by_tier) > 2 else 0
            local = LookupResult(hit.num_blocks * bt, by_tier[0] * bt, by_tier[1] * bt, disk * bt)
        return self.operations.with_remote(local, key, namespace, tenant)

    def store(
        self,
        tokens: Tokens,
        kv: torch.Tensor,
        *,
        tenant: str = "default",
        start: int = 0,
        layout: str = "layers",
    ) -> StoreResult:
        """Cache the full blocks of `tokens` not cached yet, with their KV `[num_layers, 2,
        len(tokens) - start, kv_heads, head_dim]` (`layout` "blocks": pages `[blocks,
        *block_shape]`; read into the slots in one pass, `caller_kv.py`) of the tokens from
        `start` (a multiple of `block_tokens`: a writer that holds only a tail) on, stored only
        if the blocks before `start` are cached. New blocks go to the fastest tier prefix
        closure allows (gpu, unless the prefix before them left it) and, under
        `write_through`, to host too. No room (everything evictable leased): nothing stored,
        counted dropped (room for some only: the first ones). Below a disk-only prefix they go
        to disk (in the background with a background mover). With a background mover behind
        on disk writes, it first waits, at most `mover.store_wait_s`, without the lock."""
        key = encode_tokens(tokens)
        first, blocks = store_blocks(self.layout, key, kv, start, kv_layout(layout), self.memory)
        self.mover.throttle(*_ahead(self, tenant, key, first))  # (without the lock)
        with self._lock:
            namespace = self.operations.namespace(tenant)
            self.operations.expire()
            result = self._writes.store_new(namespace, tenant, key, blocks, first)
            self.operations.count(
                tenant,
                stores=1,
                stored_tokens=result.stored_tokens,
                dropped_tokens=result.dropped_tokens,
            )
            return result

    def reserve(self, tokens: Tokens, *, tenant: str = "default", ttl_s: float | None = None,
                release: Sequence[int] = ()) -> Reservation:  # fmt: skip
        """Slots for the new full blocks of `tokens`, for a zero-copy writer: write block i's
        KV (`[num_layers, 2, block_tokens, kv_heads, head_dim]`) into slot `slots[i]` of tier
        `tier`'s pool buffer, then `commit` (or `abort`). Placement is `store`'s; nothing is
        visible before the commit. A reservation that cannot be placed (no room, or new blocks
        below a prefix that lives on disk or in a quantized host tier, which need `store`)
        reserves nothing (`num_tokens` 0, id 0); room for some only: the first (`num_tokens`
        says how many; the commit counts the rest dropped).

        The id is random (`blocks.py`). Before returning, a random canary word is planted in every
        4 KiB page of each slot to write (`canaries.py`): `commit` refuses slots that still hold
        one, so a slot never publishes what an earlier user left there. Unclaimed reservations
        expire like leases; their slots stay allocated in quarantine for
        `policy.reservation_quarantine_s`, so that a late writer writes where no one reads
        (`tenancy.py`). `release`: as `prefetch`'s."""
        key, ttl = encode_tokens(tokens), ttl_of(self.config.policy, ttl_s)
        self.mover.throttle(*_ahead(self, tenant, key, reserver=tenant, release=release))
        with self._lock:
            namespace = self.operations.namespace(tenant)
            self.operations.release_done(release, tenant)
            return self._writes.reserve(namespace, tenant, key, self._clock() + ttl)

    def commit(self, reservation: Reservation | int) -> StoreResult:
        """Make a reservation's blocks visible after the caller wrote them, as `store` would
        have (under write_through, the host copy is made here, from the written slots).
        `LeaseError` if it is unknown, committed, aborted or expired (commit after expiry always
        fails). `NotWrittenError` if a slot still holds a canary (not written whole): nothing
        is published and the reservation stays live, to be written and committed, or aborted."""
        with self._lock:
            self.operations.ensure_open()
            self.operations.expire()
            entry = self.reservations.take_written(reservation)
            result = self._writes.publish_reserved(entry)
            done = {"stored_tokens": result.stored_tokens, "dropped_tokens": result.dropped_tokens}
            self.operations.count(entry.reservation.tenant, stores=1, **done)
            return result

    def abort(self, reservation: Reservation | int) -> None:
        """Give a reservation's slots back unwritten, free at once (its holder says it is
        done with them). `LeaseError` if it is not live; id 0 (nothing reserved): nothing."""
        with self._lock:
            self.operations.ensure_open()
            self.operations.expire()
            self.reservations.abort(reservation)

    def load(
        self,
        tokens: Tokens,
        *,
        tenant: str = "default",
        start: int = 0,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
        layout: str = "layers",
    ) -> LoadResult:
        """The KV of the cached prefix of `tokens` from token `start` on (a multiple of
        `block_tokens`: an engine holding the head asks for the tail), in one pass from each
        block's fastest copy (`caller_kv.py`) into `out` (room for every full block of
        `tokens[start:]`; the rest untouched) or a new tensor on `device` (default: the gpu
        tier's), `layout` "layers" or "blocks" (pages). `num_tokens` is where the prefix ends,
        from token 0: the KV holds tokens start..num_tokens (none if it ends before)."""
        key, bt = encode_tokens(tokens), self.block_tokens
        asked, wanted = len(key) // TOKEN_NBYTES, check_device(device)
        first = check_start(start, asked, bt)
        dest = _destination(self, kv_layout(layout), asked - start, out, wanted)
        self.operations.fill_from_remote(key, tenant)
        with self._lock:
            namespace = self.operations.namespace(tenant)
            self.operations.expire()
            end = self.index.match(namespace, key).end
            held = self.parts.reader.read_prefix(end, dest.blocks, first, self.mover)
            self._writes.copy_hot_to_host(end)
            self.operations.count(tenant, loads=1, loaded_tokens=max(0, held - first) * bt)
            return LoadResult(held * bt, dest.result(max(0, held - first)))

    def prefetch(self, tokens: Tokens, *, tenant: str = "default", ttl_s: float | None = None,
                 wait: bool = True, release: Sequence[int] = (), as_load: bool = False,
                 ) -> Lease:  # fmt: skip
        """Bring the whole cached prefix of `tokens` to the gpu tier and lease it there.

        All or nothing: if the gpu tier cannot hold the prefix beside what is leased, raise
        `CapacityError` and lease nothing. A prefix with no cached block gives an empty lease
        (num_tokens 0), which must be released like any other.

        With `wait` (the default) return once the lease is READY; a corrupt disk copy met on the
        way is dropped and the prefix shrinks to what is intact. With `wait=False` return the
        lease at once, PENDING while its copies run: `lease.wait(timeout)`, `await lease` and
        `lease.wait_layer(l)` wait for it (`results.Lease`); a prefix already in flight is
        joined, not copied twice. `release`: `tenant`'s leases it is done with, released once
        every argument is known good, before its quota is checked (`Operations.release_done`).
        `as_load`: a load's lease (read from shared memory): counted as a load (`_counted`)."""
        key, ttl = encode_tokens(tokens), ttl_of(self.config.policy, ttl_s)
        check_flags(wait=wait, as_load=as_load)
        self.operations.fill_from_remote(key, tenant, release)
        for attempt in range(PREFETCH_ATTEMPTS):
            with self._lock:
                namespace = self.operations.namespace(tenant)
                self.operations.release_done(release if attempt == 0 else (), tenant)
                match = self.mover.match_prefix(namespace, key)
                self.shares.admit_lease(
                    tenant,
                    self.mover.book.leases_of(tenant),
                    self._writes.holding(tenant, namespace, GPU),
                    self.index.leases.unheld_blocks(match.end),
                )
                lease = self.mover.prefetch(match, tenant, self._clock() + ttl, self.cancel)
                if lease.lease_id in self.index.leases:  # (an inline prefetch may have failed)
                    self._writes.copy_hot_to_host(
                        self.index.leases.get(LeaseId(lease.lease_id)).end
                    )
                self.operations.count(tenant, **_counted(lease, as_load))
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
            raise InvalidArgumentError(f"lease: got {shown(lease)}, expected a Lease")
        with self._lock:
            self.operations.ensure_open()
            self.mover.book.cancel(lease)

    def release(self, lease: Lease | int) -> None:
        """Unlock a lease. `LeaseError` if it is unknown, released or expired."""
        raw = lease.lease_id if isinstance(lease, Lease) else lease
        if type(raw) is not int:
            raise InvalidArgumentError(f"lease: got {shown(lease)}, expected a Lease or an int id")
        with self._lock:
            self.operations.ensure_open()
            self.operations.expire()
            self.mover.book.release(LeaseId(raw))
            self.mover.executor.mark_engine()  # CUDA: a copy into these slots waits for reads

    def lease(self, lease_id: int, *, tenant: str | None = None) -> Lease:
        """The live lease `lease_id` (of `tenant`, when given); else `LeaseError`, as for none."""
        return self.operations.lease(lease_id, tenant)

    def reservation(self, reservation_id: int, *, tenant: str | None = None) -> Reservation:
        """The live reservation (of `tenant`, when given); else `LeaseError`, as for none."""
        return self.operations.reservation(reservation_id, tenant)

    def leases(self) -> list[Lease]:
        return self.operations.leases()

    def leased_slots(self) -> frozenset[int]:
        """The gpu slots live READY leases cover now (a snapshot of `residency`)."""
        self.operations.ensure_open()
        return self.residency.slots()

    # ---- operations (`operations.py`) ------------------------------------------------------

    def clear(self, tenant: str | None = None) -> int:
        """Drop every cached block (of `tenant`, when given: one out of the config, its copies
        left on disk) that nothing holds, in every tier, and its disk copies of unknown namespaces
        (`recovery.py`); return how many. Durable: disk copies are retired and synced before this
        returns. Where the disk refuses that, the blocks are dropped all the same (nothing serves
        them) and `StorageError` says how many, and how many may come back at the next start."""
        return self.operations.clear(tenant)

    def reset(self, tenant: str = "default") -> dict[str, Any]:
        """Forget `tenant`'s KV (its weights changed): its reservations void, `clear(tenant)`;
        `{dropped_blocks, left_blocks: held by leases, remote: a remote tier may hold more}`."""
        dropped, left = self.operations.reset(tenant)
        return {"dropped_blocks": dropped, "left_blocks": left, "remote": bool(self.parts.remote)}

    def persist(self) -> Persisted:
        """Give every cached block a durable disk copy now, as the disk holds them (`persist.py`):
        how many written (an int), `left_blocks` without one; no disk: `InvalidArgumentError`."""
        return persisted(self.operations.persist(), self.parts.state)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Do the mover's pending work now and wait for every copy in flight (demotion, disk
        writes, prefetches): True if it is all in the index within `timeout_s` (checkpoints)."""
        return self.operations.drain(timeout_s)

    def evict(self, tier: str, num_blocks: int) -> int:
        """Free up to `num_blocks` slots of `tier` by demotion; return how many were freed."""
        return self.operations.evict(tier, num_blocks)

    def status(self, tenant: str | None = None) -> dict[str, Any]:
        """A JSON-able snapshot (`status.py`): with `tenant` None, the global one (tiers, index,
        leases, mover, counters: the admin's); with a tenant, its own figures only (blocks,
        quota use and limits, floors, leases and counters)."""
        return self.operations.status(tenant)

    def check(self) -> None:
        """Verify DESIGN invariants 2-5 across index, pools, mover, leases and reservations
        (`operations.py`); raise `InvariantError`. Safe while the mover runs (takes the lock)."""
        self.operations.check()

    def close(self) -> None:
        """End every lease, wait (bounded) for copies in flight, free the pools. Later calls
        raise `ClosedError`."""
        self.operations.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ahead(store: KVStore, tenant: str, key: bytes, first: int = 0, reserver: str | None = None,
           release: Sequence[int] = ()) -> tuple[int, Callable[[], int], Landing]:  # fmt: skip
    """What `Mover.throttle` needs of a store or reservation (`reserver`'s) of `key` (from block
    `first` on): at most how many new blocks it brings, the planning of their room in the tier
    above disk (`Writes.make_room_ahead`), and their gpu need (`gpu_need`); both under the lock.
    `ClosedError` in another process than the store's; a bad `release` refused first."""
    store._lock.ensure_home()
    check_release(release)
    most, ns = len(key) // TOKEN_NBYTES // store.block_tokens - first, store.operations.namespace
    plan = lambda: store._writes.make_room_ahead(ns(tenant), key, first, reserver)  # noqa: E731
    return most, plan, lambda: gpu_need(store._writes, ns(tenant), key, first)


def _destination(
    store: KVStore, kind: KVKind, asked: int, out: object, device: torch.device | None
) -> Destination:
    """Where a load of `asked` tokens writes (`Destination.of`): `out`, checked against the
    layout, `device` and the buffers of the store's memory pools (a view of one is refused),
    or a new tensor on `device`, else on the gpu tier's."""
    pools = pool_buffers(store.memory)
    return Destination.of(store.layout, kind, asked, out, device, store.gpu_pool.device, pools)


def _counted(lease: Lease, as_load: bool) -> dict[str, int]:
    """A prefetch's counts: a load's lease (`as_load`: read through shared memory, released)
    in `loads` and `loaded_tokens` (the tokens leased), any other lease in `prefetches`."""
    return {"loads": 1, "loaded_tokens": lease.num_tokens} if as_load else {"prefetches": 1}
