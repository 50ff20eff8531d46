"""What a tenant is to the store: its namespace seed and its reservations (its quotas and
floors: `shares.py`).

`Namespaces`: each tenant's namespace seed, and what a disk copy records about a block.

A tenant's blocks hang from its own root in the index, keyed by a seed derived from the model's
fingerprint and the tenant's salt (`blocks.tenant_salt`, keyed by the server secret): the same
tokens give other block ids in another namespace (DESIGN invariant 6). The seeds are fixed when
the store is built; nothing here changes afterwards.

`describe(index, refs)`: what a disk copy of each block records (`BlockMeta`: its id, its
parent's id, namespace seed, tenant (never a secret) and tokens). The demoter, the mover and
`persist` take this object, not a callback into the store, so calls run down the floors (STYLE 14).

Quotas and fair-share floors: `shares.py`.

`ReservationTable`: the store's live reservations, and the quarantine of expired ones.

A reservation (`KVStore.reserve`) holds, while it lives:
- a pin: a lease that never expires (the index's `LeaseTable`) on the prefix it extends;
- slots per tier, allocated in the pools but in no index node; the writer writes the slots of
  its fastest tier (`Reservation.tier`), and under `write_through` the commit copies them to
  host itself;
- canaries in the writer's slots (`canaries.py`), planted before the reservation is returned.

It ends in one of four ways, and only these:
- commit (`take_written`): refused with `NotWrittenError` while a canary is left, and then
  nothing changes: the reservation stays live, so its writer can still write and commit, or
  abort (else it expires). Once every slot is written, the pin is released and the slots pass
  to the caller, which publishes them (DESIGN invariant 8: a slot publishes only what its writer
  wrote).
- abort: the holder says it is done: pin released, slots freed at once.
- expiry (`expire`, at `expires_at` of the store's clock): pin released; the slots go into
  quarantine, still allocated (so no one else gets them, and `held` counts them), and are freed
  `quarantine_s` later. A writer that lost the race with its deadline and still writes through
  its mapped pool writes into slots that nobody reads; nothing it writes is ever published.
  Residual risk, not fenced: a writer still writing `quarantine_s` after its reservation ended
  writes into slots that may have been handed on (to a reservation, whose canaries it may
  overwrite, or to a stored block). Only a client that maps the pools (the server's Unix user)
  can do that, and `quarantine_s` (`policy.reservation_quarantine_s`) is a few lease TTLs.
- void (`void(tenant)`, a reset): ended now as at expiry; a commit then gets `LeaseError`.

Ids are random (`blocks.py`): a reservation id tells nothing of other callers' reservations, and
another tenant's id is refused exactly like an id that was never issued.

Accounting: `held(tier)` is the slots of `tier` that live and quarantined reservations hold;
the store's `check()` adds it to the index's residency and the mover's flights and compares the
sum with each pool's used slots (DESIGN invariant 5); `check()` here verifies the table itself.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.blocks import BlockHasher, BlockId, fresh_id, tenant_salt
from kvtier.canaries import Canaries
from kvtier.errors import (
    InvalidArgumentError,
    InvariantError,
    LeaseError,
    NotWrittenError,
    UnknownTenantError,
    shown,
)
from kvtier.index import BlockRef, LeaseId, LeaseTable, RadixIndex, push_expiry
from kvtier.index.residency import Residency
from kvtier.results import Reservation
from kvtier.tiers.disk import BlockMeta
from kvtier.tiers.pool import SlotPool


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
        # The tenant whose namespace a namespace is, or None (another server secret's, or a
        # tenant no longer configured): the mapping's own `get`, no Python frame per call (the
        # KV events' observer asks once per edit of the index); the tenants are fixed here.
        self.tenant_of: Callable[[bytes], str | None] = self._tenants.get

    @property
    def seeds(self) -> Mapping[str, BlockId]:
        """Tenant -> namespace seed, for every configured tenant."""
        return self._seeds

    def seed(self, tenant: str) -> BlockId:
        """The namespace of `tenant`; `UnknownTenantError` naming the tenants there are."""
        seed = self._seeds.get(tenant)
        if seed is None:
            more = f" (of {len(tenant)} characters)" if len(tenant) > 64 else ""
            raise UnknownTenantError(
                f"tenant {tenant[:64]!r}{more}: unknown, expected one of {sorted(self._seeds)}"
            )
        return seed

    def describe(self, index: RadixIndex, refs: Iterable[BlockRef]) -> tuple[BlockMeta, ...]:
        """The `BlockMeta` of each of `refs`, in order; a node's ids are read once per run of it."""
        kb, ds = index.key_nbytes, index.digest_size
        metas: list[BlockMeta] = []
        node, chain, namespace, tenant = None, b"", b"", ""
        for at, i in refs:
            if at is not node:  # chain: [id before block 0 | id of block 0 | of block 1 | ...]
                node, chain = at, index.parent_id(BlockRef(at, 0)) + index.block_ids(at)
                namespace = index.namespace_of(at)
                tenant = self._tenants.get(namespace, "")
            metas.append(BlockMeta(chain[(i + 1) * ds : (i + 2) * ds], chain[i * ds : (i + 1) * ds],
                                   namespace, tenant, at.key[i * kb : (i + 1) * kb]))  # fmt: skip
        return tuple(metas)


