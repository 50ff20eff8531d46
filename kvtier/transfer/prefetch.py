"""Prefetch planning: bringing a cached prefix up to gpu in a flight, and publishing it.

Contract:
- `prefetch(match, ...)` brings the whole cached prefix to gpu, all or nothing: the gpu slots
  of the missing blocks are allocated when it is planned (`CapacityError` at once, with nothing
  moved, if the gpu tier cannot hold them beside what is leased: `Demoter.room` checks every
  tier first), and the lease (`leasing.py`) is returned PENDING with its final block table; it
  turns READY when every copy is in the index. Disk copies are read into host staging slots and
  verified before anything moves up (they keep that host copy under write_through; a CPU gpu
  pool without that policy, or without host room freeable with no drop, reads them straight
  in); the host -> gpu
  copy goes in `layer_groups` layer-range transfers, so `lease.layers_ready` grows while the
  copy runs. A block already on its way to gpu is joined, not copied twice; a flight that
  joined others publishes after them, so prefix closure holds at every step.
- A corrupt disk copy fails the flight and its leases (FAILED); the block is dropped with
  everything below it, at once or as soon as nothing below it is locked, and until then
  `match` stops before it.
- Lifting (`mover.lift_on_lookup`): prefixes that lookups found below gpu are brought up while
  the gpu tier is under its low watermark, and never past it (of a prefix, its leading blocks
  that fit), without evicting anything and without a lease.
- Fair shares: a prefetch makes room for its own namespace.
Thread: every method runs under the cache's lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from kvtier.blocks import BlockId
from kvtier.errors import CapacityError, InvariantError
from kvtier.index import BlockRef, Match
from kvtier.index.helpers import subtree_locked
from kvtier.index.node import Node, path
from kvtier.results import Lease
from kvtier.tiers.base import DISK, GPU, HOST
from kvtier.transfer.clean import has_clean_room
from kvtier.transfer.copy import Transfer
from kvtier.transfer.demotion import Demoter
from kvtier.transfer.flights import Flight, FlightRunner, Flights, PrefetchFlight
from kvtier.transfer.leasing import LeaseBook


@dataclass(frozen=True)
class PrefetchSettings:
    layer_groups: int  # host -> gpu copies per flight, by layer range
    keep_host_copy: bool  # disk blocks promoted to gpu keep their host staging copy
    lift_on_lookup: bool


class Prefetcher:
    def __init__(
        self,
        demoter: Demoter,
        flights: Flights,
        runner: FlightRunner,
        book: LeaseBook,
        settings: PrefetchSettings,
    ) -> None:
        self.state = demoter.state
        self.index = demoter.state.index
        self.gpu = demoter.state.gpu
        self.demoter = demoter
        self.flights = flights
        self.runner = runner
        self.book = book
        self.num_layers = self.gpu.layout.num_layers
        self.groups = max(1, min(settings.layer_groups, self.num_layers))
        self.keep_host_copy = settings.keep_host_copy
        self.lift_on_lookup = settings.lift_on_lookup
        self._to_gpu: dict[BlockId, tuple[PrefetchFlight, int]] = {}  # in flight: flight, slot
        self._doomed: dict[BlockId, tuple[BlockId, bytes]] = {}  # corrupt: namespace, key
        self._lifts: deque[tuple[BlockId, bytes]] = deque(maxlen=64)
        self.stats = dict.fromkeys(("prefetch_flights", "joined_prefetches", "lifted_blocks"), 0)

    # ---- planning --------------------------------------------------------------------------

    def match(self, namespace: BlockId, key: bytes) -> Match:
        """What a prefetch of `key` would lease: its cached prefix, cut before a block known to
        be corrupt. Changes only recency (and splits a node where the prefix ends)."""
        match = self.index.match(namespace, key)
        if not self._doomed:
            return match
        for position, ref in enumerate(self.index.blocks(match.end)):
            if self.index.block_id(ref) in self._doomed:
                return self.index.match(namespace, key[: position * self.index.key_nbytes])
        return match

    def prefetch(
        self,
        match: Match,
        tenant: str,
        expires_at: float,
        canceller: Callable[[Lease], None] | None,
    ) -> Lease:
        """Plan the promotion of `match` (from `match`, with the lock held since) and lease it
        for `tenant` (see the module doc)."""
        table, joined, new = self._missing(match.end)
        if new or joined:  # copies to wait for: every tier locked until they land
            tiers, resident = self.state.all_tiers, False
        else:  # all on gpu already: held there from the start (`LeaseBook.settle` narrows)
            tiers, resident = (GPU,), True
        record = self.index.leases.acquire(
            match.end, tiers, expires_at, match.num_blocks, resident=resident, held=True
        )
        try:
            if joined:
                self.stats["joined_prefetches"] += 1
            flights = list(joined)
            if new:
                flight = self._plan(match.end, new, joined)
                for (position, _), slot in zip(new, flight.dst[GPU], strict=True):
                    table[position] = slot
                flights.append(flight)
        except BaseException:
            self.index.leases.release(record.lease_id)
            raise
        return self.book.open(record, tenant, tuple(table), flights, self._layers, canceller)

    def _stages(self) -> bool:
        """Whether disk blocks come up through host: the policy keeps copies, or a CUDA pool."""
        return self.keep_host_copy or self.gpu.device.type != "cpu"

    def _layers(self, groups: int) -> int:
        return self.num_layers * groups // self.groups

    def _missing(
        self, end: Node
    ) -> tuple[list[int], list[PrefetchFlight], list[tuple[int, BlockRef]]]:
        """Along the path to `end`: each block's gpu slot (-1 where none is planned yet), the
        flights already bringing some of them up, and (position, block) of the others."""
        table: list[int] = []
        joined: dict[PrefetchFlight, None] = {}
        new: list[tuple[int, BlockRef]] = []
        for node in path(end):
            slots = node.slots[GPU]
            if None not in slots:  # in C: a node held on gpu whole, most often
                table += cast("list[int]", slots)
                continue
            for i, slot in enumerate(slots):
                if slot is None:
                    ref = BlockRef(node, i)
                    entry = self._to_gpu.get(self.index.block_id(ref))
                    if entry is not None:
                        joined[entry[0]] = None
                        slot = entry[1]
                    else:
                        new.append((len(table), ref))
                        slot = -1
                table.append(slot)
        return table, list(joined), new

    def _plan(
        self, end: Node, new: list[tuple[int, BlockRef]], after: list[PrefetchFlight]
    ) -> PrefetchFlight:
        count = len(new)
        owner = end.root.ids  # room is made for the namespace of the prefix (fair shares)
        from_disk = [(p, ref) for p, ref in new if ref.node.fastest(ref.i) == DISK]
        on_cuda = self.gpu.device.type != "cpu"
        stage = bool(from_disk) and self._stages()
        stage = stage and self.demoter.can_make_room(HOST, len(from_disk), owner)
        clean = on_cuda or has_clean_room(self.index, self.state.host, HOST, len(from_disk), owner)
        stage = stage and clean  # on a CPU pool staging is a choice, never bought with a drop
        if from_disk and not stage and on_cuda and self.demoter.can_make_room(GPU, count, owner):
            raise CapacityError(
                f"prefetch: {len(from_disk)} disk blocks need host staging slots, but the host "
                "tier cannot free them (leased or in flight)"
            )
        if not self.demoter.room(
            {GPU: count, HOST: len(from_disk)} if stage else {GPU: count}, owner
        ):
            # how many could be freed moves with other tenants' use: told only to a sole tenant
            sole = len(self.state.namespaces.seeds) == 1
            if self.gpu.num_free < count and self.demoter.can_make_room(GPU, count, owner):
                free = f"only {self.gpu.num_free} of" if sole else "not all"
                raise _stuck(count, free, self.gpu.num_slots)  # tried: some stayed
            freeable = self.gpu.num_free + self.demoter.evictable(GPU, owner)
            shown = f"only {freeable} of" if sole else "not all"
            raise CapacityError(
                f"prefetch: {count} blocks must come up to gpu, but {shown} "
                f"{self.gpu.num_slots} gpu slots "
                "can be freed (the rest hold leased, pinned or in-flight blocks, or other "
                "tenants' blocks within their floors)"
            )
        host = self.state.host
        gpu_dst = self.gpu.allocate(count)
        positions = [p for p, _ in new]
        dst_of = dict(zip(positions, gpu_dst, strict=True))
        dst = {GPU: gpu_dst}
        read: Transfer | None = None
        staged: dict[int, int] = {}
        if from_disk:
            disk = self.state.pools[DISK]
            read_positions = [p for p, _ in from_disk]
            read_dst = (
                host.allocate(len(from_disk)) if stage else [dst_of[p] for p in read_positions]
            )
            if stage:
                dst[HOST] = read_dst
                staged = dict(zip(read_positions, read_dst, strict=True))
            read = Transfer(
                disk,
                tuple(_slot(ref.node.slots[DISK][ref.i]) for _, ref in from_disk),
                host if stage else self.gpu,
                tuple(read_dst),
                self.state.namespaces.describe(self.index, [ref for _, ref in from_disk]),
            )
        up_src: list[int] = []  # host slots the gpu copies read, in block order
        up_dst: list[int] = []
        for position, ref in new:
            if ref.node.fastest(ref.i) == HOST:
                up_src.append(_slot(ref.node.slots[HOST][ref.i]))
            elif position in staged:
                up_src.append(staged[position])
            else:
                continue  # read straight into its gpu slot
            up_dst.append(dst_of[position])
        bounds = [self.num_layers * g // self.groups for g in range(self.groups + 1)]
        joined: list[Flight] = list(after)
        flight = PrefetchFlight(
            pin=self.index.leases.acquire(end, self.state.all_tiers, math.inf, 0, resident=False),
            positions=positions,
            dst=dst,
            after=joined,
            groups=self.groups,
            read=read,
            read_positions=[p for p, _ in from_disk],
            group_transfers=[
                Transfer(
                    host, tuple(up_src), self.gpu, tuple(up_dst), layers=(bounds[g], bounds[g + 1])
                )
                for g in range(self.groups)
            ]
            if up_src
            else [],
        )
        for (_, ref), slot in zip(new, gpu_dst, strict=True):
            self._to_gpu[self.index.block_id(ref)] = (flight, slot)
        self.flights.add(flight)
        self.stats["prefetch_flights"] += 1
        self.runner.launch_prefetch(flight)
        return flight

    # ---- publishing ------------------------------------------------------------------------

    def publish(self, flight: PrefetchFlight) -> None:
        """The flight's copies are done (and those of the flights it joined published): the
        index learns the gpu (and kept host) copies, or, if it failed, its slots are freed and
        a corrupt block is doomed; then its leases settle."""
        refs = self.index.refs_at(flight.pin.end, flight.positions)
        staged_at = flight.staged()
        gpu_dst = flight.dst.pop(GPU)
        stage = flight.dst.pop(HOST, [])
        for ref in refs:
            block_id = self.index.block_id(ref)
            entry = self._to_gpu.get(block_id)
            if entry is not None and entry[0] is flight:
                del self._to_gpu[block_id]
        if flight.failed:
            self.state.free(GPU, gpu_dst)
            self.state.free(HOST, stage)
            if flight.bad_position is not None:
                self.doom(refs[flight.positions.index(flight.bad_position)])
        else:
            counters = self.state.counters
            for position, ref, slot in zip(flight.positions, refs, gpu_dst, strict=True):
                staged = staged_at.get(position)
                if staged is not None:  # root first: the block before is on gpu already
                    if self.keep_host_copy and ref.node.slots[HOST][ref.i] is None:
                        self.index.set_slot(ref, HOST, staged)
                        counters[HOST].promotions += 1
                    else:
                        self.state.free(HOST, [staged])
                self.index.set_slot(ref, GPU, slot)
            counters[GPU].promotions += len(refs)
        self.index.leases.release(flight.pin.lease_id)
        for lease in list(flight.leases):
            self.book.settle(lease)

    def doom(self, ref: BlockRef) -> None:
        """`ref`'s disk copy failed verification: `drop_doomed` drops it (and what hangs below
        it) once nothing there is locked; until then `match` stops before it."""
        nodes = self.index.path(ref.node)
        key = b"".join(node.key for node in nodes[:-1])
        key += ref.node.key[: (ref.i + 1) * self.index.key_nbytes]
        self._doomed[self.index.block_id(ref)] = (self.index.namespace_of(ref.node), key)

    def drop_doomed(self) -> None:
        """Drop each corrupt block (and what hangs below it) once nothing there is locked."""
        for block_id, (namespace, key) in list(self._doomed.items()):
            match = self.index.match(namespace, key)
            end = match.end
            if (
                match.num_blocks < len(key) // self.index.key_nbytes
                or self.index.forest.ids_of(end)[-len(block_id) :] != block_id
            ):
                del self._doomed[block_id]  # gone already
                continue
            ref = BlockRef(end, end.size - 1)
            if subtree_locked(ref):
                continue
            for tier, slot in self.index.drop_subtree(ref):
                self.state.free(tier, [slot])
            self.state.ops["corrupt_dropped"] += 1
            del self._doomed[block_id]

    # ---- lifting ---------------------------------------------------------------------------

    def note_lookup(self, namespace: BlockId, key: bytes) -> None:
        """A lookup hit blocks below gpu: remember the prefix (with `lift_on_lookup` on)."""
        self._lifts.append((namespace, key))

    def lift(self, room: Callable[[], int]) -> None:
        """Bring remembered prefixes up while `room()` (the blocks gpu may take and stay at or
        below its low watermark) is positive, unleased, evicting, demoting or dropping nothing:
        of each, the leading missing blocks that fit in that room, in the free slots of gpu and
        (for disk blocks staged there) of host; a prefix none of whose blocks fit is skipped."""
        while self._lifts and (most := min(room(), self.gpu.num_free)) > 0:
            namespace, key = self._lifts.popleft()
            match = self.match(namespace, key)
            pin = self.index.leases.acquire(
                match.end, self.state.all_tiers, math.inf, 0, resident=False
            )
            try:
                _, joined, new = self._missing(match.end)
                staging = self.state.host.num_free if self._stages() else None
                new = new[: _leading(new, most, staging)]
                if new:
                    self._plan(match.end, new, joined)
                    self.stats["lifted_blocks"] += len(new)
            finally:
                self.index.leases.release(pin.lease_id)

    # ---- accounting ------------------------------------------------------------------------

    def gpu_slot_in_flight(self, block_id: BlockId) -> int | None:
        entry = self._to_gpu.get(block_id)
        return None if entry is None else entry[1]

    def corrupt_pending_drop(self) -> int:
        return len(self._doomed)

    def check(self) -> None:
        """Every block in flight to gpu names a live flight that owns its slot."""
        for block_id, (flight, slot) in self._to_gpu.items():
            if flight not in self.flights.live or slot not in flight.dst.get(GPU, ()):
                raise InvariantError(
                    f"block {block_id.hex()}: in flight to gpu slot {slot}, "
                    "but no live flight owns it"
                )


def _leading(new: list[tuple[int, BlockRef]], most: int, staging: int | None) -> int:
    """How many leading blocks of `new` a lift takes: at most `most`, and no more disk blocks
    than `staging` (host's free slots, when disk blocks come up through host; None: unbounded)."""
    count = 0
    for _, ref in new[:most]:
        if staging is not None and ref.node.fastest(ref.i) == DISK:
            if not staging:
                break
            staging -= 1
        count += 1
    return count


def _stuck(count: int, free: str, slots: int) -> CapacityError:
    """A prefetch's room-making ran and fell short: blocks it would have moved stayed (`free`:
    "only N of" to a sole tenant, else "not all", as other tenants' use moves N)."""
    return CapacityError(
        f"prefetch: {count} blocks must come up to gpu, but {free} {slots} gpu slots "
        "could be freed (the rest hold blocks that cannot move down now: no room below, or a "
        "lower tier refusing copies)"
    )


def _slot(slot: int | None) -> int:
    assert slot is not None
    return slot
