"""`IndexEvents`: the index's observer (`RadixIndex.observer`) that turns each copy a block gains
or loses in a tier into a BlockStored or BlockRemoved event of that tier's medium, for the
tenant whose namespace holds the block (`tenant_of`; a namespace it does not know is skipped).

Hashes. An event names a block by a number of this publisher's: a node's first block has
`node.ev`, block i `node.ev + i`; a node gets a range of `EVENT_RANGE` numbers when one of its
blocks is first told of (`number`: from its tenant's own serial, `FIRST_SERIALS`), and a split
hands the tail `ev + at` (`forest.py`), so a block keeps its number while it lives, and no two
live blocks share one. A block cut off a leaf and stored there again takes the same number back:
the router was told of its removal first, in order, as vLLM's content hashes come back when a
block is stored again. Not the block's id: an id is a BLAKE2b chain that the index computes only
when something needs it, and a store that must compute 63 of them to tell of a prompt costs 1.3x
one that does not (`benchmarks/bench_events.py`).

Cost. Called under the store's lock, once per edit whatever the tiers, it appends one tuple of
references and numbers to the publisher's queue (`wire.told_stored`, `wire.told_removed`): no
slice, no allocation but the tuple, no NumPy call. An edit of one block that continues the entry
queued last in its medium (`open`) replaces that entry instead: the next (or the previous) block of
a node stored in the same tiers, or a removal from one medium whose number runs on from (or up to)
that entry's. The entry need not be the queue's last: entries of other media may follow it (up to
`JOIN_DEPTH`), because a block moved a block at a time is edited in two media in turn (a demotion
gains the copy below, then loses the one above; a drop loses each copy). Joining moves an edit
ahead of the entries it passes, so it passes only entries it commutes with for a router that
keeps media apart (llm-d's pod entries carry the medium, as `kvtier.routing`'s do) and that
chains a BlockStored to its parent hash, which the pod must hold then, in some medium:
- a gain passes anything: the blocks it joins are held when the entry it joins was queued
  (prefix closure: the entry's blocks were held then, so were the blocks before them), so a
  router that applies it there finds its parent;
- a loss passes only losses (of other media). Past a BlockStored it could take away the parent
  that BlockStored chains to before the router applies it: a node's tail demoted to disk by
  flights while host copies go a block at a time from the end (`kvtier replay --route` met it:
  the host copy of the block before a flight's run was told lost before the run was told
  stored, and the router skipped the run as an orphan).
An event the publisher queued itself (`EventPublisher._put`: a clear) is never joined past. A
join costs about 1 us more than an append on the store's thread (the publisher's lock, a new
tuple; edits of runs are queued as they are) and saves the sending thread packing an event and
every router applying one. The mover's per-block paths (a prefetch's copies
published block by block, eviction and demotion a block at a time from a node's end) otherwise
queued an event per block: 55,893 events in 6 s of `bench_mover.py` (b), 2 blocks an event; 2,172
with joins of the queue's last entry. A node of 64 blocks demoted a block at a time, then promoted
again: 256 events before joins past another medium's entry (one a block and medium), 4 since.

The publisher's thread slices the node's key (immutable bytes: an edit replaces it, never
changes it) and packs the hashes and tokens with numpy (`wire.py`), one body for the tiers a
store wrote its new blocks to, and removals next to each other in one medium as one event.

`announce()` tells of every block the index holds, each tier a run at a time: the publisher's
first words after a restart (recovery rebuilt the index from disk before events were on).
`retold(wanted)` is the same for some tenants, returned: given the store's lock
(`store_lock`), the observer is the publisher's `source`, and a topic that lost events to a
full queue is told again from it (`EventPublisher._resync`), as are the topics of every one of
`tenants` when a peer joins (`EventPublisher._retell`: AllBlocksCleared first).
`snapshot(store, tenant)` is the same, returned rather than sent, with each topic's sequence
number at that moment (`GET /v1/blocks`, the routers' resync).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.errors import InvalidArgumentError
from kvtier.events import wire
from kvtier.events.publisher import EventPublisher
from kvtier.events.wire import TOLD_REMOVED, TOLD_STORED
from kvtier.index import RadixIndex
from kvtier.index.node import Node

if TYPE_CHECKING:
    from kvtier.store import KVStore

FIRST_SERIALS = 1 << 42
"""Event hashes are `(serial * lanes + lane) * EVENT_RANGE + i` (uint64), each tenant's first
serial drawn at random below this (and below half the serials its lane has), so that two
publishers' hashes seldom meet (a router keys blocks by tokens anyway: `kvtier.routing`): at
least 2**63 / (lanes * EVENT_RANGE) nodes of a tenant before its serials wrap around to 1 (two
tenants, three lanes: 2.9e12, 9 years at 10,000 new nodes a second).

