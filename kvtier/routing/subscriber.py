"""A thread that keeps a `PrefixIndex` (or another `reading.Sink`) fed from any number of
KV-event publishers (kvtier's or vLLM's), and recovers what it missed.

`Subscriber(index)`, then `add(endpoint, replay_endpoint=None)` per publisher: one SUB socket
each (so that a message's publisher is known), subscribed to every topic. Per topic the last
sequence number applied is kept:
- the next number: applied;
- a number past it (a gap: messages lost, or a topic first heard of after its start): the
  replay endpoint is asked for everything from the first one missed, and what it returns is
  applied before the message, if it is the whole gap. A replay that does not begin at the
  number asked for is never spliced on: what it lacks may be another life's (a kvtier
  publisher restarted while the router was cut off numbers from its own start, microseconds
  since the epoch: `EventPublisher`). A gap not so filled (no replay endpoint, no answer within
  `replay_timeout`, a buffer moved past it, another life's) is filled from the publisher's
  snapshot if it has one, else the topic's blocks are forgotten (`PrefixIndex.clear`), since a
  removal may be among the lost: a router that under-counts a pod is safe, one that believes a
  pod holds what it dropped is not; counted as `resets`. A gap before a message that begins
  with AllBlocksCleared needs neither: the message forgets what the gap held (a kvtier topic's
  first message begins so; refused whole as `bad`, its clear holds all the same). Of a topic
  nothing is known of (first heard, or after a restart), the replay is asked from number 0 when
  that whole span fits in `max_replay_bytes` (a vLLM publisher's early life), and its run that
  ends just before the message is taken, wherever it begins. A kvtier topic's numbers never
  fit: it is learnt from its snapshot, else forgotten and followed from the message on (a
  kvtier store retells a joining subscriber);
- a number below it (a publisher restarted: vLLM's number from 0 again): the topic's blocks
  are forgotten, then the message is taken as a topic's first.

Snapshots. A publisher added with a `snapshot` (a callable answering as `GET /v1/blocks` does, e.g.
`kvtier.client.Client(url, api_key=ADMIN_KEY, shared_memory=False).blocks`: the admin key may not
map the pools) is asked for one first: each topic's blocks are replaced by the snapshot's
(`PrefixIndex.reset`), and its messages from the first not yet taken up to the snapshot's number are
skipped as reflected (one queued before it, applied again, is harmless: events are applied in
order), except one that begins with AllBlocksCleared: the topic is followed from it (the same life's
clear is followed by the same messages). One below them (a new life whose clock stepped back) is a
restart. Without `add(..., tenant=...)` a snapshot is the pod's whole (the admin key's): a topic the
publisher spoke on that it does not list (`GET /v1/blocks` lists only topics that hold blocks) holds
nothing and is cleared. With it, it is that tenant's (a tenant key's, per-tenant topics): it tells
of that tenant's topic only. vLLM publishers have none.

With `resync_s`, each publisher with a snapshot is resynced that often too (rationed as gaps are),
repairing whatever drifted unseen. A message that brings an orphan (a BlockStored whose parent the
index does not hold for its topic: the index and the publisher disagree) makes a publisher with a
snapshot resync at once, rationed as gaps are: after an `AllBlocksCleared` from a publisher that
does not tell again what it still holds (a kvtier store does, `EventPublisher._resync`), every block
chained to a forgotten one is an orphan, and on a topic that tenants share that is every tenant's,
until a snapshot tells the index what the pod holds.

Trust. A publisher's bytes are untrusted (`PrefixIndex.apply` refuses what is not events):
- a frame longer than `max_message_bytes` is refused by ZMQ before it is buffered (the
  connection is dropped and made again, with a backoff, `links.py`, and the messages lost
  meanwhile are a gap like any other). ZMQ bounds frames, not messages: one of many frames is
  buffered whole, then counted as `bad`. What a publisher can make the router hold unread is
  about `max_queue_bytes` (`links.py`), and a replay at most `max_replay_bytes`;
- a publisher speaks for one pod, on at most `max_topics` topics (`allowance.Voice`); a
  message, or a snapshot's topic, past that is dropped, counted as `refused`. The pod is the
  one `add(pod=...)` names, claimed at once; else the first it names that no other publisher
  did (then a hostile publisher heard first could take a pod's name: name the pods);
- a replay ends after `replay_timeout`, and after `max_replay_bytes` whatever the endpoint
  sends; a gap too long to fit in it is not asked for (a number near 2**64 is one); a
  publisher's recoveries (replay, snapshot) are rationed (`allowance.Ration`; a replay by the
  time it took to fetch, not to apply): past its share, a gap is forgotten without asking;
- an address of no ZMQ shape is refused by `add`; one ZMQ refuses at connect all the same is
  retried as a lost connection is (`links.Watch.add`): the thread goes on; past
  `checks.MAX_PUBLISHERS` (ZMQ sockets: `checks.another`) `add` refuses;
- a snapshot's answer is checked as the client checks one (`replies.blocks`), whatever gave it,
  and waited for `replay_timeout` at most (`snapshots.py`: a hung pod holds no other up).

`wait(topic, seq, timeout)` returns once `topic`'s messages up to number `seq` - 1 are applied
(a store's publisher's `next_seq`: a replay routing on events waits for the store it used).
`remove(pod)` stops hearing a pod's publisher and forgets its blocks (a pod gone, or moved: it
may be added again, at another address). `close()` stops the thread.
"""

