"""`IndexEvents`: the index's observer (`RadixIndex.observer`) that turns each copy a block gains
or loses in a tier into a BlockStored or BlockRemoved event of that tier's medium, for the
tenant whose namespace holds the block (`tenant_of`; a namespace it does not know is skipped).

Hashes. An event names a block by a number of this publisher's: the node keeps its blocks'
numbers in `node.marks` (8 bytes each, big-endian, a prefix of its blocks, like its ids), and
a block without one gets the next of a counter when it is first told of (`marks`). Splits and
cuts keep a block's number with it (`forest.py`); a number is never handed out twice, so a
block evicted and stored again is a new block to a router, as it is to the index. The counter
starts at a random 62-bit number, so that two publishers' numbers do not meet (a router keys
blocks by tokens anyway: `kvtier.routing`). Not the block's id: an id is a BLAKE2b chain that
the index computes only when something needs it, and a store that must compute 63 of them to
tell of a prompt costs 1.3x one that does not (`benchmarks/bench_events.py`).

Cost. Called under the store's lock, it slices `node.key` and `node.marks` into a `wire.Stored`
or `wire.Removed` and queues it; the publisher's thread packs it with numpy (`wire.py`): no
Python object per token, and none of the packing under the store's lock. A store writing new
blocks to two tiers tells of them twice: the same `wire.Blocks`, packed once.

`announce()` tells of every block the index holds, each tier a run at a time: the publisher's
first words after a restart (recovery rebuilt the index from disk before events were on).
`snapshot(store, tenant)` is the same, returned rather than sent, with each topic's sequence
number at that moment (`GET /v1/blocks`, the routers' resync).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.errors import InvalidArgumentError
from kvtier.events import wire
from kvtier.events.publisher import EventPublisher
from kvtier.index import RadixIndex
from kvtier.index.node import Node

if TYPE_CHECKING:
    from kvtier.store import KVStore

NUMBERS = 4096
"""Event numbers made in one NumPy call and handed out as slices of its bytes: a store's new
run of blocks takes its numbers without a NumPy call of its own (2.4 us of a 15 us insert)."""

MEDIUM_OF_TIER = {"gpu": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}


class IndexEvents:
    def __init__(
        self,
        publisher: EventPublisher,
        index: RadixIndex,
        tenant_of: Callable[[bytes], str | None],
    ) -> None:
        self.publisher, self.index, self.tenant_of = publisher, index, tenant_of
        self.media = [MEDIUM_OF_TIER.get(name, name.upper()) for name in index.tiers]
        self._next = secrets.randbits(62)
        self._numbers = b""  # big-endian bytes of numbers made ahead; from `_at` on: `_next` on
        self._at = 0
        self._last: tuple[tuple[Node, int, int, int], wire.Blocks] | None = None  # (`_blocks`)

    def gained(self, node: Node, lo: int, hi: int, tier: int) -> None:
        tenant = self.tenant_of(node.root.ids)
        if tenant is not None:
            blocks = self._blocks(node, lo, hi)
            self.publisher.publish(tenant, wire.Stored(blocks, self.media[tier]))

    def lost(self, node: Node, lo: int, hi: int, tier: int) -> None:
        run = node.slots[tier][lo:hi]
        missing = run.count(None)  # in C: most often all held or none
        if missing == hi - lo:
            return
        tenant = self.tenant_of(node.root.ids)
        if tenant is None:
            return
        marks = node.marks if len(node.marks) >= hi * 8 else self.marks(node)
        if not missing:
            hashes = marks[lo * 8 : hi * 8]
        else:
            held = [lo + j for j, slot in enumerate(run) if slot is not None]
            hashes = b"".join(marks[i * 8 : i * 8 + 8] for i in held)
        self.publisher.publish(tenant, wire.Removed(hashes, self.media[tier]))

    def marks(self, node: Node) -> bytes:
        """The event hashes of all of `node`'s blocks (module doc), handed out where missing."""
        have = len(node.marks) >> 3
        size = len(node.key) // self.index.key_nbytes
        if have < size:
            count, at = size - have, self._at
            if len(self._numbers) < at + count * 8:  # the next NUMBERS numbers, made at once
                many = max(NUMBERS, count)
                self._numbers = np.arange(self._next, self._next + many, dtype=">u8").tobytes()
                at = 0
            node.marks += self._numbers[at : at + count * 8]
            self._at = at + count * 8
            self._next += count
        return node.marks

    def announce(self) -> int:
        """Tell of every block the index holds (module doc); the events queued."""
        told = 0
        for node, lo, hi, tier in self._runs():
            self.gained(node, lo, hi, tier)
            told += 1
        return told

    def told(self, tenant: str | None) -> list[tuple[str, wire.Spec]]:
        """(tenant, event) for every run of blocks held in a tier, parents first; `tenant`'s
        blocks only unless None. Under the store's lock."""
        out: list[tuple[str, wire.Spec]] = []
        for node, lo, hi, tier in self._runs():
            owner = self.tenant_of(node.root.ids)
            if owner is not None and tenant in (None, owner):
                out.append((owner, wire.Stored(self._blocks(node, lo, hi), self.media[tier])))
        return out

    def _runs(self) -> Iterator[tuple[Node, int, int, int]]:
        """(node, lo, hi, tier) for each run of a node's blocks held in a tier, every node
        before its children."""
        for root in self.index.roots():
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

    def _blocks(self, node: Node, lo: int, hi: int) -> wire.Blocks:
        """The fields of a BlockStored of blocks lo..hi-1 of `node`; the last answer is kept,
        since a store tells of the same new blocks once per tier it wrote them to."""
        key = (node, lo, hi, len(node.key))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        marks = self.marks(node)
        parent = None
        if lo:
            parent = int.from_bytes(marks[lo * 8 - 8 : lo * 8], "big")
        elif node.parent is not None and node.parent.parent is not None:
            parent = int.from_bytes(self.marks(node.parent)[-8:], "big")
        kb = self.index.key_nbytes
        tokens = node.key[lo * kb : hi * kb]
        blocks = wire.Blocks(marks[lo * 8 : hi * 8], parent, tokens, self.index.block_tokens)
        self._last = (key, blocks)
        return blocks


def snapshot(store: KVStore, tenant: str | None) -> dict[str, Any]:
    """What `GET /v1/blocks` answers: per topic, its sequence number when the snapshot was
    taken (`seq`: the next message's) and an event batch telling of every block held
    (`events`, the wire's bytes: `PrefixIndex.apply` takes it), `tenant`'s blocks only unless
    None; `InvalidArgumentError` when the store publishes no events."""
    publisher, observer = store.parts.events, store.index.observer
    if publisher is None or not isinstance(observer, IndexEvents):
        raise InvalidArgumentError("GET /v1/blocks: this store publishes no events (`events`)")
    with store.parts.state.lock:
        told = observer.told(tenant)
        names = {publisher.topic_of(owner) for owner, _ in told}
        if tenant is not None:
            names.add(publisher.topic_of(tenant))
        seqs = {name: publisher.sent(name) for name in names}
    packer = wire.Packer()
    topics = []
    for name in sorted(seqs):
        events = [packer.pack(spec) for owner, spec in told if publisher.topic_of(owner) == name]
        batch = wire.batch(time.time(), events, publisher.settings.dp_rank)
        topics.append({"topic": name, "seq": seqs[name], "events": batch})
    return {"block_size": store.index.block_tokens, "topics": topics}
