"""KV events (issue 16): where kvtier's blocks live, told to routers in the wire format vLLM's
publisher uses and llm-d's consumer reads: `EventPublisher` (the sockets) and `IndexEvents`
(the index's observer that feeds it: a block gaining or losing a copy in a tier).

Wire (vLLM 0.33 `distributed/kv_events.py`; llm-d `pkg/kvevents`): ZMQ PUB, each message three
frames: the topic (UTF-8), its sequence number (8 bytes, big-endian, from 0, one more per
message of that topic), and a msgpack payload, an event batch

    [ts (float, seconds), [event, ...], dp_rank (int or nil)]

in which each event is a positional array, its class name first:

    ["BlockStored", [hash, ...], parent_hash or nil, [token, ...], block_size, lora_id or nil,
     medium, lora_name or nil]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

A hash is a uint64: the first 8 bytes (big-endian) of kvtier's block id (`hash64`). The medium
names the tier: "GPU", "CPU" (host), "DISK", "REMOTE" (`MEDIUM`). A block that gains or loses
a tier is one event for that medium.

Replay (a ROUTER socket, vLLM's protocol): a client (DEALER) sends `[b"", start_seq]` (8 bytes,
big-endian) and gets `[b"", topic, seq, payload]` for each message of the publisher's topic
still buffered with a sequence number >= start_seq, then the end marker `[b"", b"", -1 (8
bytes, signed), b""]`. With `per_tenant` topics, a client adds the topic as a third frame and
gets that topic's messages only.

Contract:
- `stored`, `removed` and `cleared` never block and never touch a socket: they append to a
  queue, and the publisher's thread, every `flush_s`, sends what is queued as messages of at
  most `max_batch` events, one topic each. The queue is bounded (`queue_limit` events); an
  event past it is dropped and counted, and that topic's next message starts with
  AllBlocksCleared, so that a router forgets what it can no longer trust.
- Tenants: an event holds one tenant's blocks. With `per_tenant`, each tenant's events go to
  `<topic>@<tenant>` only, with sequence numbers and a replay buffer of their own; without it,
  to `topic` (an operator who must not mix tenants turns it on).
- The replay buffer keeps the last `buffer` messages of each topic.
- `flush()` sends what is queued from the caller's thread (a replay that routes on events
  waits for a store's); `sent(topic)` is the number of messages a topic has had.
- `close()` sends what is queued, then closes the sockets.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import zmq

from kvtier.index import RadixIndex
from kvtier.index.node import Node

MEDIUM = ("GPU", "CPU", "DISK", "REMOTE")  # by tier index: gpu, host, disk, remote
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Event = tuple[str, list[Any]]  # (tenant, the event's positional array)


def hash64(block_id: bytes) -> int:
    """The uint64 hash of a block in events: the first 8 bytes of its id, big-endian."""
    return int.from_bytes(block_id[:8], "big")


@dataclass
class _Topic:
    name: bytes
    seq: int = 0
    sent: collections.deque[tuple[int, bytes]] = field(default_factory=collections.deque)
    lost: bool = False  # events dropped since the last message


@dataclass(frozen=True)
class EventSettings:
    topic: str = "kv@kvtier@model"  # vLLM's default shape: kv@<pod>@<model>
    per_tenant: bool = False  # each tenant's events on <topic>@<tenant> only
    buffer: int = 10_000  # messages kept per topic for replay
    queue_limit: int = 100_000  # events queued at most; past it, dropped and counted
    max_batch: int = 512  # events per message at most
    flush_s: float = 0.005  # how long a message waits for more events
    dp_rank: int | None = None


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        settings: EventSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings = settings or EventSettings()
        self.topic, self.clock = settings.topic, clock
        self._pending: collections.deque[Event] = collections.deque()  # appended by callers
        self._stopping = False
        self._topics: dict[str, _Topic] = {}
        self._lock = threading.RLock()
        self._stats = {"events": 0, "messages": 0, "dropped_events": 0, "replays": 0}
        self._sending = threading.Lock()  # held by whoever drains the queue into the PUB
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    # ---- what the store tells ------------------------------------------------------------

    def stored(
        self,
        tenant: str,
        hashes: list[int],
        parent: int | None,
        tokens: list[int],
        block_size: int,
        medium: str,
    ) -> None:
        self._put(tenant, ["BlockStored", hashes, parent, tokens, block_size, None, medium, None])

    def removed(self, tenant: str, hashes: list[int], medium: str) -> None:
        self._put(tenant, ["BlockRemoved", hashes, medium])

    def cleared(self, tenant: str) -> None:
        self._put(tenant, ["AllBlocksCleared"])

    # ---- state --------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def sent(self, topic: str | None = None) -> int:
        """Messages sent so far on `topic` (default: the publisher's), the next one's number."""
        with self._lock:
            found = self._topics.get(self.topic if topic is None else topic)
            return found.seq if found is not None else 0

    def flush(self) -> None:
        """Send every event queued before the call, from the caller's thread (the PUB socket
        is used under `_sending` only, so it never serves two threads at once)."""
        self._drain()

    def close(self) -> None:
        if self._thread.is_alive():
            self._stopping = True  # the thread sends what is queued, then ends
            self._thread.join(timeout=10)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    # ---- inside -------------------------------------------------------------------------

    def _put(self, tenant: str, event: list[Any]) -> None:
        """Queue an event: one append (atomic under the GIL), no lock, no wake-up; the thread
        looks every `flush_s`."""
        if len(self._pending) < self.settings.queue_limit:
            self._pending.append((tenant, event))
            return
        with self._lock:
            self._stats["dropped_events"] += 1
            self._topic(tenant).lost = True

    def _topic(self, tenant: str) -> _Topic:
        name = f"{self.topic}@{tenant}" if self.settings.per_tenant else self.topic
        topic = self._topics.get(name)
        if topic is None:
            topic = self._topics[name] = _Topic(name.encode())
        return topic

    def _run(self) -> None:
        while True:
            stopping = self._stopping  # read before the drain: nothing queued before is left
            if self._replay is not None:
                if self._replay.poll(int(self.settings.flush_s * 1000) or 1):
                    self._serve_replay()
            else:
                time.sleep(self.settings.flush_s or 0.001)
            self._drain()
            if stopping:
                return

    def _drain(self) -> None:
        with self._sending:
            while self._pending:
                with self._lock:  # taken while draining, so that a holder stalls the sender
                    take = min(len(self._pending), self.settings.max_batch)
                    batch = [self._pending.popleft() for _ in range(take)]
                self._send(batch)

    def _send(self, batch: list[Event]) -> None:
        grouped: dict[str, list[list[Any]]] = {}
        for tenant, event in batch:
            grouped.setdefault(tenant if self.settings.per_tenant else "", []).append(event)
        now = self.clock()
        for tenant, events in grouped.items():
            with self._lock:
                topic = self._topic(tenant)
                if topic.lost:
                    events = [["AllBlocksCleared"], *events]
                    topic.lost = False
                seq = topic.seq
                topic.seq += 1
            payload = msgpack.packb([now, events, self.settings.dp_rank])
            self._pub.send_multipart((topic.name, seq.to_bytes(8, "big"), payload))
            with self._lock:
                topic.sent.append((seq, payload))
                while len(topic.sent) > self.settings.buffer:
                    topic.sent.popleft()
                self._stats["messages"] += 1
                self._stats["events"] += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) not in (3, 4) or len(frames[2]) != 8:
            return  # not a replay request: nothing to answer
        client, start = frames[0], int.from_bytes(frames[2], "big")
        wanted = frames[3].decode(errors="replace") if len(frames) == 4 else self.topic
        with self._lock:
            self._stats["replays"] += 1
            topic = self._topics.get(wanted)
            kept = [item for item in topic.sent if item[0] >= start] if topic else []
            name = topic.name if topic else wanted.encode()
        for seq, payload in kept:
            self._replay.send_multipart((client, b"", name, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


Stored = tuple[list[int], int | None, list[int]]  # a BlockStored's hashes, parent, tokens
MEDIUM_OF_TIER = {"gpu": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}


class IndexEvents:
    """The index's observer (`RadixIndex.observer`): each copy a block gains or loses in a tier
    becomes a BlockStored or BlockRemoved event of that tier's medium, for the tenant whose
    namespace holds the block (`tenant_of`; a namespace it does not know is skipped).

    Reads the ids of the nodes it is told about (`Forest.ids_of`: ids are then computed when
    stored, as they would be when first read) and their tokens; called under the store's lock,
    it only queues (`EventPublisher`)."""

    def __init__(
        self,
        publisher: EventPublisher,
        index: RadixIndex,
        tenant_of: Callable[[bytes], str | None],
    ) -> None:
        self.publisher, self.index, self.tenant_of = publisher, index, tenant_of
        self.media = [MEDIUM_OF_TIER.get(name, name.upper()) for name in index.tiers]
        self._last: tuple[tuple[Node, int, int, int], Stored] | None = None  # (`_stored`)

    def gained(self, node: Node, lo: int, hi: int, tier: int) -> None:
        tenant = self.tenant_of(node.root.ids)
        if tenant is None:
            return
        hashes, parent, tokens = self._stored(node, lo, hi)
        block_tokens = self.index.block_tokens
        self.publisher.stored(tenant, hashes, parent, tokens, block_tokens, self.media[tier])

    def _stored(self, node: Node, lo: int, hi: int) -> Stored:
        """Hashes, parent hash and tokens of blocks lo..hi-1 of `node`; the last answer is kept,
        since a store tells of the same new blocks once per tier it wrote them to."""
        key = (node, lo, hi, len(node.key))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        hashes, parent = self._hashes(node, lo, hi), None
        if lo:
            parent = self._hashes(node, lo - 1, lo)[0]
        elif node.parent is not None and node.parent.parent is not None:
            above = node.parent
            parent = self._hashes(above, above.size - 1, above.size)[0]
        kb = self.index.key_nbytes
        tokens = np.frombuffer(node.key, "<u4", (hi - lo) * kb // 4, lo * kb).tolist()
        self._last = (key, (hashes, parent, tokens))
        return hashes, parent, tokens

    def lost(self, node: Node, lo: int, hi: int, tier: int) -> None:
        held = [i for i in range(lo, hi) if node.slots[tier][i] is not None]
        tenant = self.tenant_of(node.root.ids) if held else None
        if tenant is None:
            return
        hashes = self._hashes(node, lo, hi)
        self.publisher.removed(tenant, [hashes[i - lo] for i in held], self.media[tier])

    def _hashes(self, node: Node, lo: int, hi: int) -> list[int]:
        ids, size = self.index.forest.ids_of(node), self.index.digest_size
        rows = np.frombuffer(ids, np.uint8, (hi - lo) * size, lo * size).reshape(-1, size)
        hashes: list[int] = np.ascontiguousarray(rows[:, :8]).view(">u8").ravel().tolist()
        return hashes