from __future__ import annotations

import threading
import time

import zmq

from kvtier.errors import InvalidArgumentError
from kvtier.routing import checks, replays
from kvtier.routing.allowance import Added, Publisher, Ration, Voice
from kvtier.routing.links import Link, Watch
from kvtier.routing.reading import BadEvent, Sink, starts_cleared
from kvtier.routing.snapshots import Asker, Snapshot

MAX_MESSAGE_BYTES = 8 << 20
"""The longest message a subscriber takes by default: a kvtier publisher's longest by default
(`events.max_message_bytes`: raise both together); vLLM's are one engine step's events."""
MAX_QUEUE_BYTES = 1 << 30  # about what one publisher's unread messages may hold (`links.py`)
MAX_REPLAY_BYTES = 256 << 20
"""What one replay may bring back by default, counting `REPLAY_ENTRY` per message besides
its bytes (a kvtier publisher keeps 64 MiB per topic by default, `events.buffer_bytes`)."""
REPLAY_ENTRY = replays.ENTRY
MAX_TOPICS = 4096  # topics one publisher may send on by default (as a sidecar's snapshot lists)
COUNTS: tuple[str, ...] = ("messages", "gaps", "replayed", "resets", "bad", "refused")
COUNTS += ("resyncs", "resync_errors", "disconnects")


