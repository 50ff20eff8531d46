"""The write path: where new blocks go, and how they enter the index.

Contract:
- Placement (`place`): new blocks go to the fastest tier that prefix closure allows (gpu,
  unless the cached prefix before them has left the gpu) and that can make room for all of them
  (`Demoter.room`: checked before anything moves), plus host under `write_through` where host
  has room freeable without dropping an unwritten block (`host_copy_room`). None when no tier
  can: nothing moved. The check can count copies that room-making cannot free (a host spare of
  a gpu block; a gpu victim that finds no room below): if no tier then made room for all, the
  first blocks take the slots one freed, so that what moved is used. The rest are dropped. Room is
  made for the namespace of the prefix (fair shares). For a reservation, the slots count
  against the reserver's quota (`QuotaError`, nothing moved, when the tier it would take is
  full to it; a write_through host copy over its host quota is left out), and never go to a
  quantized host tier (`QuantPool`: its slots hold payloads, not blocks a writer could write,
  and canaries would land in other slots).
  `take_free` is the same placement when it needs only free slots: taken at once, no demoter
  asked, nothing moved (None when room must be made).
- `store_new`: the new full blocks of a call, written into their slots and inserted (DESIGN
  invariant 1: the index learns of them once written; a copy that fails, with any error,
  frees the slots it took and raises it: nothing stored). The match is pinned only while room is
  made (`take_free` moves nothing, so it needs no pin). Below a prefix that lives only on disk
  they take the one disk route, an insert flight (`transfer/background.py`; where its room
  fell short, the first blocks take the slots it freed, `disk_route.py`): landed before the
  call returns with an inline mover, pending behind it with a background one. Either way the
  blocks a store takes go to the remote tier too (unless they came from it, `share`).
- `publish_reserved`: a committed reservation's blocks enter the index (under write_through
  the host copy is made first, from the written slots); blocks someone stored meanwhile are
  skipped and their slots freed, and where those have since left a tier (unpinned, demoted),
  ours keep no copy in it (prefix closure), none at all if no tier is left (`dropped_tokens`).
- `copy_hot_to_host`: under the `selective` policy, a gpu block hit often enough gets its host
  copy now, so that its demotion later costs no copy and no drop.
- Both publish only the host copies that landed: a quantized host's codec leaves out a block it
  cannot keep, and that slot (freed) still holds whatever it held before, another tenant's KV
  perhaps. A committed block whose only copy left did not land is dropped, with those after it.
- `after_write`: wakes the background mover, which keeps dirty data under the watermarks.
- `make_room_ahead` (before a store or reservation takes the lock, `Mover.throttle`): host
  room written down ahead, only as much as the call's blocks could use, and none for a call
  that `place` would refuse (no tier holds them, or over the reserver's quota): a call that
  places nothing, or is refused, changes nothing. It is made for the call's namespace (the
  victims its own room-making takes), and says how many blocks host still lacks room for.
Thread: every method runs under the cache's lock.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kvtier.blocks import BlockId
from kvtier.disk_route import insert_on_disk, stage_ahead
from kvtier.errors import QuotaError
from kvtier.index import Match
from kvtier.index.node import Node, block_hits
from kvtier.policy import WritePolicy
from kvtier.results import Reservation, StoreResult
from kvtier.shares import TenantShares
from kvtier.tenancy import ReservationTable, Reserved
from kvtier.tiers.base import DISK, GPU, HOST
from kvtier.tiers.quantized import QuantPool
from kvtier.transfer.clean import host_copy_room
from kvtier.transfer.copy import InlineExecutor, Transfer
from kvtier.transfer.demotion import Demoter, plan_copy_down, run_copy
from kvtier.transfer.mover import Mover
from kvtier.transfer.remote import RemoteLink
from kvtier.transfer.shared import CacheState

Slots = dict[int, list[int]]
"""Slot numbers per tier (gpu, host) of a call's new blocks, the first ones first."""


