"""Background work: watermark demotion and disk inserts, as flights.

Contract:
- **Watermark demotion** (`keep_watermarks`): when a memory tier's use, less what its flights
  will free (`pressure`), passes its high watermark, its least-recently-used leaves are acted on
  as `copydown.decide` says, the copies down going in `DemotionFlight`s of up to `BATCH` blocks
  of one node, freed once the copy is in, down to the low watermark and not past it: a flight
  takes no more blocks than are still over it. Only where a lower tier exists: the lowest
  memory tier drops leaves only on demand. At most `MAX_DEMOTIONS` demotion flights per tier
  are in flight. A disk that refuses writes (`slab_set.py`) pauses it. A block whose copy
  the lower tier's codec refused is dropped with all below it (`demotion.drop_unkeepable`).
  This is the mover's own work: fair shares leave it only blocks above floors, and a flight
  no more of a namespace's blocks than keep it at its floor once every flight in the air has
  landed. Only with a background mover: inline, a block leaves a tier when its slot is needed
  (`Demoter.make_room`), so that a tier holds what LRU of leaves would hold (issue 13).
- **Disk inserts** (`insert_on_disk`): new blocks below a prefix that lives only on disk are
  written in an `InsertFlight` (room for them checked in every tier before anything moves);
  they enter the index once durable. This is the one route for such blocks: in the background
  they are staged in host slots first (the caller may reuse its tensor), inline the flight runs
  in the call and reads the caller's blocks where they are (`tiers/staging.py`).
- **Behind** (`behind`): host holds more unwritten blocks (their slowest copy there, or staged
  for an insert) than its high watermark allows while they can be written down (flights in
  the air, or a disk that takes writes); a store then waits for them, bounded
  (`Mover.throttle`), rather than have host drop them.
- **Short** (`short(need)`, `make_room_ahead(need)`): a store or reservation of `need` new
  blocks that host cannot take beside what it holds (less what flights will free) would drop
  unwritten blocks to make the room, under the watermark or not: host's least recently used
  leaves are written down (or cleared) ahead, as over a watermark, and the call waits for them
  (`Mover.throttle`), bounded, while they are in the air. Two prompts of 100 blocks stored
  back to back into a host of 128 dropped 72 blocks by backpressure, with an idle disk. The
  caller asks only for room its blocks could use (`Writes.make_room_ahead`): a call that will
  place nothing, or is refused for quota, has nothing written down for it. The write-ahead is
  made for the call's tenant: it takes the victims that tenant's own room-making would take
  (above floors, then its own blocks; a floor keeps off other tenants and watermark work, not
  the tenant itself), and the host copies of the gpu victims that room-making clears first
  (`_write_behind`: they are no host victims until then). Before, with two tenants at their
  floors nothing was written ahead and one kept 1 of its 20 prompts, 14 disk slots free.
Thread: every method runs under the cache's lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.blocks import BlockId
from kvtier.index import BlockRef, Match
from kvtier.tiers.base import DISK, HOST
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.pool import SlotPool
from kvtier.tiers.staging import StagedBlocks
from kvtier.transfer.clean import has_clean_room
from kvtier.transfer.copy import Transfer
from kvtier.transfer.demotion import (
    Action,
    Demoter,
    decide,
    drop_unkeepable,
    plan_copy_down,
    record_copies,
)
from kvtier.transfer.flights import DemotionFlight, FlightRunner, Flights, InsertFlight
from kvtier.transfer.shared import CacheState

BATCH = 32
"""Blocks per demotion flight (one group commit when the lower tier is disk)."""

MAX_DEMOTIONS = 8
"""Demotion flights in flight per tier: enough to keep a path busy, few enough that the cache's
lock is never held long to plan them."""


@dataclass(frozen=True)
class BackgroundSettings:
    watermarks: Sequence[tuple[float, float]]  # (high, low) of each memory tier present
    admission: Sequence[int]  # hits a block needs to be copied into tier t
    background: bool  # inserts are staged in host slots, land after their call returned, and
    # are counted as stored then


class Background:
    def __init__(
        self, demoter: Demoter, flights: Flights, runner: FlightRunner, settings: BackgroundSettings
    ) -> None:
        self.state = demoter.state
        self.index = demoter.state.index
        self.pools = demoter.state.pools
        self.demoter = demoter
        self.flights = flights
        self.runner = runner
        self.watermarks = list(settings.watermarks)
        self.admission = list(settings.admission)
        self.background = settings.background  # watermark work, staged and late-counted inserts
        self._pending_free = [0] * len(self.pools)  # slots demotion flights will free
        self._leaving: dict[tuple[int, bytes], int] = {}  # the same, per (tier, namespace)
        self.demoting = [0] * len(self.pools)  # demotion flights in flight per source tier
        self._copy_only: set[int] = set()  # ids of those planned to free nothing (`ahead`)
        self._inserting = 0  # insert flights in flight
        self.stats = dict.fromkeys(("demote_flights", "insert_flights", "failed_blocks"), 0)

    # ---- watermark demotion ----------------------------------------------------------------

    def pressure(self, tier: int) -> int:
        """Slots of `tier` in use, less those that demotion flights will free."""
        return self.pools[tier].num_used - self._pending_free[tier]

    def behind(self) -> bool:
        """Whether the tier above disk holds more unwritten blocks than its high watermark allows
        while they are written down (module doc); False without a background mover or disk, and
        while no flight is in the air and the disk backs off after refusals (waiting won't help)."""
        disk = self.state.disk
        if not self.background or disk is None:
            return False
        tier = DISK - 1
        if not self.demoting[tier] and not self._inserting and not disk.accepting_writes():
            return False
        unwritten = self.index.residency.only_in(tier) + self.flights.reserved(tier)
        return unwritten > self.watermarks[tier][0] * self.pools[tier].num_slots

    def has_room(self, need: int, owner: bytes | None = None) -> bool:
        """Whether the tier above disk can take `need` new blocks for `owner` (None: any) now
        without dropping one not written down: its free slots and its victims for `owner` with a
        disk copy, cleared first (`clean.clean_victims`). True without a background mover/disk."""
        if not need or not self.background or self.state.disk is None:
            return True
        return has_clean_room(self.index, self.pools[DISK - 1], DISK - 1, need, owner)

    def short(self, lacking: int) -> bool:
        """Whether a call whose room the tier above disk lacks for `lacking` of its new blocks
        (`Writes.make_room_ahead`) should wait: write-downs are in the air, or flights hold its
        slots (gpu demotions: once landed, written down; before, a store dropped them)."""
        tier = DISK - 1
        return lacking > 0 and (self.demoting[tier] > 0 or self.flights.reserved(tier) > 0)

    def make_room_ahead(self, need: int, owner: bytes | None = None) -> None:
        """Write down (or clear) the tier above disk's LRU leaves until `need` new blocks fit
        beside what it holds, as over a watermark but taking the victims `Demoter.make_room(tier,
        need, owner)` would (above floors, then `owner`'s own), then `_write_behind`, so that
        room-making clears them, not drops them. `need` is held to the tier's slots."""
        if self.background and self.state.disk is not None and need:
            tier = DISK - 1
            room = max(0, self.pools[tier].num_slots - need)
            self._demote_to(tier, room, room, owner)
            if tier and self.pressure(tier) > room:
                self._write_behind(tier, need, owner)

    def _write_behind(self, tier: int, need: int, owner: bytes | None) -> None:
        """Write down the `tier` copies (admitted below) of the victims for `owner` that room for
        `need` blocks in the tier above takes: out of `_demote_to`'s reach until those go."""
        top, lower = tier - 1, tier + 1
        want = need - self.pools[top].num_free
        for ref in self.index.victims(top, owner):
            if want <= 0 or self.demoting[tier] >= MAX_DEMOTIONS:
                return
            node, i = ref
            want -= i + 1 - (node.depth[top - 1] if top else 0)  # its run in `top` goes
            target = self.pools[lower]
            if isinstance(target, DiskTier) and not target.accepting_writes():
                return
            if (
                node.slots[lower][i] is None
                and decide(self.state, ref, tier, self.admission) is Action.COPY
            ):
                self._plan_demotion(ref, tier, lower, BATCH, owner, ahead=1)

    def keep_watermarks(self) -> None:
        if not self.background:  # inline: room is made on demand only
            return
        for tier in range(len(self.watermarks)):
            if self.state.below(tier) is not None:
                high, low = self.watermarks[tier]
                slots = self.pools[tier].num_slots
                self._demote_to(tier, high * slots, int(low * slots))

    def _demote_to(self, tier: int, trigger: float, goal: int, owner: bytes | None = None) -> None:
        """Past `trigger` slots in use (less what flights will free), demote `tier`'s least
        recently used leaves down to `goal`, never past it (a flight takes at most the blocks
        still over it), and never a block whose namespace would fall below its floor there,
        counting what its flights in the air will free (`_spare`), but for `owner`'s own (a
        call making room for itself, as `Demoter.make_room` takes them)."""
        if self.pressure(tier) <= trigger:
            return
        floors, lower, full_below = self.index.residency.floors, tier + 1, False
        left = None if owner or not floors else {n for n in floors if self._spare(n, tier) > 0}
        for ref in self.index.victims(tier, owner):
            over = self.pressure(tier) - goal
            if over <= 0 or self.demoting[tier] >= MAX_DEMOTIONS or left == set():
                return  # (none with blocks to spare: no walk of every victim under the lock)
            namespace = ref.node.root.ids
            spare = BATCH if namespace == owner else self._spare(namespace, tier)
            if spare <= 0:  # its flights will take it to its floor: left, as a pass leaves it
                if left is not None:
                    left.discard(namespace)
                continue
            action = decide(self.state, ref, tier, self.admission)
            if action is Action.CLEAR:
                self.pools[tier].free([self.index.clear_slot(ref, tier)])
                self.state.counters[tier].demotions += 1
            elif action is Action.DROP:
                for t, slot in self.index.drop(ref):
                    self.pools[t].free([slot])
                self.state.counters[tier].evictions += 1
            elif action is Action.COPY and not full_below:  # (none below: clear or drop others)
                target = self.pools[lower]
                if isinstance(target, DiskTier) and not target.accepting_writes():
                    return  # the disk refused writes: try again when its backoff ends
                full_below = not self._plan_demotion(ref, tier, lower, min(over, spare), owner)

    def _spare(self, namespace: bytes, tier: int) -> int:
        """How many of `namespace`'s `tier` copies the mover may still take: those above its
        floor there, less what its demotion flights will free (no floor: `BATCH`)."""
        residency = self.index.residency
        floor = residency.floors.get(namespace)
        if floor is None:
            return BATCH
        leaving = self._leaving.get((tier, namespace), 0)
        return residency.resident_in(namespace, tier) - leaving - floor[tier]

    def _plan_demotion(
        self, ref: BlockRef, tier: int, lower: int, most: int, owner: bytes | None, ahead: int = 0
    ) -> bool:
        """Copy down in one flight victim `ref` and the blocks before it in its node's run of
        `tier` lacking a `lower` copy (at most `most`, and `BATCH`), into room made for `owner`
        dropping nothing a disk could keep (`Demoter.clean_room`); False: no room. `ahead` > 0:
        `ref` is a victim `ahead` tiers above, kept here by closure: frees none (`_copy_only`)."""
        node, i = ref
        top = tier - ahead  # where this node's run in `top` starts: blocks below it
        first = node.depth[top - 1] if top else 0
        batch = [
            j
            for j in range(max(first, i - BATCH + 1), i + 1)
            if node.slots[lower][j] is None and node.slots[tier][j] is not None
        ][-most:]
        target = self.pools[lower]
        if target.num_free < len(batch) and not self.demoter.clean_room(lower, len(batch), owner):
            batch = batch[len(batch) - target.num_free :] if target.num_free else []
        if not batch:
            return False
        offset = sum(n.size for n in self.index.path(node)[:-1])
        copy = plan_copy_down(self.state, [BlockRef(node, j) for j in batch], tier, lower)
        flight = DemotionFlight(
            pin=self.index.leases.acquire(node, (tier,), math.inf, 0, resident=False),
            positions=[offset + j for j in batch],
            dst={lower: copy.dst},
            copy=copy,
        )
        if ahead:
            self._copy_only.add(id(flight))
        else:
            self._pending_free[tier] += len(batch)
            leaving = (tier, node.root.ids)
            self._leaving[leaving] = self._leaving.get(leaving, 0) + len(batch)
        self.demoting[tier] += 1
        self.flights.add(flight)
        self.stats["demote_flights"] += 1
        self.runner.launch(flight, copy.transfer)
        return True

    def publish_demotion(self, flight: DemotionFlight) -> None:
        """The lower copies that landed enter the index (one its codec refused goes: `_kept`);
        then the source copies are freed (last first) unless leased, needed by closure, or by
        their namespace's floor (a call took its margin meanwhile: `test_floor_flights.py`)."""
        refs = self.index.refs_at(flight.pin.end, flight.positions)
        src, lower, namespace = flight.copy.tier, flight.copy.lower, flight.pin.end.root.ids
        flight.dst.pop(lower)
        ok = flight.ok if len(flight.ok) == len(refs) else [False] * len(refs)
        record_copies(self.state, flight.copy, refs, ok)
        self.stats["failed_blocks"] += (lost := ok.count(False))
        if lost and not flight.failed:
            flight.failed = f"{lost} of {len(ok)} copies to {self.pools[lower].name} failed"
        self.index.leases.release(flight.pin.lease_id)
        if id(flight) in self._copy_only:
            self._copy_only.discard(id(flight))
        else:
            self._pending_free[src] -= len(refs)
            leaving = (src, namespace)
            self._leaving[leaving] -= len(refs)
            if not self._leaving[leaving]:
                del self._leaving[leaving]
        self.demoting[src] -= 1
        for ref in reversed(_kept(self.state, refs, ok, src, lower)):
            node, i = ref
            if (
                node.slots[src][i] is not None
                and not node.locked(src)
                and self._spare(namespace, src) > 0
                and self.index.can_clear(ref, src)
            ):
                self.pools[src].free([self.index.clear_slot(ref, src)])
                self.state.counters[src].demotions += 1

    # ---- inserts below a disk-only prefix --------------------------------------------------

    def insert_on_disk(
        self, match: Match, key: bytes, blocks: torch.Tensor, namespace: BlockId, tenant: str
    ) -> InsertFlight | None:
        """Stage new blocks that extend a disk-only prefix in host slots and write them to disk
        in an insert flight, and return it; None (and nothing moved) when host or disk has no
        room for them."""
        count = len(blocks)
        host, disk = self.state.host, self.state.disk
        assert disk is not None
        # the pin keeps room-making off the prefix these blocks extend
        pin = self.index.leases.acquire(match.end, (DISK,), math.inf, 0, resident=False)
        needs = {HOST: count, DISK: count} if self.background else {DISK: count}
        if not self.demoter.room(needs, bytes(namespace)):
            self.index.leases.release(pin.lease_id)
            return None
        kb, ds = self.index.key_nbytes, self.index.digest_size
        start = match.num_blocks
        new_key = key[start * kb : (start + count) * kb]
        parent = self.index.forest.ids_of(match.end)[-ds:]
        ids = self.index.hasher.chain(parent, new_key, kb)
        metas = tuple(
            BlockMeta(
                ids[i * ds : (i + 1) * ds],
                ids[(i - 1) * ds : i * ds] if i else parent,
                namespace,
                tenant,
                new_key[i * kb : (i + 1) * kb],
            )
            for i in range(count)
        )
        source: SlotPool = host
        if self.background:  # the caller may reuse `blocks` once its call returns
            stage = host.allocate(count)
            try:  # KV a quantized host cannot keep: refused holding nothing, as `store_new` is
                host.write(stage, blocks)  # (before, its pin and staging slots leaked for good)
            except BaseException:
                host.free(stage)
                self.index.leases.release(pin.lease_id)
                raise
        else:  # the call waits for the write: read the caller's blocks where they are
            source, stage = StagedBlocks(host.layout, blocks), list(range(count))
        dst = disk.allocate(count)
        flight = InsertFlight(
            pin=pin,
            positions=[],
            dst={HOST: stage, DISK: dst} if self.background else {DISK: dst},
            namespace=bytes(namespace),
            tenant=tenant,
            key=key[: (start + count) * kb],
            first_block=start,
            write=Transfer(source, tuple(stage), disk, tuple(dst), metas),
        )
        self.flights.add(flight)
        self.stats["insert_flights"] += 1
        self._inserting += 1
        self.runner.launch(flight, flight.write)
        return flight

    def publish_insert(self, flight: InsertFlight) -> None:
        """The leading blocks that became durable enter the index (those someone stored
        meanwhile excepted); every other disk slot and the staging slots are freed."""
        self._inserting -= 1
        slots = flight.dst.pop(DISK)
        self.state.free(HOST, flight.dst.pop(HOST, []))
        self.index.leases.release(flight.pin.lease_id)
        ok = flight.ok if len(flight.ok) == len(slots) else [False] * len(slots)
        good = ok.index(False) if False in ok else len(ok)
        kb = self.index.key_nbytes
        start = flight.first_block
        match = self.index.match(BlockId(flight.namespace), flight.key[: (start + good) * kb])
        keep = 0
        if start <= match.num_blocks < start + good:
            keep = start + good - match.num_blocks
            first = match.num_blocks - start
            self.index.insert(
                match, flight.key[: (start + good) * kb], {DISK: slots[first : first + keep]}
            )
            slots = slots[:first] + slots[first + keep :]
        self.state.free(DISK, slots)
        flight.kept = keep
        if self.background and not flight.in_call:  # landed after the call: counted now, for
            # its tenant too (one that landed before the call's own reap is the call's)
            self.state.count(flight.tenant, stored_tokens=keep * self.index.block_tokens)
        lost = len(ok) - good
        if lost:
            self.stats["failed_blocks"] += lost
            flight.failed = flight.failed or f"{lost} of {len(ok)} disk writes failed"


def _kept(
    state: CacheState, refs: list[BlockRef], ok: Sequence[bool], src: int, lower: int
) -> list[BlockRef]:
    """`refs` (one prefix's, in order) less the first whose copy into `lower` its codec refused
    and all after it, dropped with all below them (`drop_unkeepable`, for no owner: never a
    namespace under its floor)."""
    for k, ref in enumerate(refs):
        if not ok[k] and drop_unkeepable(state, ref, src, lower):
            return refs[:k]
    return refs
