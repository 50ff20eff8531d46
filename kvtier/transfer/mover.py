"""The mover: prefetch leases, background demotion and disk writes, as flights (`flights.py`).

    plan (store lock)                 copy (no lock)                publish (store lock)
    pin the path, allocate     --->   executor: worker threads  --> set_slot / clear_slot,
    destinations, submit              or CUDA streams               free slots, resolve leases

Contract:
- **Prefetch** (`prefetch`) brings the whole cached prefix to gpu, all or nothing: the gpu
  slots of the missing blocks are allocated when it is planned (`CapacityError` at once if the
  gpu tier cannot hold them beside what is leased), the lease is returned PENDING with its final
  block table, and turns READY when every copy is in the index. Disk copies are read into host
  staging slots and verified before anything moves up (they keep that host copy under
  write_through; a CPU gpu pool without that policy reads them straight in); the host ->
  gpu copy goes in `layer_groups` layer-range transfers, so `lease.layers_ready` grows while the
  copy runs. A block already on its way to gpu is joined, not copied twice; a flight that
  joined others publishes after them, so prefix closure holds at every step. A corrupt disk
  copy fails the flight and its leases (FAILED); the block is dropped with everything below it,
  at once or as soon as nothing below it is locked, and until then prefetches stop before it.
- **Leases** are locked in every tier while pending (their sources must stay), on gpu only once
  READY. They end RELEASED, CANCELLED, EXPIRED (the store's clock; the mover thread expires
  them even when nobody calls) or FAILED, and every waiter wakes.
- **Background demotion**: when a memory tier's use, less what its flights will free, passes
  its high watermark, its least-recently-used leaves are copied to the next tier (admission
  rules as in `demotion.py`) in flights of up to `BATCH` blocks, and freed once the copy is in,
  down to the low watermark. Only where a lower tier exists: the lowest memory tier drops
  leaves only on demand. At most `MAX_DEMOTIONS` demotion flights per tier are in flight.
- **Backpressure**: in background mode the store's synchronous room-making never writes to
  disk (`Demoter.sync_disk` is off): a host leaf that would need a disk copy to make room is
  dropped and counted (`backpressure_drops`). New blocks below a disk-only prefix are staged in
  host slots and written in an insert flight; they enter the index once durable.
- With an `InlineExecutor` (`mover.background: false`), every flight runs inside the call that
  plans it and is published before the call returns, through the same code.
- `reserved(tier)` counts the slots flights own: the store's `check()` adds it to residency.
- Fair shares: a prefetch makes room for its own namespace (`Demoter.make_room(..., owner)`);
  watermark demotion, the mover's own work, takes only blocks above floors. A lease is held for
  its tenant (`LeaseTable`, `held=True`): its blocks count in the tenant's quota, which the
  store checks between `match_prefix` and `prefetch`; `leases_of(tenant)` counts its leases.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.errors import CapacityError, ClosedError, InvariantError, LeaseError
from kvtier.hashing import BlockId
from kvtier.index import BlockRef, LeaseId, Match, RadixIndex
from kvtier.index.node import Node
from kvtier.results import Lease, LeaseState
from kvtier.tiers import SlotPool
from kvtier.tiers.base import DISK, GPU, HOST, Tier
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.transfer.copy import Transfer
from kvtier.transfer.demotion import Demoter, TierCounters, is_leaf
from kvtier.transfer.flights import Flight, FlightRunner
from kvtier.transfer.handles import Executor

log = logging.getLogger("kvtier.mover")

BATCH = 32
"""Blocks per demotion flight (one group commit when the lower tier is disk)."""

MAX_DEMOTIONS = 8
"""Demotion flights in flight per tier: enough to keep a path busy, few enough that the store's
lock is never held long to plan them."""

POLL_S = 0.0005
"""How often the thread polls an executor whose completion must be probed (CUDA events)."""

IDLE_WAKE_S = 0.25
"""The mover thread looks at watermarks and expiries at least this often."""

RECENT_READY = 1024
"""Prefetch-to-ready times kept for the status percentiles."""


class Mover:
    def __init__(
        self,
        *,
        index: RadixIndex,
        pools: Sequence[Tier],
        demoter: Demoter,
        counters: Sequence[TierCounters],
        ops: dict[str, int],
        clock: Callable[[], float],
        lock: threading.RLock,
        executor: Executor,
        background: bool,
        watermarks: Sequence[tuple[float, float]],
        admission: Sequence[int],
        layer_groups: int,
        keep_host_copy: bool = True,
        lift_on_lookup: bool = False,
    ) -> None:
        """`lock` is the store's: every method but `kick` is called with it held, and the
        thread takes it. `watermarks[t]`: (high, low) of memory tier t. `keep_host_copy`: disk
        blocks promoted to gpu keep their host staging copy (write_through)."""
        self.index = index
        self.pools = list(pools)
        gpu = self.pools[GPU]
        assert isinstance(gpu, SlotPool)
        self.gpu = gpu
        self.demoter = demoter
        self.counters = list(counters)
        self.ops = ops
        self.clock = clock
        self.lock = lock
        self.executor = executor
        self.background = background
        self.watermarks = list(watermarks)
        self.admission = list(admission)
        self.num_layers = gpu.layout.num_layers
        self.groups = max(1, min(layer_groups, self.num_layers))
        self.keep_host_copy = keep_host_copy
        self.lift_on_lookup = lift_on_lookup
        self.runner = FlightRunner(executor, self._on_finished)
        self.leases: dict[LeaseId, Lease] = {}
        self._per_tenant: dict[str, int] = {}  # live leases per tenant
        self._waits: dict[LeaseId, list[Flight]] = {}  # pending lease -> flights it waits on
        self._flights: set[Flight] = set()  # planned, not yet published
        self._finished: deque[Flight] = deque()  # copies done, to publish (any thread appends)
        self._unpublished: list[Flight] = []  # finished, waiting for flights they joined
        self._to_gpu: dict[BlockId, tuple[Flight, int]] = {}  # in flight to gpu: flight, slot
        self._pending_free = [0] * len(self.pools)  # slots demotion flights will free
        self._demoting = [0] * len(self.pools)  # demotion flights in flight per source tier
        self._doomed: dict[BlockId, tuple[BlockId, bytes]] = {}  # corrupt: namespace, key
        self._lifts: deque[tuple[BlockId, bytes]] = deque(maxlen=64)
        self._ready_s: deque[float] = deque(maxlen=RECENT_READY)
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "prefetch_flights",
                "joined_prefetches",
                "demote_flights",
                "insert_flights",
                "failed_flights",
                "failed_blocks",
                "lifted_blocks",
                "leases_cancelled",
                "leases_failed",
                "step_errors",
            ),
            0,
        )
        self.last_error = ""
        self._wake = threading.Event()
        self._drained = threading.Event()  # set whenever a flight finishes (for `drain`)
        self._stop = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._wake), name="kvtier-mover", daemon=True
            )
            self._thread.start()

    @property
    def _all_tiers(self) -> tuple[int, ...]:
        return tuple(range(len(self.pools)))

    # ---- prefetch leases ------------------------------------------------------------------

    def match_prefix(self, namespace: BlockId, key: bytes) -> Match:
        """What a prefetch of `key` would lease: its cached prefix, cut before a block known to
        be corrupt (finished flights are published first). Changes only recency (and splits a
        node where the prefix ends), so the caller can check it before `prefetch`."""
        self.reap()
        return self._before_doomed(namespace, key, self.index.match(namespace, key))

    def prefetch(
        self,
        match: Match,
        tenant: str,
        expires_at: float,
        canceller: Callable[[Lease], None] | None,
    ) -> Lease:
        """Plan the promotion of `match` (from `match_prefix`, with the store's lock held since)
        and lease it for `tenant` (see the module doc)."""
        record = self.index.leases.acquire(
            match.end, self._all_tiers, expires_at, match.num_blocks, resident=False, held=True
        )
        try:
            table, flights = self._plan_promotion(match.end)
        except BaseException:
            self.index.leases.release(record.lease_id)
            raise
        lease = Lease(
            record.lease_id,
            tenant,
            match.num_blocks * self.index.block_tokens,
            table,
            expires_at,
            num_layers=self.num_layers,
            pending=True,
            canceller=canceller,
        )
        self.leases[record.lease_id] = lease
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._waits[record.lease_id] = flights
        for flight in flights:  # all of them before any flight's callback can see the lease
            lease._wait_on(flight, self._layers_of_groups)
        for flight in flights:
            flight.leases.append(lease)
        lease._progress()
        self._settle(lease)
        self.reap()  # inline copies are done already: publish them before returning
        return lease

    def _layers_of_groups(self, groups: int) -> int:
        return self.num_layers * groups // self.groups

    def _plan_promotion(self, end: Node) -> tuple[tuple[int, ...], list[Flight]]:
        """Gpu slots for every block of the path to `end` (the lease record locks it), and the
        flights the lease waits on: joined ones, and a new one for the rest."""
        table, joined, new = self._missing(end)
        if joined:
            self.stats["joined_prefetches"] += 1
        if not new:
            return tuple(table), joined
        flight = self._plan_prefetch_flight(end, new, joined)
        for (position, _), slot in zip(new, flight.dst[GPU], strict=True):
            table[position] = slot
        return tuple(table), [*joined, flight]

    def _missing(self, end: Node) -> tuple[list[int], list[Flight], list[tuple[int, BlockRef]]]:
        """Along the path to `end`: each block's gpu slot (-1 where none is planned yet), the
        flights already bringing some of them up, and (position, block) of the others."""
        table: list[int] = []
        joined: dict[Flight, None] = {}
        new: list[tuple[int, BlockRef]] = []
        for position, ref in enumerate(self.index.blocks(end)):
            slot = ref.node.slots[GPU][ref.i]
            if slot is None:
                entry = self._to_gpu.get(self.index.block_id(ref))
                if entry is not None:
                    joined[entry[0]] = None
                    slot = entry[1]
                else:
                    new.append((position, ref))
                    slot = -1
            table.append(slot)
        return table, list(joined), new

    def _plan_prefetch_flight(
        self, end: Node, new: list[tuple[int, BlockRef]], after: list[Flight]
    ) -> Flight:
        count = len(new)
        owner = end.root.ids  # room is made for the namespace of the prefix (fair shares)
        if not (
            self.demoter.can_make_room(GPU, count, owner)
            and self.demoter.make_room(GPU, count, owner)
        ):
            freeable = self.gpu.num_free + self.demoter.evictable(GPU, owner)
            raise CapacityError(
                f"prefetch: {count} blocks must come up to gpu, but only "
                f"{freeable} of {self.gpu.num_slots} gpu slots "
                "can be freed (the rest hold leased, pinned or in-flight blocks, or other "
                "tenants' blocks within their floors)"
            )
        from_disk = [(p, ref) for p, ref in new if ref.node.fastest(ref.i) == DISK]
        host = self.pools[HOST]
        # through host when the policy keeps host copies, or when it must (a CUDA pool)
        stage = bool(from_disk) and (self.keep_host_copy or self.gpu.device.type != "cpu")
        stage = stage and self.demoter.can_make_room(HOST, len(from_disk), owner)
        if stage:
            stage = self.demoter.make_room(HOST, len(from_disk), owner)
        if from_disk and not stage and self.gpu.device.type != "cpu":
            raise CapacityError(
                f"prefetch: {len(from_disk)} disk blocks need host staging slots, but the host "
                "tier cannot free them (leased or in flight)"
            )
        gpu_dst = self.gpu.allocate(count)
        pin = self.index.leases.acquire(end, self._all_tiers, math.inf, 0, resident=False)
        flight = Flight("prefetch", pin, [p for p, _ in new], groups=self.groups, after=after)
        flight.dst[GPU] = gpu_dst
        dst_of = dict(zip(flight.positions, gpu_dst, strict=True))
        up_src: list[int] = []  # host slots the gpu copies read, in block order
        up_dst: list[int] = []
        if from_disk:
            disk = self.pools[DISK]
            positions = [p for p, _ in from_disk]
            read_dst = host.allocate(len(from_disk)) if stage else [dst_of[p] for p in positions]
            if stage:
                flight.dst[HOST] = read_dst
                flight.staged = dict(zip(positions, read_dst, strict=True))
            flight.read_positions = positions
            flight.read = Transfer(
                disk,
                tuple(_slot(ref.node.slots[DISK][ref.i]) for _, ref in from_disk),
                host if stage else self.gpu,
                tuple(read_dst),
                tuple(self.demoter.describe(ref) for _, ref in from_disk),
            )
        for position, ref in new:
            if ref.node.fastest(ref.i) == HOST:
                up_src.append(_slot(ref.node.slots[HOST][ref.i]))
            elif position in flight.staged:
                up_src.append(flight.staged[position])
            else:
                continue  # read straight into its gpu slot
            up_dst.append(dst_of[position])
        if up_src:
            bounds = [self.num_layers * g // self.groups for g in range(self.groups + 1)]
            flight.group_transfers = [
                Transfer(
                    host, tuple(up_src), self.gpu, tuple(up_dst), layers=(bounds[g], bounds[g + 1])
                )
                for g in range(self.groups)
            ]
        for (_, ref), slot in zip(new, gpu_dst, strict=True):
            self._to_gpu[self.index.block_id(ref)] = (flight, slot)
        self._flights.add(flight)
        self.stats["prefetch_flights"] += 1
        self.runner.launch_prefetch(flight)
        return flight

    def _before_doomed(self, namespace: BlockId, key: bytes, match: Match) -> Match:
        """`match`, cut before the first block known to be corrupt (not yet droppable)."""
        if not self._doomed:
            return match
        for position, ref in enumerate(self.index.blocks(match.end)):
            if self.index.block_id(ref) in self._doomed:
                return self.index.match(namespace, key[: position * self.index.key_nbytes])
        return match

    def release(self, lease_id: LeaseId) -> None:
        """Unlock a lease in any live state (`LeaseError` if unknown, released or expired)."""
        lease = self.leases.get(lease_id)
        if lease is None:  # never the id of a pin: those are the mover's own
            raise LeaseError(f"lease {lease_id}: unknown, released or expired")
        self.index.leases.release(lease_id)
        self._end(lease, LeaseState.RELEASED if lease.ready() else LeaseState.CANCELLED)

    def cancel(self, lease: Lease) -> None:
        """Cancel a pending lease (its flights go on and publish; nothing waits on them), or
        release a ready one."""
        if self.leases.get(LeaseId(lease.lease_id)) is not lease:
            raise LeaseError(f"lease {lease.lease_id}: unknown, released or expired")
        if lease.ready():
            self.release(LeaseId(lease.lease_id))
            return
        self.index.leases.release(LeaseId(lease.lease_id))
        self.stats["leases_cancelled"] += 1
        self._end(lease, LeaseState.CANCELLED, "cancelled")

    def expire(self) -> int:
        """End every lease past its expiry (the store's clock); return how many."""
        expired = self.index.leases.expire(self.clock())
        for record in expired:
            lease = self.leases.get(record.lease_id)
            if lease is not None:
                self._end(lease, LeaseState.EXPIRED, "expired before it was released")
        return len(expired)

    def leases_of(self, tenant: str) -> int:
        """Live leases of `tenant` (pending or ready)."""
        return self._per_tenant.get(tenant, 0)

    def _end(self, lease: Lease, state: LeaseState, reason: str = "") -> None:
        """The index record is gone already: forget the lease and wake its waiters."""
        if self.leases.pop(LeaseId(lease.lease_id), None) is not None:
            left = self._per_tenant[lease.tenant] - 1
            if left:
                self._per_tenant[lease.tenant] = left
            else:
                del self._per_tenant[lease.tenant]
        for flight in self._waits.pop(LeaseId(lease.lease_id), ()):
            if lease in flight.leases:
                flight.leases.remove(lease)
        lease._resolve(state, reason)

    def _settle(self, lease: Lease) -> None:
        """Make a pending lease READY once all its flights are published, FAILED if one failed."""
        if lease.state is not LeaseState.PENDING:
            return
        flights = self._waits.get(LeaseId(lease.lease_id), [])
        failed = next((f for f in flights if f.published and f.failed), None)
        if failed is not None:
            self.index.leases.release(LeaseId(lease.lease_id))
            self.stats["leases_failed"] += 1
            self._end(lease, LeaseState.FAILED, failed.failed)
            return
        if all(f.published for f in flights):
            self.index.leases.narrow(LeaseId(lease.lease_id), (GPU,))
            self._waits.pop(LeaseId(lease.lease_id), None)
            lease._resolve(LeaseState.READY)
            if lease.ready_after_s is not None and flights:
                self._ready_s.append(lease.ready_after_s)

    # ---- publishing -----------------------------------------------------------------------

    def _on_finished(self, flight: Flight) -> None:
        """Called once per flight by the thread that completed its last copy."""
        self._finished.append(flight)
        self._wake.set()
        self._drained.set()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every flight is published (store lock held: copies need no lock, and the
        thread that would publish waits for it); True if none is left within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        polled = self.executor.polled
        while True:
            self._drained.clear()
            self.reap()
            if not self._flights:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._drained.wait(min(left, POLL_S if polled else 0.05))

    def reap(self) -> None:
        """Publish every finished flight whose joined flights are published (store lock held)."""
        self.executor.poll()  # drives CUDA completion; drains the thread executor's list
        while self._finished:
            self._unpublished.append(self._finished.popleft())
        progress = True
        while progress and self._unpublished:
            progress = False
            for flight in list(self._unpublished):
                if all(a.published for a in flight.after):
                    self._unpublished.remove(flight)
                    self._publish(flight)
                    progress = True

    def _publish(self, flight: Flight) -> None:
        if any(a.failed for a in flight.after) and not flight.failed:
            flight.failed = "a prefetch it joined failed"
        refs = self.index.refs_at(flight.pin.end, flight.positions)
        if flight.kind == "prefetch":
            self._publish_prefetch(flight, refs)
        elif flight.kind == "demote":
            self._publish_demotion(flight, refs)
        else:
            self._publish_insert(flight)
        flight.published = True
        self._flights.discard(flight)
        if flight.failed:
            self.stats["failed_flights"] += 1
            self.last_error = flight.failed
        for lease in list(flight.leases):
            self._settle(lease)
        self._drop_doomed()

    def _publish_prefetch(self, flight: Flight, refs: list[BlockRef]) -> None:
        gpu_dst = flight.dst.pop(GPU)
        stage = flight.dst.pop(HOST, [])
        for ref in refs:
            block_id = self.index.block_id(ref)
            entry = self._to_gpu.get(block_id)
            if entry is not None and entry[0] is flight:
                del self._to_gpu[block_id]
        if flight.failed:
            self.gpu.free(gpu_dst)
            if stage:
                self.pools[HOST].free(stage)
            if flight.bad_position is not None:
                bad = refs[flight.positions.index(flight.bad_position)]
                self._doomed[self.index.block_id(bad)] = self._address(flight.pin.end, bad)
            self.index.leases.release(flight.pin.lease_id)
            return
        for position, ref, slot in zip(flight.positions, refs, gpu_dst, strict=True):
            staged = flight.staged.get(position)
            if staged is not None:  # root first: the block before is on gpu already
                if self.keep_host_copy and ref.node.slots[HOST][ref.i] is None:
                    self.index.set_slot(ref, HOST, staged)
                    self.counters[HOST].promotions += 1
                else:
                    self.pools[HOST].free([staged])
            self.index.set_slot(ref, GPU, slot)
        self.counters[GPU].promotions += len(refs)
        self.index.leases.release(flight.pin.lease_id)

    def _address(self, end: Node, ref: BlockRef) -> tuple[BlockId, bytes]:
        """(namespace, key up to and including `ref`): how to find a block again later."""
        key = b""
        for node in self.index.path(end):
            if node is ref.node:
                key += node.key[: (ref.i + 1) * self.index.key_nbytes]
                break
            key += node.key
        return self.index.namespace_of(end), key

    def _drop_doomed(self) -> None:
        """Drop each corrupt block (and what hangs below it) once nothing there is locked."""
        for block_id, (namespace, key) in list(self._doomed.items()):
            match = self.index.match(namespace, key)
            blocks = len(key) // self.index.key_nbytes
            end = match.end
            if match.num_blocks < blocks or end.ids[-len(block_id) :] != block_id:
                del self._doomed[block_id]  # gone already
                continue
            if _subtree_locked(end, len(self.pools)):
                continue
            for tier, slot in self.index.drop_subtree(BlockRef(end, end.size - 1)):
                self.pools[tier].free([slot])
            self.ops["corrupt_dropped"] += 1
            del self._doomed[block_id]

    def _publish_demotion(self, flight: Flight, refs: list[BlockRef]) -> None:
        src, lower = flight.src_tier, flight.src_tier + 1
        dst = flight.dst.pop(lower)
        ok = flight.ok if len(flight.ok) == len(dst) else [False] * len(dst)
        for ref, slot, good in zip(refs, dst, ok, strict=True):
            if good and ref.node.slots[lower][ref.i] is None:
                self.index.set_slot(ref, lower, slot)
            else:
                self.pools[lower].free([slot])
                if not good:
                    self.stats["failed_blocks"] += 1
        if not all(ok) and not flight.failed:
            lost = ok.count(False)
            flight.failed = f"{lost} of {len(ok)} copies to {self.pools[lower].name} failed"
        self.index.leases.release(flight.pin.lease_id)
        self._pending_free[src] -= len(refs)
        self._demoting[src] -= 1
        if not flight.free_src:
            return
        for ref in reversed(refs):  # last first: each is then a leaf of the source tier
            node, i = ref
            if (
                node.slots[src][i] is not None
                and not node.locked(src)
                and self.index.can_clear(ref, src)
            ):
                self.pools[src].free([self.index.clear_slot(ref, src)])
                self.counters[src].demotions += 1

    def _publish_insert(self, flight: Flight) -> None:
        disk = self.pools[DISK]
        slots = flight.dst.pop(DISK)
        self.pools[HOST].free(flight.dst.pop(HOST))
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
        disk.free(slots)
        self.ops["stored_tokens"] += keep * self.index.block_tokens
        lost = len(ok) - good
        if lost:
            self.stats["failed_blocks"] += lost
            flight.failed = flight.failed or f"{lost} of {len(ok)} disk writes failed"

    # ---- background demotion and lifting --------------------------------------------------

    def step(self) -> None:
        """One round of the mover's work (store lock held): publish, expire, keep watermarks,
        lift. The thread runs it on every wake; inline stores call it after each change."""
        self.reap()
        self.ops["leases_expired"] += self.expire()
        for tier in range(len(self.watermarks)):
            if tier + 1 < len(self.pools):
                self._demote_over_watermark(tier)
        if self.lift_on_lookup:
            self._lift()
        self.reap()

    def pressure(self, tier: int) -> int:
        """Slots of `tier` in use, less those that demotion flights will free."""
        return self.pools[tier].num_used - self._pending_free[tier]

    def _demote_over_watermark(self, tier: int) -> None:
        pool = self.pools[tier]
        high, low = self.watermarks[tier]
        if self.pressure(tier) <= high * pool.num_slots:
            return
        goal = int(low * pool.num_slots)
        lower = tier + 1
        for ref in self.index.victims(tier):
            if self.pressure(tier) <= goal or self._demoting[tier] >= MAX_DEMOTIONS:
                return
            node, i = ref
            if any(node.slots[t][i] is not None for t in range(lower, len(self.pools))):
                if self.index.can_clear(ref, tier):
                    self.pools[tier].free([self.index.clear_slot(ref, tier)])
                    self.counters[tier].demotions += 1
                continue
            if not (node.hits >= self.admission[lower] or not is_leaf(ref)):
                if is_leaf(ref) and not any(node.locked(t) for t in self._all_tiers):
                    for t, slot in self.index.drop(ref):
                        self.pools[t].free([slot])
                    self.counters[tier].evictions += 1
                continue
            target = self.pools[lower]
            if isinstance(target, DiskTier) and not target.accepting_writes():
                return  # the disk refused writes: try again when its backoff ends (backoff.py)
            self._plan_demotion(ref, tier, lower)

    def _plan_demotion(self, ref: BlockRef, tier: int, lower: int) -> None:
        node, i = ref
        first = node.depth[tier - 1] if tier else 0  # where this node's tier-run starts
        batch = [
            j
            for j in range(max(first, i - BATCH + 1), i + 1)
            if node.slots[lower][j] is None and node.slots[tier][j] is not None
        ]
        pin = self.index.leases.acquire(node, (tier,), math.inf, 0, resident=False)
        target = self.pools[lower]
        if target.num_free < len(batch) and not self.demoter.make_room(lower, len(batch)):
            batch = batch[len(batch) - target.num_free :] if target.num_free else []
        if not batch:
            self.index.leases.release(pin.lease_id)
            return
        offset = sum(n.size for n in self.index.path(node)[:-1])
        flight = Flight("demote", pin, [offset + j for j in batch], src_tier=tier, free_src=True)
        dst = target.allocate(len(batch))
        flight.dst[lower] = dst
        blocks = [BlockRef(node, j) for j in batch]
        metas = (
            tuple(self.demoter.describe(b) for b in blocks) if isinstance(target, DiskTier) else ()
        )
        src = tuple(_slot(node.slots[tier][j]) for j in batch)
        self._pending_free[tier] += len(batch)
        self._demoting[tier] += 1
        self._flights.add(flight)
        self.stats["demote_flights"] += 1
        self.runner.launch(flight, [Transfer(self.pools[tier], src, target, tuple(dst), metas)])

    def note_lookup(self, namespace: BlockId, key: bytes) -> None:
        """A lookup hit blocks below gpu: remember the prefix (with `lift_on_lookup` on)."""
        self._lifts.append((namespace, key))
        self._wake.set()

    def _lift(self) -> None:
        """Bring remembered prefixes up while the gpu tier is under its low watermark, without
        evicting anything and without a lease (the blocks are then ordinary gpu copies)."""
        low = self.watermarks[GPU][1]
        while self._lifts and self.pressure(GPU) < low * self.gpu.num_slots:
            namespace, key = self._lifts.popleft()
            match = self._before_doomed(namespace, key, self.index.match(namespace, key))
            pin = self.index.leases.acquire(match.end, self._all_tiers, math.inf, 0, resident=False)
            try:
                _, joined, new = self._missing(match.end)
                if new and len(new) <= self.gpu.num_free:
                    self._plan_prefetch_flight(match.end, new, joined)
                    self.stats["lifted_blocks"] += len(new)
            except CapacityError:  # host staging slots were not to be had: skip it
                pass
            finally:
                self.index.leases.release(pin.lease_id)

    # ---- writes below a disk-only prefix --------------------------------------------------

    def insert_on_disk(
        self, match: Match, key: bytes, blocks: Any, namespace: BlockId, tenant: str
    ) -> int:
        """Stage new blocks that extend a disk-only prefix in host slots and write them to disk
        in an insert flight; return how many were accepted (0: no room, dropped)."""
        count = len(blocks)
        host, disk = self.pools[HOST], self.pools[DISK]
        assert isinstance(host, SlotPool) and isinstance(disk, DiskTier)
        pin = self.index.leases.acquire(match.end, (DISK,), math.inf, 0, resident=False)
        owner = bytes(namespace)
        room = (
            self.demoter.can_make_room(HOST, count, owner)
            and self.demoter.make_room(HOST, count, owner)
            and self.demoter.can_make_room(DISK, count, owner)
            and self.demoter.make_room(DISK, count, owner)
        )
        if not room:
            self.index.leases.release(pin.lease_id)
            return 0
        kb, ds = self.index.key_nbytes, self.index.digest_size
        start = match.num_blocks
        new_key = key[start * kb : (start + count) * kb]
        parent = match.end.ids[-ds:]
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
        stage = host.allocate(count)
        host.write(stage, blocks)
        dst = disk.allocate(count)
        flight = Flight("insert", pin, [], namespace=bytes(namespace), first_block=start)
        flight.key = key[: (start + count) * kb]
        flight.dst = {HOST: stage, DISK: dst}
        self._flights.add(flight)
        self.stats["insert_flights"] += 1
        self.runner.launch(flight, [Transfer(host, tuple(stage), disk, tuple(dst), metas)])
        self.reap()
        return count

    # ---- the thread -----------------------------------------------------------------------

    def kick(self) -> None:
        """Wake the thread (any thread may call it, with or without the store's lock)."""
        self._wake.set()

    def _wait_s(self) -> float:
        # a CUDA handle completes only when its event is queried: poll while copies run;
        # thread executors wake the thread from their done callbacks
        polled = self.executor.polled
        return POLL_S if polled and self._flights else IDLE_WAKE_S

    def _round(self) -> bool:
        """One wake of the thread; False when it should end."""
        with self.lock:
            if self._stop:
                return False
            try:
                self.step()
            except ClosedError:
                return False
            except Exception as exc:  # a bug: keep it visible in status, and keep moving
                self.last_error = f"mover step raised {exc!r}"
                self.stats["step_errors"] += 1
                log.exception("kvtier mover step failed")
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """End every lease (pending ones CANCELLED, ready ones RELEASED, waiters wake), wait
        (bounded) for the copies in flight and publish them, stop the thread. Call without the
        store's lock: the thread needs it to stop."""
        with self.lock:
            self._stop = True
            for lease_id, lease in list(self.leases.items()):
                self.index.leases.release(lease_id)
                state = LeaseState.RELEASED if lease.ready() else LeaseState.CANCELLED
                self._end(lease, state, "the store closed")
            if not self.drain(timeout_s):
                log.warning("kvtier mover: %d flights still in flight at close", len(self._flights))
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self.executor.close()

    # ---- accounting -----------------------------------------------------------------------

    def idle(self) -> bool:
        """No flight planned or finished and unpublished."""
        return not self._flights and not self._finished and not self._unpublished

    def pin_ids(self) -> set[LeaseId]:
        """The lease ids of the flights' pins (they are leases of the index, not of clients)."""
        return {flight.pin.lease_id for flight in self._flights}

    def gpu_slot_in_flight(self, block_id: BlockId) -> int | None:
        entry = self._to_gpu.get(block_id)
        return None if entry is None else entry[1]

    def reserved(self, tier: int) -> int:
        """Slots of `tier` that flights have allocated and the index does not know yet."""
        return sum(flight.reserved(tier) for flight in self._flights)

    def status(self) -> dict[str, Any]:
        ready = sorted(self._ready_s)
        return {
            "background": self.background,
            "in_flight": len(self._flights),
            "queued_transfers": self.executor.queued(),
            "pending_leases": sum(1 for lease in self.leases.values() if not lease.ready()),
            "corrupt_pending_drop": len(self._doomed),
            **self.stats,
            "prefetch_to_ready_s": {
                "count": len(ready),
                "p50": statistics.median(ready) if ready else 0.0,
                "p99": ready[min(len(ready) - 1, int(0.99 * len(ready)))] if ready else 0.0,
            },
            "last_error": self.last_error,
        }

    def check(self) -> None:
        """Flights own their slots alone, every pin is live, the in-flight map is current, the
        leases per tenant are counted right."""
        owned: set[tuple[int, int]] = set()
        for flight in self._flights:
            if flight.pin.lease_id not in self.index.leases:
                raise InvariantError(f"{flight.kind} flight: pin {flight.pin.lease_id} is gone")
            for tier, slots in flight.dst.items():
                for slot in slots:
                    if (tier, slot) in owned:
                        raise InvariantError(f"{self.pools[tier].name} slot {slot}: two flights")
                    owned.add((tier, slot))
        for block_id, (flight, slot) in self._to_gpu.items():
            if flight not in self._flights or slot not in flight.dst.get(GPU, ()):
                raise InvariantError(
                    f"block {block_id.hex()}: in flight to gpu slot {slot}, "
                    "but no live flight owns it"
                )
        for lease_id in self.leases:
            if lease_id not in self.index.leases:
                raise InvariantError(f"lease {lease_id}: live in the mover, gone from the index")
        for lease_id, lease in self.leases.items():
            if lease.state not in (LeaseState.PENDING, LeaseState.READY):
                raise InvariantError(f"lease {lease_id}: {lease.state.value} but still live")
        per_tenant: dict[str, int] = {}
        for lease in self.leases.values():
            per_tenant[lease.tenant] = per_tenant.get(lease.tenant, 0) + 1
        if per_tenant != self._per_tenant:
            raise InvariantError(f"leases per tenant {self._per_tenant} != recount {per_tenant}")


def _run(ref: weakref.ref[Mover], wake: threading.Event) -> None:
    """The mover thread. It holds its mover only while it works, so that a store dropped
    without `close()` is collected and its thread ends."""
    while True:
        mover = ref()
        if mover is None:
            return
        timeout = mover._wait_s()
        del mover
        wake.wait(timeout)
        wake.clear()
        mover = ref()
        if mover is None or not mover._round():
            return
        del mover


def _subtree_locked(end: Node, num_tiers: int) -> bool:
    """Whether `end` or anything below it is locked in some tier."""
    stack = [end]
    while stack:
        node = stack.pop()
        if any(node.locked(t) for t in range(num_tiers)):
            return True
        if node.children:
            stack.extend(node.children.values())
    return False


def _slot(slot: int | None) -> int:
    assert slot is not None
    return slot
