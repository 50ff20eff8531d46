"""`EventPublisher`: KV events on a ZMQ PUB in llm-d's documented layout (`pkg/kvevents`; what
vLLM sent before 0.33, whose events are tagged maps: `kvtier.routing.reading`), with replay.

Wire (llm-d `pkg/kvevents`; vLLM's batch and frames): ZMQ PUB, each message three frames: the
topic (UTF-8), its sequence number (8 bytes, big-endian, one more per message of that topic),
and a msgpack payload, an event batch `[ts (float, seconds), [event, ...], dp_rank (nil:
kvtier is no data-parallel rank)]`, each event a positional array:

    ["BlockStored", [hash, ...], parent_hash or nil, [token, ...], block_size, lora_id or nil,
     medium, lora_name or nil]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

A hash is a uint64 naming one block of this publisher while it lives (`observer.py` hands them
out), not a content hash: a router keys blocks by their tokens (`kvtier.routing`; llm-d too).
The medium names the tier: "GPU", "CPU" (host), "DISK", "REMOTE" (`MEDIUM`). A block that
gains or loses a tier is one event for that medium; removals in a row in one medium go out as
one event. The queue holds what a store told (`wire.Spec`: numbers and references to immutable
bytes); the thread packs a whole batch at once (`wire.Packer`). Replay (a ROUTER, vLLM's
protocol): `replay.py`; what the PUB holds for a peer that stops reading: `peers.py`.

Contract:
- `stored`, `removed` and `cleared` never block and never touch a socket: they append to a queue
  (as the index's observer does, `IndexEvents`), and the publisher's thread, every `flush_s`,
  sends what is queued as messages of at most `max_batch` events and `max_message_bytes` of
  payload, one topic each; a longer event is cut into several, each BlockStored chained to the
  one before by its parent hash (`wire.Packer`). The queue is bounded (`queue_limit` events);
  an event past it is dropped and counted, and that topic's next message starts with
  AllBlocksCleared. With a `source` (a store's: `IndexEvents`), the router then relearns at
  once: under the store's lock the thread drops what is queued for a lost topic and sends
  AllBlocksCleared, the removals the topic did not send (up to `queue_limit`: a router that
  skips AllBlocksCleared, as llm-d's pool does, forgets those blocks too), then every block
  the topic's tenants hold (`_resync`), before any later event. Resyncs are spaced
  (`RESYNC_MIN_S`, `RESYNC_LOCK_SHARE`); in between, a lost topic's events are dropped unsent.
  A topic's first message starts with AllBlocksCleared: a router forgets what the publisher's
  past life told it; the store then tells what it holds (`IndexEvents.announce`). A peer that
  joins later (`peers.Joins`; a SUB that reconnects after a restart, which missed those first
  words) is told AllBlocksCleared on every topic, then every block held (`_retell`), spaced the
  same way: every peer hears both, and ends with the store's blocks.
- The PUB binds `endpoint` and connects to each of `connect` (subscribers that bind: llm-d's).
- Incarnations: every topic's numbers start at `first_seq`; a store's, at the microseconds since
  the epoch at its start (`assembly._events`; vLLM's at 0): a restarted publisher's numbers are
  past any its past life sent (unless that sent more than a message a microsecond), so a
  router that missed the restart sees a gap no replay can fill (the new buffer starts at the
  new first number), never a run to splice onto the old life's (`kvtier.routing`).
- Each topic has its own sequence numbers and replay buffer (its last `buffer` messages,
  `buffer_bytes` of payload at most). An event holds one tenant's blocks; with `per_tenant`,
  each tenant's events go to `<topic>@<tenant>` only. `flush()` sends what is queued from the
  caller's thread; `close()` sends it, then closes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from kvtier.errors import InvalidArgumentError
from kvtier.events import wire
from kvtier.events.peers import BindError, Joins, allow_ipv6, limit_frames
from kvtier.events.replay import Backlog, ReplayServer

MEDIUM = ("GPU", "CPU", "DISK", "REMOTE")  # by tier index: gpu, host, disk, remote
MIN_MESSAGE_BYTES = 1 << 16
LOOK_S = 0.05  # the longest the thread waits before it looks at `close` and the queue again
MESSAGE_OVERHEAD = 64  # payload bytes besides the events and AllBlocksCleared (a batch: 24)

log = logging.getLogger("kvtier.events")
RESYNC_MIN_S = 1.0
RESYNC_LOCK_SHARE = 0.05
"""Resyncs of lost topics (`_resync`) are `RESYNC_MIN_S` apart at least, and further when the
last held the store's lock longer: each reads the whole index under it (500,000 blocks in
20,847 nodes: 70-280 ms, the garbage collector's passes over the index included), and a store
that overflows its queue again and again spends no more than this share of its lock on them."""

Event = tuple[str, wire.Spec]  # (tenant, the event)
STATS = ("events", "messages", "dropped_events", "replays_asked", "replays", "resyncs", "retells")


class Source(Protocol):
    """What a publisher resyncs a lost topic from (`IndexEvents`)."""

    store_lock: AbstractContextManager[Any]  # held by every edit that queues an event
    tenants: tuple[str, ...]  # every tenant that can hold blocks: a retell clears their topics

    def retold(self, wanted: Callable[[str], bool]) -> list[Event]:
        """Events telling of every block the tenants `wanted` names hold, parents first.
        Called under `store_lock`, after the queue was taken."""
        ...


@dataclass
class _Topic:
    name: bytes
    tenant: str  # whose events it carries ("" for a topic tenants share)
    seq: int = 0  # messages sent (the next one's number: `first_seq` + this)
    lost: bool = False  # events dropped since the last message (or, with a source, resync)
    unsent: list[Event] = field(default_factory=list)  # removals lost since (with a source)


@dataclass(frozen=True)
class EventSettings:
    topic: str = "kv@kvtier@model"  # vLLM's default shape: kv@<pod>@<model>
    per_tenant: bool = False  # each tenant's events on <topic>@<tenant> only
    buffer: int = 10_000  # messages kept per topic for replay
    buffer_bytes: int = 64 << 20  # and payload bytes kept per topic at most
    queue_limit: int = 100_000  # events queued at most; past it, dropped and counted
    max_batch: int = 512  # events per message at most
    max_message_bytes: int = 8 << 20  # payload bytes per message at most (`MESSAGE_OVERHEAD`+)
    flush_s: float = 0.005  # how long a message waits for more events


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        settings: EventSettings | None = None,
        clock: Callable[[], float] = time.time,
        connect: Sequence[str] = (),  # subscribers that bind: the PUB connects to them too
        first_seq: int = 0,  # every topic's first number (module doc, Incarnations)
    ) -> None:
        self.settings = settings = settings or EventSettings()
        self.topic, self.clock = settings.topic, clock
        self.first_seq = first_seq
        self.pending: collections.deque[Event] = collections.deque()  # appended by callers
        self.queue_limit = settings.queue_limit  # read per event by the observer: one lookup
        self._stopping = False
        self._closing = threading.Event()  # wakes the thread's wait at `close`
        self._topics: dict[str, _Topic] = {}
        self.lock = self._lock = threading.RLock()  # `IndexEvents` extends the queue under it
        self._stats = dict.fromkeys(STATS, 0)
        self.source: Source | None = None  # set by the store's observer: lost topics resync
        self._lost = False  # some topic lost events (under `_lock`)
        self._resync_at = 0.0  # `time.monotonic()` before which no resync starts
        self._dropped_told = 0  # `dropped_events` when the last resync was logged
        self._unsent = 0  # removals kept in the topics' `unsent` lists
        self._sending = threading.Lock()  # held by whoever drains the queue into the PUB
        if settings.max_message_bytes < MIN_MESSAGE_BYTES:
            raise InvalidArgumentError(
                f"max_message_bytes: got {settings.max_message_bytes}, expected at least "
                f"{MIN_MESSAGE_BYTES} (a block of 4096 tokens and the fields around it)"
            )
        self._message_room = settings.max_message_bytes - MESSAGE_OVERHEAD  # for its events
        self._packer = wire.Packer(self._message_room - len(wire.CLEARED))  # under `_sending`
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        limit_frames(self._pub, settings.topic, settings.per_tenant, settings.max_message_bytes)
        allow_ipv6(self._pub, endpoint, *connect)
        self._joins = Joins(self._pub)  # before any peer can join: peers owed the state
        self._backlog = Backlog(settings.buffer, settings.buffer_bytes)
        self._replay: ReplayServer | None = None
        self.replay_endpoint: str | None = None
        name, address = "endpoint", endpoint
        try:  # nothing stays bound when an address fails
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            name = "connect"
            for address in connect:  # ZMQ reconnects by itself while one is down
                self._pub.connect(address)
            if replay_endpoint is not None:
                name, address = "replay_endpoint", replay_endpoint
                replay = ReplayServer(self._context, replay_endpoint, self._backlog, self.topic)
                self._replay, self.replay_endpoint = replay, replay.endpoint
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise BindError(name, address, str(e)) from None
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    # ---- what the store tells ------------------------------------------------------------

    def stored(
        self, tenant: str, hashes: Sequence[int], parent: int | None, tokens: Sequence[int],
        block_size: int, medium: str,
    ) -> None:  # fmt: skip
        be, le = np.asarray(hashes, ">u8").tobytes(), np.asarray(tokens, "<u4").tobytes()
        self._put(tenant, wire.Stored(wire.Blocks(be, parent, le, block_size), medium))

    def removed(self, tenant: str, hashes: Sequence[int], medium: str) -> None:
        self._put(tenant, wire.Removed(np.asarray(hashes, ">u8").tobytes(), medium))

    def cleared(self, tenant: str) -> None:
        self._put(tenant, wire.CLEARED)

    # ---- state --------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts since start: `events`, `messages` sent, `dropped_events` (a full queue's),
        `replays_asked` (requests taken), `replays` answered in full, `resyncs` of lost
        topics, `retells` to peers that joined; and now: `queued`, the events waiting, and
        `unsynced_topics`, topics that lost events whose routers are not yet told so."""
        with self._lock:
            unsynced = sum(topic.lost for topic in self._topics.values())
            return {**self._stats, "queued": len(self.pending), "unsynced_topics": unsynced}

    def sent(self, topic: str | None = None) -> int:
        """Messages sent so far on `topic` (default: the publisher's)."""
        with self._lock:
            found = self._topics.get(self.topic if topic is None else topic)
            return found.seq if found is not None else 0

    def next_seq(self, topic: str | None = None) -> int:
        """The number the next message of `topic` (default: the publisher's) will have."""
        return self.first_seq + self.sent(topic)

    def flush(self) -> None:
        """Send every event queued before the call, from the caller's thread (`_sending`)."""
        self._drain()

    def close(self) -> None:
        if self._thread.is_alive():
            self._stopping = True  # the thread sends what is queued, then ends
            self._closing.set()
            self._thread.join(timeout=10)
        self._joins.close()
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    # ---- inside -------------------------------------------------------------------------

    def _put(self, tenant: str, event: wire.Spec) -> None:
        """Queue an event: one append under the lock, no wake-up; the thread looks every
        `flush_s`. The index's observer appends to `pending` itself the same way, or extends
        the entry it queued last (`IndexEvents`: one call less per event under the store's
        lock)."""
        with self._lock:  # the observer may be replacing the queue's last entry
            if len(self.pending) < self.queue_limit:
                self.pending.append((tenant, event))
                return
            self.overflow(tenant, event)

    def overflow(self, tenant: str, event: wire.Spec | None = None) -> None:
        """Count `event`, of `tenant`'s, dropped by a full queue (`queue_limit`): that topic's
        next message starts with AllBlocksCleared (with a source, its resync; a removal is
        kept to be sent again then)."""
        with self._lock:
            self._stats["dropped_events"] += 1
            topic = self._topic(tenant)
            topic.lost = self._lost = True
            if event is not None:
                self._keep_unsent(topic, [(tenant, event)])

    def _keep_unsent(self, topic: _Topic, events: list[Event]) -> None:
        """Keep the removals of `events` for `topic`'s resync (module doc), `queue_limit` in
        all at most. Under `_lock`."""
        if self.source is None:
            return
        for entry in events:
            if wire.is_removal(entry[1]) and self._unsent < self.settings.queue_limit:
                topic.unsent.append(entry)
                self._unsent += 1

    def topic_of(self, tenant: str) -> str:
        """The topic `tenant`'s events go to."""
        return f"{self.topic}@{tenant}" if self.settings.per_tenant else self.topic

    def _topic(self, tenant: str) -> _Topic:
        name = self.topic_of(tenant)
        topic = self._topics.get(name)
        if topic is None:
            shared = "" if not self.settings.per_tenant else tenant
            topic = self._topics[name] = _Topic(name.encode(), shared)
        return topic

    def _run(self) -> None:
        flush_s = self.settings.flush_s
        due = time.monotonic() + flush_s
        while True:
            stopping = self._stopping  # read before the drain: nothing queued before is left
            # look at least every `LOOK_S` (a long `flush_s` must not hold `close` up)
            wait = min(max(0.0, due - time.monotonic()), LOOK_S)
            if self._replay is not None:
                done = self._replay.turn(wait)
                with self._lock:
                    self._stats["replays_asked"] += done.requests
                    self._stats["replays"] += done.served
            else:
                self._closing.wait(wait or 0.001)
            if stopping or time.monotonic() >= due:
                self._drain()
                due = time.monotonic() + flush_s
            if stopping:
                return

    def _drain(self) -> None:
        with self._sending:
            source, now = self.source, time.monotonic()
            if source is not None and self._lost and now >= self._resync_at:
                self._resync(source)
            elif source is not None and self._joins.due(now) and now >= self._resync_at:
                self._retell(source)
            while self.pending:
                with self._lock:  # taken while draining, so that a holder stalls the sender
                    take = min(len(self.pending), self.settings.max_batch)
                    batch = [self.pending.popleft() for _ in range(take)]
                    if source is not None and self._lost:  # the next resync tells of these
                        batch = self._unlost(batch)
                self._send(batch)

    def _unlost(self, events: list[Event]) -> list[Event]:
        """`events` but those of lost topics, whose removals are kept unsent (module doc).
        Under `_lock`."""
        out = []
        for entry in events:
            topic = self._topic(entry[0])
            if topic.lost:
                self._keep_unsent(topic, [entry])
            else:
                out.append(entry)
        return out

    def _resync(self, source: Source) -> None:
        """Tell the routers of each lost topic every block its tenants hold (module doc).
        Under `_sending`, so that nothing queued later is sent before. The store's lock keeps
        every edit out while the queue is taken and the index read: the events taken that the
        resync does not replace (other topics') go first, then, per lost topic,
        AllBlocksCleared, the removals it did not send, and its blocks, then whatever the
        store queues after."""
        with source.store_lock:
            start = time.monotonic()
            with self._lock:
                kept = self._unlost(list(self.pending))
                self.pending.clear()
                lost = [topic for topic in self._topics.values() if topic.lost]
                unsent = [entry for topic in lost for entry in topic.unsent]
                for topic in lost:
                    topic.lost, topic.unsent = False, []
                self._unsent -= len(unsent)
                self._lost = False
                self._stats["resyncs"] += 1
                dropped = self._stats["dropped_events"] - self._dropped_told
                self._dropped_told += dropped
            names = {topic.name.decode() for topic in lost}
            told = source.retold(lambda tenant: self.topic_of(tenant) in names)
            held = time.monotonic() - start
        self._resync_at = time.monotonic() + max(RESYNC_MIN_S, held / RESYNC_LOCK_SHARE)
        log.warning(
            "kvtier: %d KV events lost to a full queue (%d events); told the routers of %s "
            "again: %d runs of blocks, %.1f ms under the store's lock",
            dropped, self.settings.queue_limit, ", ".join(sorted(names)), len(told), held * 1e3,
        )  # fmt: skip
        cleared = [(topic.tenant, wire.CLEARED) for topic in lost]
        self._send([*kept, *cleared, *unsent, *told])  # per topic, in this order (`_send`)

    def _retell(self, source: Source) -> None:
        """After what is queued, tell every topic (every tenant's, with `per_tenant`, holding or
        not) AllBlocksCleared, then every block held, for the peers that joined (`peers.Joins`;
        one may know a past life's blocks): read under the store's lock, spaced as resyncs are."""
        with source.store_lock:
            start = time.monotonic()
            with self._lock:
                kept = list(self.pending)
                self.pending.clear()
                self._stats["retells"] += 1
                tenants = {*source.tenants, *(topic.tenant for topic in self._topics.values())}
            told = source.retold(lambda tenant: True)
            held = time.monotonic() - start
        self._joins.told()
        self._resync_at = time.monotonic() + max(RESYNC_MIN_S, held / RESYNC_LOCK_SHARE)
        cleared = [(t, wire.CLEARED) for t in sorted(tenants if self.settings.per_tenant else [""])]
        self._send([*kept, *cleared, *told])  # per topic, in this order (`_send`)

    def _send(self, batch: list[Event]) -> None:
        grouped: dict[str, list[wire.Spec]] = {}
        for tenant, event in batch:
            grouped.setdefault(tenant if self.settings.per_tenant else "", []).append(event)
        now = self.clock()
        for tenant, specs in grouped.items():
            packed = self._packer.pack_all(specs)
            for events in wire.messages(packed, self._message_room, self.settings.max_batch):
                self._send_message(tenant, events, now)

    def _send_message(self, tenant: str, events: list[bytes], now: float) -> None:
        with self._lock:
            topic = self._topic(tenant)
            # forget a past life's blocks, or (without a source to resync from) what is lost;
            # with a source, a loss stays marked until `_resync` tells the topic again
            if topic.seq == 0 or (topic.lost and self.source is None):
                events = [wire.CLEARED, *events]
                if self.source is None:
                    topic.lost = False
            seq = self.first_seq + topic.seq
            topic.seq += 1
        payload = wire.batch(now, events, None)
        self._pub.send_multipart((topic.name, seq.to_bytes(8, "big"), payload))
        self._backlog.add(topic.name.decode(), seq, payload)
        with self._lock:
            self._stats["messages"] += 1
            self._stats["events"] += len(events)