@dataclass(frozen=True)
class Reserved:
    """A live reservation: what its client was told, the namespace and key it extends (for the
    commit), its pin, its slots per tier, and the canaries in the slots its writer writes."""

    reservation: Reservation
    namespace: BlockId
    key: bytes
    pin: LeaseId
    slots: dict[int, list[int]]
    canaries: Canaries


@dataclass(frozen=True)
class _Quarantined:
    """Slots of an expired reservation, freed at `free_at` of the store's clock."""

    free_at: float
    tenant: str
    namespace: BlockId
    slots: dict[int, list[int]]


class ReservationTable:
    def __init__(
        self,
        memory: Sequence[SlotPool],
        leases: LeaseTable,
        clock: Callable[[], float],
        quarantine_s: float,
        residency: Residency | None = None,
    ) -> None:
        """Reservations over the memory tiers `memory` (gpu, host), pinned in `leases`, timed
        by `clock`; expired slots stay quarantined `quarantine_s` seconds. The slots a
        namespace's reservations hold (live or quarantined) are told to `residency`, whose
        floors they come off (`Residency.hold`). Not thread-safe: the store's lock serialises
        calls."""
        self._memory = memory
        self._residency = residency
        self._leases = leases
        self._clock = clock
        self.quarantine_s = quarantine_s
        self._live: dict[int, Reserved] = {}
        self._expiry: list[tuple[float, int]] = []  # (expires_at, id), stale entries skipped
        self._quarantine: deque[_Quarantined] = deque()

    def __len__(self) -> int:
        return len(self._live)

    def open(
        self,
        reservation: Reservation,
        namespace: BlockId,
        key: bytes,
        pin: LeaseId,
        slots: dict[int, list[int]],
    ) -> Reservation:
        """Start a reservation like `reservation` (its id is ignored) over `slots` per tier and
        `pin`, which the table now owns: it plants canaries in the slots of the fastest tier
        and returns the reservation with a fresh random id."""
        tier = min(slots)
        assert reservation.slots == tuple(slots[tier]), "the writer writes the fastest tier"
        reservation = reservation._replace(reservation_id=fresh_id(self._live))
        canaries = Canaries(self._memory[tier], slots[tier])
        rid = reservation.reservation_id
        self._live[rid] = Reserved(reservation, namespace, key, pin, slots, canaries)
        self._hold(namespace, slots, 1)
        push_expiry(self._expiry, reservation.expires_at, rid, self._live, len(self._live))
        return reservation

    def get(self, reservation: Reservation | int, tenant: str | None = None) -> Reserved:
        """The live reservation (of `tenant`, when given); `LeaseError` otherwise, the same
        for another tenant's id as for one never issued. `InvalidArgumentError` for a non-id."""
        rid = reservation.reservation_id if isinstance(reservation, Reservation) else reservation
        if type(rid) is not int:
            raise InvalidArgumentError(
                f"reservation: got {shown(reservation)}, expected a Reservation or its id (int)"
            )
        entry = self._live.get(rid)
        if entry is None or (tenant is not None and entry.reservation.tenant != tenant):
            raise LeaseError(f"reservation {shown(rid)}: unknown, committed, aborted or expired")
        return entry

    def take_written(self, reservation: Reservation | int) -> Reserved:
        """End a live reservation for its commit once its writer wrote every slot: release its
        pin and hand its slots to the caller (who publishes or frees each). `NotWrittenError`,
        and nothing changes, while a slot still holds a canary."""
        entry = self.get(reservation)
        unwritten = entry.canaries.unwritten()
        if unwritten:
            rid, tier = entry.reservation.reservation_id, entry.reservation.tier
            raise NotWrittenError(
                f"reservation {rid}: slots {unwritten} of tier {tier!r} were not written "
                f"(of {list(entry.canaries.slots)}); write every block whole into its slot of "
                f"the mapped pool, then commit (or abort); a client that does not map the pools "
                f"sends its KV in the body (store)"
            )
        self._hold(entry.namespace, entry.slots, -1)  # the commit publishes or frees them
        return self._end(entry)

    def abort(self, reservation: Reservation | int) -> None:
        """End a live reservation unwritten: release its pin, free its slots now. Id 0 (a
        reserve that reserved nothing) holds nothing: done (an engine that aborts whatever it
        reserved on any failure got `LeaseError`)."""
        rid = reservation.reservation_id if isinstance(reservation, Reservation) else reservation
        if type(rid) is not int or rid:
            entry = self._end(self.get(reservation))
            self._hold(entry.namespace, entry.slots, -1)
            self._free(entry.slots)

    def expire(self) -> int:
        """Quarantine the reservations whose time is up (pins released, slots kept) and free
        the quarantined slots whose grace has passed; return how many reservations expired."""
        if not self._expiry and not self._quarantine:
            return 0
        now = self._clock()
        while self._quarantine and self._quarantine[0].free_at <= now:
            held = self._quarantine.popleft()
            self._hold(held.namespace, held.slots, -1)
            self._free(held.slots)
        expired = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, rid = heapq.heappop(self._expiry)
            entry = self._live.get(rid)
            if entry is None or entry.reservation.expires_at != expires_at:
                continue  # committed or aborted before its time
            self._end(entry, now)
            expired += 1
        return expired

    def void(self, tenant: str) -> int:
        """End `tenant`'s live reservations now, as at expiry (a reset); return how many."""
        ended = [e for e in self._live.values() if e.reservation.tenant == tenant]
        for entry in ended:
            self._end(entry, self._clock())
        return len(ended)

    def _end(self, entry: Reserved, now: float | None = None) -> Reserved:
        """Release `entry`'s pin; with `now`, quarantine its slots (its writer may write on)."""
        del self._live[entry.reservation.reservation_id]
        self._leases.release(entry.pin)
        if now is not None:
            tenant = entry.reservation.tenant
            held = _Quarantined(now + self.quarantine_s, tenant, entry.namespace, entry.slots)
            self._quarantine.append(held)
        return entry

    def held(self, tier: int, tenant: str | None = None) -> int:
        """Slots of `tier` that live and quarantined reservations (of `tenant`) hold."""
        return self.live(tier, tenant) + self.quarantined(tier, tenant)

    def live(self, tier: int, tenant: str | None = None) -> int:
        """Slots of `tier` that live reservations (of `tenant`) hold."""
        return sum(
            len(entry.slots.get(tier, ()))
            for entry in self._live.values()
            if tenant is None or entry.reservation.tenant == tenant
        )

    def quarantined(self, tier: int, tenant: str | None = None) -> int:
        """Slots of `tier` that expired reservations (of `tenant`) hold in quarantine."""
        return sum(
            len(held.slots.get(tier, ()))
            for held in self._quarantine
            if tenant is None or held.tenant == tenant
        )

    def pins(self) -> set[LeaseId]:
        """The pins of the live reservations."""
        return {entry.pin for entry in self._live.values()}

    def check(self) -> None:
        """Every pin is in the lease table; every held slot is allocated in its pool and held
        once; `InvariantError` naming the first that is not."""
        seen: set[tuple[int, int]] = set()
        holders = [(f"reservation {rid}", e.slots) for rid, e in self._live.items()]
        holders += [(f"quarantine until {q.free_at}", q.slots) for q in self._quarantine]
        holders_by_namespace = [(e.namespace, e.slots) for e in self._live.values()]
        holders_by_namespace += [(q.namespace, q.slots) for q in self._quarantine]
        for name, slots in holders:
            for tier, tier_slots in slots.items():
                pool = self._memory[tier]
                for slot in tier_slots:
                    if (tier, slot) in seen or not pool.is_allocated(slot):
                        raise InvariantError(
                            f"{name}: {pool.name} slot {slot} is "
                            f"{'held twice' if (tier, slot) in seen else 'free in the pool'}"
                        )
                    seen.add((tier, slot))
        for rid, entry in self._live.items():
            if entry.pin not in self._leases:
                raise InvariantError(f"reservation {rid}: its pin {entry.pin} is not a lease")
        if self._residency is not None:  # what `hold` told it, against the slots held
            counted: dict[tuple[bytes, int], int] = {}
            for namespace, slots in holders_by_namespace:
                for tier, tier_slots in slots.items():
                    key = (bytes(namespace), tier)
                    counted[key] = counted.get(key, 0) + len(tier_slots)
            told = {(namespace, tier): count for namespace, row in self._residency.held().items()
                    for tier, count in enumerate(row) if count}  # fmt: skip
            if told != {key: count for key, count in counted.items() if count}:
                raise InvariantError(f"reserved slots told to the floors {told} != held {counted}")

    def _hold(self, namespace: BlockId, slots: dict[int, list[int]], sign: int) -> None:
        """Tell the floors (`Residency.hold`) of `slots` held (sign 1) or not (-1) any more."""
        if self._residency is not None:
            for tier, tier_slots in slots.items():
                if tier_slots:
                    self._residency.hold(bytes(namespace), tier, sign * len(tier_slots))

    def _free(self, slots: dict[int, list[int]]) -> None:
        for tier, tier_slots in slots.items():
            self._memory[tier].free(tier_slots)