class Writes:
    def __init__(
        self,
        state: CacheState,
        demoter: Demoter,
        mover: Mover,
        shares: TenantShares,
        reservations: ReservationTable,
        policy: WritePolicy,
        inline: InlineExecutor,
    ) -> None:
        self.state = state
        self.index = state.index
        self.demoter = demoter
        self.mover = mover
        self.shares = shares
        self.reservations = reservations
        self.policy = policy
        self.inline = inline
        self.remote: RemoteLink | None = None  # the remote tier's link, when configured

    def holding(self, tenant: str, namespace: BlockId, tier: int) -> int:
        """What `tenant` holds of `tier` against its quota (`shares.py`): its reserved slots
        (live or in quarantine) and, on gpu, the blocks its leases and reservation pins lock."""
        reserved = self.reservations.held(tier, tenant)
        return reserved + self.index.leases.held_blocks(namespace) if tier == GPU else reserved

    def place(self, match: Match, count: int, reserver: str | None = None) -> Slots | None:
        """Slots for `count` new blocks after `match` (module doc); None when no tier can."""
        owner, short = match.end.root.ids, None  # short: a tier whose room fell short
        for tier in self._tiers(match, count, reserver is not None):
            if reserver is not None:
                holding = self.holding(reserver, BlockId(owner), tier)
                if short is not None and not self.shares.fits(reserver, tier, holding, count):
                    break  # room made above: it is used, not thrown away by a refusal here
                self.shares.admit(reserver, tier, holding, count, "a reservation")
            if self.demoter.make_room(tier, count, owner):
                return _take(self, tier, count, owner, reserver)
            if short is None and self.state.pools[tier].num_free:
                short = tier
        if short is None:
            return None
        return _take(self, short, self.state.pools[short].num_free, owner, reserver)

    def _tiers(self, match: Match, count: int, reserving: bool) -> Iterator[int]:
        """The tiers `place` may take for `count` new blocks after `match`, fastest first, each
        checked as it is reached (nothing moved): those prefix closure allows that can make
        room for all of them (for the prefix's namespace), a quantized host left out of a
        reservation's."""
        owner = match.end.root.ids
        for tier in range(match.end.fastest_last(), min(len(self.state.pools), DISK)):
            if reserving and isinstance(self.state.pools[tier], QuantPool):
                continue  # its slots hold payloads: a writer cannot write blocks there
            if self.demoter.can_make_room(tier, count, owner):
                yield tier

    def store_new(
        self,
        namespace: BlockId,
        tenant: str,
        key: bytes,
        blocks: torch.Tensor,
        first: int = 0,
        share: bool = True,
    ) -> StoreResult:
        """`KVStore.store`'s work (module doc). `blocks` (`[n, *block_shape]`, a view of the
        caller's KV in any strides) are the full blocks from block `first` on (a remote fill
        passes the blocks it fetched: nothing before them can be stored, and they are not
        shared back, `share`)."""
        bt = self.index.block_tokens
        match = self.index.match(namespace, key)
        new_blocks = len(key) // self.index.key_nbytes - match.num_blocks
        if new_blocks <= 0 or match.num_blocks < first:
            return StoreResult(match.num_blocks * bt, 0, 0)
        slots = self.take_free(match, new_blocks)
        if slots is None:  # room must be made: pin the match while blocks move
            pin = self.index.leases.acquire(
                match.end, self.state.all_tiers, math.inf, 0, resident=False
            )
            try:
                slots = self.place(match, new_blocks)
            finally:
                # the pin guards the match while room is made; unpinned, a leaf grows in place
                self.index.leases.release(pin.lease_id)
        blocks = blocks[match.num_blocks - first : match.num_blocks - first + new_blocks]
        if slots is None and self._tail_on_disk(match):
            taken, landed = insert_on_disk(self, match, key, blocks, namespace, tenant)
            if share and taken and self.remote is not None:  # stored: shared as any store's
                self.remote.after_store_key(namespace, key, match.num_blocks, blocks[:taken])
            pending = taken - landed if self.mover.background else 0
            return StoreResult(
                (match.num_blocks + landed) * bt,
                landed * bt,
                (new_blocks - landed - pending) * bt,
                pending * bt,
            )
        if slots is None:
            return StoreResult(match.num_blocks * bt, 0, new_blocks * bt)
        taken = len(slots[min(slots)])  # fewer when room fell short (`place`): the first ones
        blocks, key = blocks[:taken], key[: (match.num_blocks + taken) * self.index.key_nbytes]
        memory = (self.state.gpu, self.state.host)
        try:
            for tier, tier_slots in slots.items():
                memory[tier].write(tier_slots, blocks)
        except BaseException:  # KV a quantized tier cannot keep, or any failed copy
            for tier, tier_slots in slots.items():  # nothing stored, no slot kept
                memory[tier].free(tier_slots)
            raise
        self.mover.executor.mark_engine()  # CUDA: background copies of these slots wait
        end = self.index.insert(match, key, slots).end
        if share and self.remote is not None:
            self.remote.after_store(namespace, end, match.num_blocks, blocks)
        self.after_write()
        return StoreResult((match.num_blocks + taken) * bt, taken * bt, (new_blocks - taken) * bt)

    def reserve(
        self, namespace: BlockId, tenant: str, key: bytes, expires_at: float
    ) -> Reservation:
        """`KVStore.reserve`'s work: a pin on the prefix (within the tenant's quota), slots
        placed as `store` would place them, and the reservation opened in the table (canaries
        planted); an empty reservation, nothing held, when the blocks cannot be placed, or when
        every whole block is cached already (counted as a store, as `store` counts one)."""
        bt = self.index.block_tokens
        match = self.index.match(namespace, key)
        new_blocks = len(key) // self.index.key_nbytes - match.num_blocks
        if new_blocks > 0:  # its pin locks the prefix for the tenant: within its quota
            locking = self.index.leases.unheld_blocks(match.end)
            holding = self.holding(tenant, namespace, GPU)
            self.shares.admit(tenant, GPU, holding, locking, "a reservation's prefix")
        pin = self.index.leases.acquire(
            match.end, self.state.all_tiers, math.inf, 0, resident=False, held=True
        )
        try:
            slots = self.place(match, new_blocks, tenant) if new_blocks > 0 else None
        except QuotaError:
            self.index.leases.release(pin.lease_id)
            raise
        if slots is None:
            self.index.leases.release(pin.lease_id)
            if new_blocks <= 0 and match.num_blocks:  # held whole: a store with nothing to store
                self.state.count(tenant, stores=1)  # (a client's ends here, `client/pools.py`)
            return Reservation(0, tenant, match.num_blocks * bt, 0, "gpu", (), 0.0)
        tier, cached = min(slots), match.num_blocks * bt
        new, short = len(slots[tier]) * bt, new_blocks - len(slots[tier])  # room fell short
        key = key[: (match.num_blocks + len(slots[tier])) * self.index.key_nbytes]  # (`place`)
        name = self.state.pools[tier].name  # the id, 0 here, is drawn by the table
        reservation = Reservation(
            0, tenant, cached, new, name, tuple(slots[tier]), expires_at, short * bt
        )
        return self.reservations.open(reservation, namespace, key, pin.lease_id, slots)

    def publish_reserved(self, entry: Reserved) -> StoreResult:
        """A committed reservation's blocks enter the index (module doc)."""
        namespace, key, slots = entry.namespace, entry.key, entry.slots
        bt, kb = self.index.block_tokens, self.index.key_nbytes
        pools = self.state.pools
        tier = min(slots)
        first_block = len(key) // kb - len(slots[tier])
        landed = {t: [True] * len(t_slots) for t, t_slots in slots.items()}
        for other, other_slots in slots.items():  # write_through: the host copy, now
            if other != tier:  # a quantized host leaves out a block its codec cannot keep
                landed[other] = self.inline.run(
                    Transfer(pools[tier], tuple(slots[tier]), pools[other], tuple(other_slots))
                )
        match = self.index.match(namespace, key)
        skip = max(0, match.num_blocks - first_block)  # stored meanwhile by someone else
        # prefix closure (DESIGN invariant 3): the reserve's pin holds the prefix it matched,
        # but blocks stored by someone else since then hang below it unpinned and may have left
        # the faster tiers; our blocks keep only their copies in tiers that prefix still
        # reaches (none: dropped, and said so), never a gpu block below a host-only parent
        reach = match.end.fastest_last()
        for t, tier_slots in slots.items():
            self.state.free(t, tier_slots[:skip] if t >= reach else tier_slots)
        new = {t: tier_slots[skip:] for t, tier_slots in slots.items() if t >= reach}
        kept = min(new) if new else tier
        count, late = self._keep_landed(new, {t: landed[t][skip:] for t in new}, kept)
        dropped = max(0, len(slots[tier]) - skip) - count + entry.reservation.dropped_tokens // bt
        if count:
            end = self.index.insert(match, key[: (match.num_blocks + count) * kb], new).end
            for t, copies in late.items():  # the copies that landed, beside the kept ones
                refs = self.index.refs_at(end, [match.num_blocks + i for i, _ in copies])
                for ref, (_, slot) in zip(refs, copies, strict=True):
                    self.index.set_slot(ref, t, slot)
            self.mover.executor.mark_engine()
            if self.remote is not None:  # the writer's blocks, read from their memory slots
                written = (self.state.gpu, self.state.host)[kept].read(new[kept])
                self.remote.after_store(namespace, end, match.num_blocks, written)
        self.after_write()
        return StoreResult((match.num_blocks + count) * bt, count * bt, dropped * bt)

    def _keep_landed(
        self, new: dict[int, list[int]], landed: dict[int, list[bool]], kept: int
    ) -> tuple[int, dict[int, list[tuple[int, int]]]]:
        """Of a commit's `new` slots per tier (edited in place), only copies that landed are
        published (a slot a quantized host's codec left out holds another block's bytes): the
        blocks up to the first whose `kept` (fastest) copy did not land, how many returned; a
        tier with a copy left out among those leaves `new` and its landed copies come back as
        (block, slot), set one by one after the insert. Every other slot is freed."""
        ok = landed[kept] if new else []
        count = ok.index(False) if False in ok else len(ok)
        late: dict[int, list[tuple[int, int]]] = {}
        for t in list(new):
            held, good = new[t][:count], landed[t][:count]
            pairs = list(enumerate(zip(held, good, strict=True)))
            unkept = [slot for _, (slot, done) in pairs if not done]
            self.state.free(t, new[t][count:] + unkept)
            new[t] = held
            if unkept:
                late[t] = [(i, slot) for i, (slot, done) in pairs if done]
                del new[t]
        return count, late

    def copy_hot_to_host(self, end: Node) -> None:
        """`selective` write policy: a gpu block hit `selective_hits` times gets its host copy
        now (one batched copy), so that its demotion later costs no copy and no drop."""
        if self.policy.copy_on_hits is None:
            return
        wanted = [
            ref
            for ref in self.index.blocks(end)
            if block_hits(ref) >= self.policy.copy_on_hits  # (an extended leaf's differ)
            and ref.node.slots[GPU][ref.i] is not None
            and ref.node.slots[HOST][ref.i] is None
        ]
        if not wanted or not self.demoter.room({HOST: len(wanted)}, end.root.ids):
            return
        # as a demotion copies: only the copies that landed are learned, the other slots freed
        # (a quantized host leaves out a block its codec cannot keep)
        run_copy(self.state, plan_copy_down(self.state, wanted, GPU, HOST), wanted, self.inline)

    def after_write(self) -> None:
        """Wake the background mover, which keeps dirty data under the watermarks. Inline
        there is nothing to do: blocks are copied down when their slots are needed."""
        if self.mover.background:
            self.mover.kick()

    def take_free(self, match: Match, count: int) -> dict[int, list[int]] | None:
        """`place(match, count)` when it needs only free slots (the first tier closure allows
        has `count` free, and so has host when a store copies there): those slots, taken
        without asking the demoter, nothing moved. None when room must be made first."""
        pools = self.state.pools
        tier = match.end.fastest_last()
        if tier >= min(len(pools), DISK) or pools[tier].num_free < count:
            return None
        if tier != GPU or not self.policy.copy_on_store:
            return {tier: pools[tier].allocate(count)}
        if pools[HOST].num_free < count:
            return None
        return {GPU: pools[GPU].allocate(count), HOST: pools[HOST].allocate(count)}

    def make_room_ahead(
        self, namespace: BlockId, key: bytes, first: int = 0, reserver: str | None = None
    ) -> int:
        """(Under the cache's lock, from `Mover.throttle`.) The slots of the tier above disk
        a store of `key` (a reservation, for `reserver`) could use for its new blocks, written
        down ahead for them, for `namespace` (`Background.make_room_ahead`: the victims its own
        room-making would take), the match pinned meanwhile as `store_new` pins it; returns
        how many of them that tier still cannot take without dropping an unwritten block
        (`Background.has_room`; 0: it can). Check, then commit: 0, planning nothing, when it
        brings no new block, when `place` would find no tier for them (a store that places
        nothing evicts nothing), or when the reservation would be refused for quota (it changes
        nothing). At most the tier's slots: blocks placed on gpu reach host only as its copies
        or demotions. Below a disk-only prefix, the host slots `insert_on_disk` stages them in
        (`disk_route.stage_ahead`)."""
        match = self.index.match(namespace, key)
        new_blocks = len(key) // self.index.key_nbytes - match.num_blocks
        if new_blocks <= 0 or match.num_blocks < first:
            return 0
        if self._tail_on_disk(match):  # a reservation places nothing there
            return 0 if reserver is not None else stage_ahead(self, match, new_blocks, namespace)
        if reserver is not None:  # its prefix pin, as `reserve` checks it
            locking = self.index.leases.unheld_blocks(match.end)
            holding = self.holding(reserver, namespace, GPU)
            if not self.shares.fits(reserver, GPU, holding, locking):
                return 0
        pin = self.index.leases.acquire(
            match.end, self.state.all_tiers, math.inf, 0, resident=False
        )
        try:
            tier = next(iter(self._tiers(match, new_blocks, reserver is not None)), None)
            if tier is None:
                return 0
            if reserver is not None:  # as `place` checks it, the prefix pin held (on gpu)
                holding = self.holding(reserver, namespace, tier) + (locking if tier == GPU else 0)
                if not self.shares.fits(reserver, tier, holding, new_blocks):
                    return 0
            need = min(new_blocks, self.state.host.num_slots)
            owner = bytes(namespace)
            self.mover.work.make_room_ahead(need, owner)
        finally:
            self.index.leases.release(pin.lease_id)
        return 0 if self.mover.work.has_room(need, owner) else need

    def _tail_on_disk(self, match: Match) -> bool:
        end = match.end
        return (
            self.state.disk is not None
            and end.parent is not None
            and end.fastest(end.size - 1) == DISK
        )