class Subscriber:
    def __init__(
        self,
        index: Sink,
        replay_timeout: float = 2.0,
        resync_s: float | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_replay_bytes: int = MAX_REPLAY_BYTES,
        max_topics: int = MAX_TOPICS,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
    ) -> None:
        self.index, self.replay_timeout = index, checks.number("replay_timeout", replay_timeout, 0)
        self.resync_s = resync_s if resync_s is None else checks.number("resync_s", resync_s, 1e-3)
        sizes = dict(max_message_bytes=max_message_bytes, max_replay_bytes=max_replay_bytes)
        self.max_message_bytes, self.max_replay_bytes, self.max_topics, self.max_queue_bytes = (
            checks.sizes(**sizes, max_topics=max_topics, max_queue_bytes=max_queue_bytes)
        )
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._added: list[Added] = []
        self._removed: list[Voice] = []  # the voices of publishers to stop hearing
        self._applied: dict[str, int] = {}  # topic -> messages applied (its next number)
        self._floors: dict[str, range] = {}  # topic -> numbers a snapshot reflects (module doc)
        self._owners: dict[str, Voice] = {}  # pod -> the voice of the publisher speaking for it
        self._cond = threading.Condition()
        self._stats = dict.fromkeys(COUNTS, 0)
        self._stopping, self._heard = False, 0  # `_heard`: publishers added, not removed
        self._watch: Watch[Publisher] = Watch()  # the thread's, as are the sockets it polls
        self._thread = threading.Thread(target=self._run, name="kvtier-route-sub", daemon=True)
        self._thread.start()

    def add(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        snapshot: Snapshot | None = None,
        pod: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Subscribe to the publisher at `endpoint` (its replay ROUTER at `replay_endpoint`;
        `snapshot`, and `tenant` whose view it is: module doc). `pod`: the pod it speaks for,
        claimed now: no other publisher may speak for it, whoever is heard first, and this one
        for no other (without it, the first pod it names that no other publisher named). A
        pod claimed and not `remove`d since, or an address of no ZMQ shape to connect to
        (`checks.address`: it stopped the thread, every pod unheard since), is an
        `InvalidArgumentError`; one ZMQ refuses anyway is retried as a lost connection is."""
        checks.address("endpoint", endpoint)
        if replay_endpoint is not None:
            checks.address("replay_endpoint", replay_endpoint)
        with self._cond:
            checks.another("endpoint", endpoint, self._heard)
            voice = Voice(self.max_topics)
            if pod is not None:
                if pod in self._owners:
                    raise InvalidArgumentError(f"pod {pod!r}: already claimed by another publisher")
                voice.pod = pod
                self._owners[pod] = voice
            self._added.append(Added(endpoint, replay_endpoint, snapshot, tenant, voice))
            self._heard += 1

    def remove(self, pod: str) -> None:
        """Stop hearing the publisher that speaks for `pod` and forget its blocks: its sockets
        closed and each topic it spoke on cleared by the thread before it hears one added after
        this call; `pod` may then be added again (rescheduled at another address). A pod no
        publisher speaks for (named by `add` or its messages) is an `InvalidArgumentError`."""
        with self._cond:
            voice = self._owners.pop(pod, None)
            if voice is None:
                raise InvalidArgumentError(f"pod {pod!r}: expected a pod a publisher speaks for")
            self._removed.append(voice)
            self._heard -= 1

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
        publishers: list[Publisher] = []
        while not self._stopping:
            with self._cond:  # removals first: a pod removed, then added again
                added, self._added = self._added, []
                removed, self._removed = self._removed, []
            for voice in removed:
                publishers = [p for p in publishers if not self._forget(p, voice)]
            for spec in added:
                if all(spec.voice is not voice for voice in removed):
                    ration = Ration(self.replay_timeout)
                    link = Link(
                        self._context, spec.endpoint, self.max_message_bytes, self.max_queue_bytes
                    )
                    asker = spec.snapshot and Asker(spec.snapshot, self.replay_timeout)
                    publishers.append(Publisher(link, spec, ration, asker or None, ration.at))
            now = time.monotonic()
            for publisher in publishers:
                if publisher.link.due(now) and not self._watch.add(publisher.link, publisher):
                    self._count("disconnects")  # an address ZMQ refuses: retried (`Link.lost`)
            for sock, publisher in self._watch.ready(20):
                link = publisher.link
                if sock not in self._watch.owners:  # closed by an earlier one
                    continue
                if sock is link.monitor:  # the SUB lost its connection: reopened later
                    self._count("disconnects")
                    self._watch.drop(link)
                    link.lost()
                    continue
                while not self._stopping and link.socket is not None and link.socket.poll(0):
                    link.heard()
                    self._receive(publisher, link.socket.recv_multipart())
            if self.resync_s is not None:
                now = time.monotonic()
                for publisher in publishers:
                    if publisher.asker and now - publisher.resynced_at >= self.resync_s:
                        self._heal(publisher)
        for publisher in publishers:
            self._watch.drop(publisher.link)

    def _forget(self, publisher: Publisher, voice: Voice) -> bool:
        """If `publisher` speaks with `voice` (`remove`): its sockets closed, each topic it
        spoke on cleared and its numbers forgotten; was it?"""
        if publisher.added.voice is not voice:
            return False
        self._watch.drop(publisher.link)
        for topic in voice.topics:
            self.index.clear(topic)
            self._floors.pop(topic, None)
            with self._cond:
                self._applied.pop(topic, None)
        return True

    def _receive(self, publisher: Publisher, frames: list[bytes], resync: bool = True) -> None:
        """Apply one message (module doc); `resync`: a gap may be filled from a snapshot (once
        per message: a snapshot that does not cover it is not asked for again)."""
        try:
            topic = frames[0].decode() if len(frames) == 3 and len(frames[1]) == 8 else None
        except UnicodeDecodeError:
            topic = None
        if topic is None:
            self._count("bad")
            return
        if not self._admit(publisher, topic):
            return
        seq = int.from_bytes(frames[1], "big")
        floor = self._floors.get(topic)
        if floor is not None:
            if seq in floor and not starts_cleared(frames[2]):
                return  # the snapshot reflects it
            del self._floors[topic]  # past it, below it (a restart), or a clear: module doc
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
        if resync and self.index.orphans() > orphans and publisher.added.snapshot is not None:
            self._heal(publisher)

    def _heal(self, publisher: Publisher) -> None:
        """Resync `publisher` (an orphan; `resync_s`: module doc) within its recoveries' share."""
        if not publisher.ration.allows():
            return
        started = time.monotonic()
        try:
            self._resync(publisher)
        finally:
            publisher.ration.spent(started)

    def _admit(self, publisher: Publisher, topic: str) -> bool:
        """May `publisher` speak on `topic` (module doc)? Counted when not."""
        with self._cond:  # `add` claims pods from the caller's thread
            admitted = publisher.added.voice.admits(topic, self._owners)
        if not admitted:
            self._count("refused")
        return admitted

    def _recover(
        self, publisher: Publisher, topic: str, start: int | None, stop: int, resync: bool
    ) -> tuple[bool, bool]:
        """Messages start..stop-1 of `topic` were lost (`start` None: nothing known of it):
        `(filled, resynced)`, filled from the replay endpoint, else (`resync`) a snapshot that
        covers `topic` taken; neither past the recoveries' share (`allowance.RECOVERY_SHARE`)."""
        if not publisher.ration.allows():
            return False, False
        started = time.monotonic()
        try:
            got = self._replay(publisher, topic, start, stop)
        finally:  # the fetch only: applying it costs what the messages would have live
            publisher.ration.spent(started)
        if got:
            applied = 0
            for seq in sorted(got):
                if self._stopping:  # closing: the rest of a replay matters no more
                    break
                self._apply(topic, seq, got[seq])
                applied += 1
            self._count("replayed", applied)
            return True, False
        started = time.monotonic()
        try:
            return False, resync and self._resync(publisher) and topic in self._floors
        finally:
            publisher.ration.spent(started)

    def _resync(self, publisher: Publisher) -> bool:
        """Replace each topic's blocks by the publisher's snapshot, and clear the topics the
        pod's whole view does not list (module doc); done?"""
        publisher.resynced_at = time.monotonic()
        added = publisher.added
        if publisher.asker is None:
            return False
        reply = publisher.asker.ask()  # None: a server down or hung, a reply of another shape
        if reply is None:
            self._count("resync_errors")
            return False
        listed = set()
        for entry in reply["topics"]:
            topic, seq, events = entry["topic"], entry["seq"], entry["events"]
            if not self._admit(publisher, topic):
                continue
            listed.add(topic)
            try:
                self.index.reset(topic, events)
            except BadEvent:
                self._count("bad")
                self.index.clear(topic)
            with self._cond:  # from the first number not taken (0 if past `seq`: a new life)
                old = self._floors.get(topic) or range(self._applied.get(topic, 0), seq)
                self._floors[topic] = range(old.start if old.start <= seq else 0, seq)
            self._set(topic, seq)
        if added.tenant is None:  # the pod's whole: a topic it does not list holds nothing
            with self._cond:
                unlisted = added.voice.topics - listed
            for topic in unlisted:
                self.index.clear(topic)
        self._count("resyncs")
        return True

    def _replay(
        self, publisher: Publisher, topic: str, start: int | None, stop: int
    ) -> dict[int, bytes] | None:
        """Messages start..stop-1 of `topic` from the replay endpoint (`replays.run`), all or None;
        bounded whatever it sends (`replay_timeout`, `max_replay_bytes`, `max_message_bytes`)."""
        where = publisher.added.replay_endpoint
        if where is None:
            return None
        return replays.run(
            self._context, where, topic, start, stop,
            self.max_message_bytes, self.replay_timeout, self.max_replay_bytes,
        )  # fmt: skip

    def _apply(self, topic: str, seq: int, payload: bytes) -> None:
        try:
            self.index.apply(topic, payload)
        except BadEvent:  # refused whole: the clear it begins with holds all the same, or a
            self._count("bad")  # gap not recovered for it (`_receive`) kept its removed blocks
            if starts_cleared(payload):
                self.index.clear(topic)
        self._count("messages")
        self._set(topic, seq + 1)

    def _set(self, topic: str, applied: int) -> None:
        with self._cond:
            self._applied[topic] = applied
            self._cond.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._stats[name] += n
