"""A thread that keeps a `PrefixIndex` (or another `reading.Sink`) fed from any number of
KV-event publishers (kvtier's or vLLM's), and recovers what it missed.

`Subscriber(index)`, then `add(endpoint, replay_endpoint=None)` per publisher: one SUB socket
each (so that a message's publisher is known), subscribed to every topic. Per topic the last
sequence number applied is kept:
- the next number: applied;
- a number past it (a gap: messages lost, or a topic first heard of after its start): the
  publisher's replay endpoint is asked for everything from the first one missed, and what it
  returns is applied before the message that showed the gap, if it is the whole gap. A replay
  that does not begin at the number asked for is never spliced on: what it lacks may be
  another life's (a kvtier publisher restarted while the router was cut off numbers from its
  own start, microseconds since the epoch, past any number of its past life:
  `EventPublisher`); the topic's state is then unknown. When the gap is not filled (no replay
  endpoint, no answer within `replay_timeout`, a buffer moved past it, another life's), the
  publisher's snapshot is taken if it has one, else the topic's blocks are forgotten
  (`PrefixIndex.clear`) before going on, since a removal may be among the lost: a router that
  under-counts a pod is safe, one that believes a pod holds what it dropped is not; counted as
  `resets`. A gap before a message that begins with AllBlocksCleared needs neither: the
  message forgets what the gap held (a kvtier topic's first message begins so, and a router
  that hears a new life from it needs no recovery). Of a topic nothing is known of (first
  heard, or after a restart), the replay's run that ends just before the message is taken,
  wherever it begins: there is nothing to splice it onto.
  A publisher added with a `snapshot` (a callable answering as `GET /v1/blocks` does, e.g.
  `kvtier.client.Client(url, api_key=ADMIN_KEY).blocks`) is asked for one first: each topic's
  blocks are replaced by the snapshot's (`PrefixIndex.reset`), and its messages below the
  snapshot's number are skipped as already reflected (re-applying one queued before the
  snapshot was taken is harmless: events are applied in order and each sets or clears what it
  names). Skipped before any restart check: a number below the snapshot's is the same life's
  (a new life's numbers start above it); a vLLM publisher, which numbers from 0, has no
  snapshot;
- a number below it (a publisher restarted: vLLM's number from 0 again): the topic's blocks
  are forgotten, then the message is taken as a topic's first.

With `resync_s`, each publisher with a snapshot is resynced that often too, repairing whatever
drifted unseen. A message that brings an orphan (a BlockStored whose parent the index does not
hold for its topic: the index and the publisher disagree) makes a publisher with a snapshot
resync at once, rationed as gaps are: after an `AllBlocksCleared` from a publisher that does not
tell again what it still holds (a kvtier store does, `EventPublisher._resync`), every block
chained to a forgotten one is an orphan, and on a topic that tenants share that is every
tenant's, until a snapshot tells the index what the pod holds.

Trust. A publisher's bytes are untrusted (`PrefixIndex.apply` refuses what is not events):
- a frame longer than `max_message_bytes` is refused by ZMQ before it is buffered (the
  connection is dropped and made again, and the messages lost meanwhile are a gap like any
  other). ZMQ bounds frames, not messages: one of many frames is buffered whole, then counted
  as `bad`;
- a publisher speaks for one pod, on at most `max_topics` topics (`allowance.Voice`); a
  message, or a snapshot's topic, past that is dropped, counted as `refused`. The pod is the
  one `add(pod=...)` names, claimed at once; else the first it names that no other publisher
  did (then a hostile publisher heard first could take a pod's name: name the pods);
- a replay ends after `replay_timeout` in all, and after `max_replay_bytes` whatever the
  endpoint keeps sending, and a gap too long to fit in it is not asked for (a sequence number
  near 2**64 is a gap too): the topic is then forgotten, as for any gap nobody can fill;
- a publisher's recoveries on a gap (replay, snapshot) are rationed (`allowance.Ration`):
  past its share, a gap is forgotten without asking;
- a snapshot's answer is checked as the client checks one (`replies.blocks`), whatever gave it.

`wait(topic, seq, timeout)` returns once `topic`'s messages up to number `seq` - 1 are applied
(a store's publisher's `next_seq`: a replay routing on events waits for the store it used).
`close()` stops the thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvtier.events.peers import allow_ipv6
from kvtier.routing import replays
from kvtier.routing.allowance import Ration, Voice
from kvtier.routing.reading import BadEvent, Sink, starts_cleared
from kvtier.service import replies

Snapshot = Callable[[], dict[str, Any]]  # {block_size, topics: [{topic, seq, events}]}


@dataclass
class _Publisher:
    socket: zmq.Socket[bytes]
    endpoint: str
    monitor: zmq.Socket[bytes]  # the SUB's disconnections
    replay_endpoint: str | None
    voice: Voice
    ration: Ration
    snapshot: Snapshot | None = None
    resynced_at: float = 0.0


MAX_MESSAGE_BYTES = 64 << 20
"""The longest message a subscriber takes by default (a kvtier publisher sends 8 MiB at most by
default, `events.max_message_bytes`; vLLM's are one engine step's events)."""
MAX_REPLAY_BYTES = 256 << 20
"""What one replay may bring back by default, counting `REPLAY_ENTRY` per message besides
its bytes (a kvtier publisher keeps 64 MiB per topic by default, `events.buffer_bytes`)."""
REPLAY_ENTRY = replays.ENTRY
MAX_TOPICS = 4096
"""The topics one publisher may send on by default (as many as a sidecar's snapshot lists)."""


class Subscriber:
    def __init__(
        self,
        index: Sink,
        replay_timeout: float = 2.0,
        resync_s: float | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_replay_bytes: int = MAX_REPLAY_BYTES,
        max_topics: int = MAX_TOPICS,
    ) -> None:
        self.index, self.replay_timeout, self.resync_s = index, replay_timeout, resync_s
        self.max_message_bytes, self.max_replay_bytes = max_message_bytes, max_replay_bytes
        self.max_topics = max_topics
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._added: list[tuple[str, str | None, Snapshot | None, str | None]] = []
        self._applied: dict[str, int] = {}  # topic -> messages applied (its next number)
        self._floors: dict[str, int] = {}  # topic -> a snapshot's number: below it, reflected
        self._owners: dict[str, Voice] = {}  # pod -> the voice of the publisher speaking for it
        self._cond = threading.Condition()
        self._stats = dict.fromkeys(
            (
                "messages",
                "gaps",
                "replayed",
                "resets",
                "bad",
                "refused",
                "resyncs",
                "resync_errors",
                "disconnects",
            ),
            0,
        )
        self._stopping = False
        self._poller = zmq.Poller()  # the thread's, as are the sockets it polls
        self._by_socket: dict[zmq.Socket[bytes], _Publisher] = {}  # a SUB, or its monitor
        self._thread = threading.Thread(target=self._run, name="kvtier-route-sub", daemon=True)
        self._thread.start()

    def add(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        snapshot: Snapshot | None = None,
        pod: str | None = None,
    ) -> None:
        """Subscribe to the publisher at `endpoint` (its replay ROUTER at `replay_endpoint`;
        `snapshot`: module doc). `pod`: the pod it speaks for, claimed now: no other publisher
        may speak for it, whoever is heard first, and this one for no other (without it, the
        first pod it names that no other publisher named). A pod named by two adds is a
        `ValueError`."""
        with self._cond:
            if pod is not None:
                if pod in self._owners:
                    raise ValueError(f"pod {pod!r}: already claimed by another publisher")
                self._owners[pod] = Voice(self.max_topics, pod)
            self._added.append((endpoint, replay_endpoint, snapshot, pod))

    def applied(self, topic: str) -> int:
        with self._cond:
            return self._applied.get(topic, 0)

    def wait(self, topic: str, count: int, timeout: float = 5.0) -> bool:
        """Wait until `topic`'s messages numbered below `count` are applied; False on
        timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._applied.get(topic, 0) >= count, timeout)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self._stats)

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=10)
        self._context.destroy(linger=0)

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        publishers: list[_Publisher] = []
        while not self._stopping:
            with self._cond:
                added, self._added = self._added, []
            for endpoint, replay_endpoint, snapshot, pod in added:
                sub, monitor = self._open(endpoint)
                ration = Ration(self.replay_timeout)
                with self._cond:  # a claimed pod's voice was made by `add`
                    voice = self._owners[pod] if pod is not None else Voice(self.max_topics)
                publisher = _Publisher(
                    sub, endpoint, monitor, replay_endpoint, voice, ration, snapshot, ration.at
                )
                publishers.append(publisher)
                self._watch(publisher)
            for sock, _ in self._poller.poll(20):
                publisher = self._by_socket[sock]
                if sock is publisher.monitor:  # the SUB lost its connection
                    self._reopen(publisher)
                    continue
                while publisher.socket.poll(0):
                    self._receive(publisher, publisher.socket.recv_multipart())
            if self.resync_s is not None:
                now = time.monotonic()
                for publisher in publishers:
                    if publisher.snapshot and now - publisher.resynced_at >= self.resync_s:
                        self._resync(publisher)
        for publisher in publishers:
            self._unwatch(publisher)

    def _open(self, endpoint: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """A SUB connected to `endpoint`, refusing messages past `max_message_bytes`, and the
        monitor that tells of its disconnections."""
        sub = self._context.socket(zmq.SUB)
        allow_ipv6(sub, endpoint)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint)
        return sub, monitor

    def _reopen(self, publisher: _Publisher) -> None:
        """The SUB lost its connection: a new SUB in its place. ZMQ connects again by itself
        after a network error, but not after a protocol error such as a message past
        `max_message_bytes`, and a publisher that sent one long message must not go unheard
        from then on (one that sends only those is dropped each time, at the message's
        header). A new socket rather than a second `connect` on the old one: that would hold
        two connections to a publisher that ZMQ did reconnect, and take each message twice."""
        self._count("disconnects")
        self._unwatch(publisher)
        publisher.socket, publisher.monitor = self._open(publisher.endpoint)
        self._watch(publisher)

    def _watch(self, publisher: _Publisher) -> None:
        """Poll `publisher`'s SUB and its monitor (the thread's)."""
        for sock in (publisher.socket, publisher.monitor):
            self._by_socket[sock] = publisher
            self._poller.register(sock, zmq.POLLIN)

    def _unwatch(self, publisher: _Publisher) -> None:
        """Stop polling `publisher`'s sockets, and close them."""
        for sock in (publisher.socket, publisher.monitor):
            self._poller.unregister(sock)
            del self._by_socket[sock]
        publisher.socket.disable_monitor()
        publisher.monitor.close(linger=0)
        publisher.socket.close(linger=0)

    def _receive(self, publisher: _Publisher, frames: list[bytes], resync: bool = True) -> None:
        """Apply one message (module doc); `resync`: a gap may be filled from a snapshot (once
        per message: a snapshot that does not cover it is not asked for again)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count("bad")
            return
        try:
            topic = frames[0].decode()
        except UnicodeDecodeError:
            self._count("bad")
            return
        if not self._admit(publisher, topic):
            return
        seq = int.from_bytes(frames[1], "big")
        floor = self._floors.get(topic)
        if floor is not None:
            if seq < floor:
                return  # the snapshot reflects it
            del self._floors[topic]
        with self._cond:
            expected = self._applied.get(topic)  # None: nothing known of the topic
        if expected is not None and seq < expected:  # numbers went down: a restart
            self._count("resets")
            self.index.clear(topic)
            with self._cond:
                del self._applied[topic]
            expected = None
        gap = seq != (0 if expected is None else expected)
        if gap and starts_cleared(frames[2]):  # the message forgets whatever the gap held
            self._count("gaps")
            self._count("resets", expected is not None)
        elif gap:
            self._count("gaps")
            filled, resynced = self._recover(publisher, topic, expected, seq, resync)
            if resynced:
                self._receive(publisher, frames, resync=False)  # against its number
                return
            if not filled:
                self._count("resets")
                self.index.clear(topic)
        orphans = self.index.orphans()
        self._apply(topic, seq, frames[2])
        if resync and self.index.orphans() > orphans and publisher.snapshot is not None:
            self._heal(publisher)

    def _heal(self, publisher: _Publisher) -> None:
        """Resync `publisher` after an orphan (module doc), within its recoveries' share."""
        if not publisher.ration.allows():
            return
        started = time.monotonic()
        try:
            self._resync(publisher)
        finally:
            publisher.ration.spent(started)

    def _admit(self, publisher: _Publisher, topic: str) -> bool:
        """May `publisher` speak on `topic` (module doc)? Counted when not."""
        with self._cond:  # `add` claims pods from the caller's thread
            admitted = publisher.voice.admits(topic, self._owners)
        if not admitted:
            self._count("refused")
        return admitted

    def _recover(
        self, publisher: _Publisher, topic: str, start: int | None, stop: int, resync: bool
    ) -> tuple[bool, bool]:
        """Messages start..stop-1 of `topic` were lost (`start` None: nothing is known of it):
        `(filled, resynced)`, filled from the replay endpoint, else (`resync`) a snapshot that
        covers `topic` taken; neither when the publisher's recoveries have had their share
        (`allowance.RECOVERY_SHARE`)."""
        if not publisher.ration.allows():
            return False, False
        started = time.monotonic()
        try:
            if self._fill(publisher, topic, start, stop):
                return True, False
            return False, resync and self._resync(publisher) and topic in self._floors
        finally:
            publisher.ration.spent(started)

    def _resync(self, publisher: _Publisher) -> bool:
        """Replace each topic's blocks by the publisher's snapshot (module doc); done?"""
        publisher.resynced_at = time.monotonic()
        if publisher.snapshot is None:
            return False
        try:
            reply = replies.blocks(publisher.snapshot())
        except Exception:  # a server down, a reply of another shape: no snapshot this time
            self._count("resync_errors")
            return False
        for entry in reply["topics"]:
            topic, seq, events = entry["topic"], entry["seq"], entry["events"]
            if not self._admit(publisher, topic):
                continue
            try:
                self.index.reset(topic, events)
            except BadEvent:
                self._count("bad")
                self.index.clear(topic)
            with self._cond:
                self._floors[topic] = seq
            self._set(topic, seq)
        self._count("resyncs")
        return True

    def _fill(self, publisher: _Publisher, topic: str, start: int | None, stop: int) -> bool:
        """Apply messages start..stop-1 of `topic` from the replay endpoint; all of them? A
        replay that does not begin at `start` is refused whole: what it lacks may be another
        life's (module doc). `start` None (nothing known of the topic): whatever run the
        endpoint holds that ends at stop-1. Bounded whatever the endpoint sends:
        `replay_timeout` in all, `max_replay_bytes` (a gap that could not fit is not asked
        for), `max_message_bytes` a message."""
        known = 0 if start is None else start
        if publisher.replay_endpoint is None or (stop - known) * REPLAY_ENTRY > (
            self.max_replay_bytes
        ):
            return False
        first = 0 if start is None else start
        got = replays.ask(
            self._context, publisher.replay_endpoint, topic, range(first, stop),
            self.max_message_bytes, self.replay_timeout, self.max_replay_bytes,
        )  # fmt: skip
        if start is None and got:  # the run the endpoint holds, if it ends at stop-1
            first = min(got)
        complete = bool(got) and len(got) == stop - first
        if complete:
            for seq in range(first, stop):
                self._apply(topic, seq, got[seq])
            self._count("replayed", stop - first)
        return complete

    def _apply(self, topic: str, seq: int, payload: bytes) -> None:
        try:
            self.index.apply(topic, payload)
        except BadEvent:
            self._count("bad")
        self._count("messages")
        self._set(topic, seq + 1)

    def _set(self, topic: str, applied: int) -> None:
        with self._cond:
            self._applied[topic] = applied
            self._cond.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._stats[name] += n