def gpu_need(writes: Writes, namespace: BlockId, key: bytes, first: int) -> tuple[int, bytes]:
    """How many new blocks of `key` (from block `first` on) a store would place on gpu, and
    the namespace room is made for (`Mover._landing`): none when they are cached already or
    their prefix has left gpu (they go below it). Under the cache's lock."""
    match = writes.index.match(namespace, key)
    new = len(key) // writes.index.key_nbytes - max(match.num_blocks, first)
    if new <= 0 or match.end.fastest_last() != GPU:
        return 0, b""
    return new, bytes(match.end.root.ids)


def _take(writes: Writes, tier: int, count: int, owner: bytes, reserver: str | None) -> Slots:
    """`Writes.place`'s slots: `count` free ones of `tier`, and their write_through host
    copies' where those fit (the reserver's quota, `host_copy_room`)."""
    state, shares = writes.state, writes.shares
    slots = {tier: state.pools[tier].allocate(count)}
    copy = tier == GPU and writes.policy.copy_on_store
    if copy and reserver is not None:
        copy = shares.fits(reserver, HOST, writes.holding(reserver, BlockId(owner), HOST), count)
    if copy and host_copy_room(writes.demoter, count, owner):
        slots[HOST] = state.pools[HOST].allocate(count)
    return slots