Serials: each tenant numbers its nodes from a serial of its own (`lane`: its place among the
tenants), so the gap between two of a tenant's hashes counts only its own nodes. With one
serial for all, a tenant reading its own blocks (`GET /v1/blocks`, per-tenant topics) between
two of its stores learnt exactly how many new nodes the other tenants had made meanwhile (an
audit counted 1, 5 and 17 of another tenant's stores so). The lanes keep tenants' hashes apart on
a topic they share."""

JOIN_DEPTH = 4
"""Entries at the queue's end that an edit of one block may join (module doc), past entries of
other media only: one per medium, so that a block edited in two or three media in turn (a
demotion gains the copy below, then loses the one above; a drop loses every copy) still joins
the run of each medium."""

MEDIUM_OF_TIER = {"gpu": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}


class IndexEvents:
    def __init__(
        self,
        publisher: EventPublisher,
        index: RadixIndex,
        tenant_of: Callable[[bytes], str | None],
        store_lock: AbstractContextManager[Any] | None = None,
        tenants: Iterable[str] = (),
    ) -> None:
        """`store_lock`: the lock every edit of `index` holds; with it, the publisher resyncs
        a lost topic from this observer (module doc). `tenants`: every tenant `tenant_of`
        names, whose topics a retell clears (`EventPublisher._retell`)."""
        self.publisher, self.index, self.tenant_of = publisher, index, tenant_of
        self.tenants = tuple(tenants)
        self.media = [MEDIUM_OF_TIER.get(name, name.upper()) for name in index.tiers]
        assert all(len(wire.medium_bytes(m)) <= wire.MEDIUM_ROOM for m in self.media)
        self.range = index.forest.node_blocks  # numbers a node takes (`EVENT_RANGE`)
        # A serial per tenant (`number`), the last for a namespace no tenant owns.
        self._lane: dict[str | None, int] = {t: i for i, t in enumerate(self.tenants)}
        self._lanes = len(self.tenants) + 1
        first = max(1, min(FIRST_SERIALS, (1 << 64) // (self._lanes * self.range) // 2))
        self._serials = [secrets.randbelow(first) + 1 for _ in range(self._lanes)]  # never 0
        self.pending = publisher.pending  # appended to directly (`EventPublisher._put`)
        self.queue_limit = publisher.queue_limit  # fixed by the settings
        self.lock = publisher.lock  # held to change an entry of the queue (`_join_into`)
        # per tier, the entry queued last of its medium: an edit of one block may join it
        self.open: list[tuple[str, wire.Spec] | None] = [None] * len(index.tiers)
        self.kb, self.bs = index.key_nbytes, index.block_tokens
        if store_lock is not None:
            self.store_lock = store_lock
            publisher.source = self

    def gained(self, node: Node, lo: int, hi: int, tiers: tuple[int, ...]) -> None:
        tenant = self.tenant_of(node.root.ids)
        if tenant is None:
            return
        ev = node.ev or self.number(node)
        above = None  # the hash of the block before the run, when there is one
        if lo:
            above = ev + lo - 1
        else:
            parent = node.parent
            if parent is not None and parent.parent is not None:
                above = (parent.ev or self.number(parent)) + len(parent.slots[0]) - 1
        if hi - lo == 1:  # a block at a time (the mover's paths): it may continue a run
            entry = self.open[tiers[0]]
            if (
                entry is not None
                and entry[0] == tenant
                and all(self.open[t] is entry for t in tiers[1:])  # the last of each medium
            ):
                last = entry[1]
                if (
                    type(last) is tuple
                    and last[0] == TOLD_STORED
                    and last[1] is node.key
                    and last[3] == ev
                    and last[8] == tiers
                ):
                    spec = None
                    if last[5] == lo:  # the block after the run
                        spec = (*last[:5], hi, *last[6:])
                    elif last[4] == hi:  # the block before it (taken from the end)
                        spec = (*last[:4], lo, last[5], above, *last[7:])
                    if spec is not None and self._join_into(entry, (tenant, spec), tiers):
                        return
        entry = (
            tenant,
            (TOLD_STORED, node.key, self.kb, ev, lo, hi, above, self.bs, tiers, self.media),
        )
        if len(self.pending) < self.queue_limit:  # `_append`, without its frame (every insert)
            self.pending.append(entry)
            for tier in tiers:
                self.open[tier] = entry
        else:
            self.publisher.overflow(tenant)

    def lost(self, node: Node, lo: int, hi: int, tiers: tuple[int, ...]) -> None:
        tenant = None
        slots = node.slots
        for tier in tiers:
            run = slots[tier][lo:hi]
            missing = run.count(None)  # in C: most often all held or none
            if missing == hi - lo:
                continue
            if tenant is None:
                tenant = self.tenant_of(node.root.ids)
                if tenant is None:
                    return
            ev = node.ev or self.number(node)
            spec: wire.Spec
            medium = self.media[tier]
            if hi - lo == 1:  # a block at a time (the mover's paths): it may continue a run
                entry = self.open[tier]
                if entry is not None and entry[0] == tenant:
                    last, number = entry[1], ev + lo
                    if type(last) is tuple and last[0] == TOLD_REMOVED and last[3] == medium:
                        joined = None
                        if last[1] == number + 1:  # the block before (eviction: from the end)
                            joined = (TOLD_REMOVED, number, last[2] + 1, medium)
                        elif last[1] + last[2] == number:  # the block after
                            joined = (TOLD_REMOVED, last[1], last[2] + 1, medium)
                        if joined is not None and self._join_into(entry, (tenant, joined), (tier,)):
                            continue
            if not missing:
                spec = (TOLD_REMOVED, ev + lo, hi - lo, medium)
            else:
                held = [ev + lo + j for j, slot in enumerate(run) if slot is not None]
                spec = wire.Removed(np.array(held, ">u8").tobytes(), medium)
            self._append((tenant, spec), (tier,))

    def _append(self, entry: tuple[str, wire.Spec], tiers: tuple[int, ...]) -> None:
        """Queue `entry` (one append: atomic, no lock; see `_join_into`), now the last of
        `tiers`' media."""
        if len(self.pending) < self.queue_limit:
            self.pending.append(entry)
            for tier in tiers:
                self.open[tier] = entry
        else:
            self.publisher.overflow(*entry)  # a removal is kept for the resync

    def _join_into(
        self, entry: tuple[str, wire.Spec], new: tuple[str, wire.Spec], tiers: tuple[int, ...]
    ) -> bool:
        """Put `new` in place of `entry`, the last entry of `tiers`' media, if it is among the
        queue's last `JOIN_DEPTH` entries and only this observer's entries (of other media)
        follow it, and only losses when `new` is a loss; whether it did (module doc).

        Under the publisher's lock: the sender pops from the other end under it too, and the
        store's lock keeps other observers' calls out. Appends take no lock, but only this
        thread and `EventPublisher._put` (under the lock) add to the queue, and an event `_put`
        queued (a clear, a packed event: never a `told_*` tuple, which are this observer's)
        ends the search: nothing moves ahead of it."""
        pending = self.pending
        loss = new[1][0] == TOLD_REMOVED
        with self.lock:
            back = 1
            try:
                while (passed := pending[-back]) is not entry:
                    spec = passed[1]
                    if back == JOIN_DEPTH or type(spec) is not tuple:
                        return False
                    if loss and spec[0] != TOLD_REMOVED:  # a loss passes no gain (module doc)
                        return False
                    back += 1
            except IndexError:  # sent meanwhile
                return False
            pending[-back] = new
        for tier in tiers:
            self.open[tier] = new
        return True

    def number(self, node: Node) -> int:
        """The event hash of `node`'s first block (`node.ev`), its range handed out if it has
        none yet: `(serial * lanes + lane) * range`, the serial its tenant's own (module doc,
        "Serials")."""
        if not node.ev:
            lane = self._lane.get(self.tenant_of(node.root.ids), self._lanes - 1)
            serial = self._serials[lane]
            if ((serial * self._lanes + lane + 1) * self.range) >> 64:  # uint64s: wrap around
                serial = 1
            node.ev = (serial * self._lanes + lane) * self.range
            self._serials[lane] = serial + 1
        return node.ev

    def announce(self) -> int:
        """Tell of every block the index holds (module doc); the events queued."""
        told = 0
        for node, lo, hi, tier in self._runs():
            self.gained(node, lo, hi, (tier,))
            told += 1
        return told

    def retold(self, wanted: Callable[[str], bool]) -> list[tuple[str, wire.Spec]]:
        """`told(wanted)` for a resync (`EventPublisher._resync`): the publisher took its
        queue first, so no entry is left to join. Under the store's lock."""
        self.open = [None] * len(self.open)
        return self.told(wanted)

    def told(self, wanted: Callable[[str], bool]) -> list[tuple[str, wire.Spec]]:
        """(tenant, event) for every run of blocks held in a tier by a tenant `wanted` names,
        parents first, as `told_stored` specs (no bytes made under the lock: `wire.Packer`
        packs them). Under the store's lock, walking the wanted tenants' namespaces only: a
        tenant's `GET /v1/blocks` (or its topic's resync) costs the lock what that tenant holds,
        not what all do (before, one block's snapshot walked every tenant's nodes: 18 ms of the
        lock behind 20,000 nodes of another tenant's, each call, back to back)."""
        out: list[tuple[str, wire.Spec]] = []
        for node, lo, hi, tier in self._runs(wanted):
            tenant = self.tenant_of(node.root.ids)
            assert tenant is not None, "`_runs` walks the roots of wanted tenants only"
            ev = self.number(node)
            spec = (TOLD_STORED, node.key, self.kb, ev, lo, hi, self._parent_hash(node, lo),
                    self.bs, (tier,), self.media)  # fmt: skip
            out.append((tenant, spec))
        return out

    def _runs(
        self, wanted: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[Node, int, int, int]]:
        """(node, lo, hi, tier) for each run of a node's blocks held in a tier, every node
        before its children; with `wanted`, in the namespaces of the tenants it names only."""
        for root in self.index.roots():
            if wanted is not None:
                owner = self.tenant_of(root.ids)
                if owner is None or not wanted(owner):
                    continue
            stack = list(root.children.values()) if root.children else []
            while stack:
                node = stack.pop()
                for tier, slots in enumerate(node.slots):
                    lo = None
                    for i, slot in enumerate([*slots, None]):
                        if slot is not None and lo is None:
                            lo = i
                        elif slot is None and lo is not None:
                            yield node, lo, i, tier
                            lo = None
                stack.extend(node.children.values() if node.children else ())

    def _parent_hash(self, node: Node, lo: int) -> int | None:
        """The hash of the block before `node`'s block `lo`; None for a namespace's first
        (`gained` computes it inline)."""
        if lo:
            return self.number(node) + lo - 1
        parent = node.parent
        if parent is not None and parent.parent is not None:
            return self.number(parent) + parent.size - 1
        return None


def snapshot(store: KVStore, tenant: str | None) -> dict[str, Any]:
    """What `GET /v1/blocks` answers: per topic, its sequence number when the snapshot was
    taken (`seq`: the next message's; every event of a call that returned before this one was
    sent below it) and an event batch telling of every block held
    (`events`, the wire's bytes: `PrefixIndex.apply` takes it), `tenant`'s blocks only unless
    None; `InvalidArgumentError` when the store publishes no events."""
    publisher, observer = store.parts.events, store.index.observer
    if publisher is None or not isinstance(observer, IndexEvents):
        raise InvalidArgumentError("GET /v1/blocks: this store publishes no events (`events`)")
    # Send what is queued first: the events of every call that returned before this one are
    # then below `seq`, so a router that rebuilds from the snapshot replays only what came after
    # it (events queued between here and the lock are in the snapshot and at or above `seq`:
    # telling a router twice of a block is harmless, and the order of edits is kept).
    publisher.flush()
    with store.parts.state.lock:
        told = observer.told(lambda owner: tenant in (None, owner))
        names = {publisher.topic_of(owner) for owner, _ in told}
        if tenant is not None:
            names.add(publisher.topic_of(tenant))
        seqs = {name: publisher.next_seq(name) for name in names}
    packer = wire.Packer()
    topics = []
    for name in sorted(seqs):
        events = packer.pack_all(
            [spec for owner, spec in told if publisher.topic_of(owner) == name]
        )
        batch = wire.batch(time.time(), events, None)
        topics.append({"topic": name, "seq": seqs[name], "events": batch})
    return {"block_size": store.index.block_tokens, "topics": topics}
