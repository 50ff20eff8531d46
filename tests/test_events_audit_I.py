"""Audit I of the router's subscriber (`kvtier/routing/subscriber.py`) against what a real
deployment hands it:

- an address ZMQ refuses (a typo, a pod-discovery entry without a port) was taken by
  `Subscriber.add` and killed the subscriber's one thread at its first connect: every pod went
  unheard from then on, silently, and the router kept scoring the blocks they had dropped. Now
  `add` refuses an address of no ZMQ shape by name, and one ZMQ refuses anyway (`tcp://..:5`)
  is retried with the backoff of a lost connection, the other pods heard meanwhile;
- a slow router (its one thread behind, so that messages are dropped at the high-water mark)
  was charged for applying the messages a replay brought back as if fetching them had taken
  that long: its first replay used up the pod's recovery share, and the next gap, which the
  replay endpoint could fill in a millisecond, forgot every block of the pod. Now a replay
  costs the publisher's share only the time its endpoint took;
- `close()` of a router that was behind waited for its thread to apply every message queued
  (10 s at most), then destroyed the sockets under it; now the thread stops at the next one.

Publishers are plain ZMQ sockets and a real `Backlog` / `ReplayServer` (`kvtier.events`); the
router is real. A slow router is a `Sink` that applies each message to a real `PrefixIndex`
after a pause (a busy router's thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import wait_until
from test_routing import BS, PROMPT, batch, stored
from test_routing_audit import Pub, joined, since

from kvtier.errors import InvalidArgumentError
from kvtier.events.replay import Backlog, ReplayServer
from kvtier.routing import PrefixIndex, Subscriber

A = "kv@pod-a@m"


@pytest.mark.parametrize(
    ("endpoint", "replay"),
    [
        ("tcp://pod-b", None),  # no port
        ("pod-b:5557", None),  # no transport
        ("tcp://*:5557", None),  # binds; nothing connects to it
        ("tcp://127.0.0.1:5557", "tcp://pod-b"),
        (b"tcp://127.0.0.1:5557", None),
    ],
    ids=["no port", "no transport", "wildcard", "replay without port", "bytes"],
)
def test_an_address_of_no_zmq_shape_is_refused_by_add_naming_it(
    ctx: Any, closing: Any, endpoint: Any, replay: str | None
) -> None:
    sub = closing(Subscriber(PrefixIndex(BS)))
    name = "replay_endpoint" if replay else "endpoint"
    with pytest.raises(InvalidArgumentError, match=f"{name}: got .*, expected a ZMQ address"):
        sub.add(endpoint, replay, pod="pod-b")
    good = Pub(ctx)  # the pod it would have claimed is free, and the thread hears others
    sub.add(good.endpoint, pod="pod-b")
    joined(sub, [good], ["kv@pod-b@m"])


def test_an_address_zmq_refuses_later_never_stops_the_subscriber(ctx: Any, closing: Any) -> None:
    """`tcp://..:5` has the shape of an address, and ZMQ refuses it at connect: before, the
    subscriber's thread died there and no pod was heard again."""
    good = Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index))
    sub.add(good.endpoint, pod="pod-a")
    sub.add("tcp://..:5", "tcp://..:6", pod="pod-x")
    joined(sub, [good], [A])
    good.send(A, 2, batch(stored([1], None, PROMPT[:4])))
    good.send(A, 4, batch(stored([2], 1, PROMPT[4:8])))  # a gap: its replay endpoint is none
    assert sub.wait(A, 5)
    assert index.score(PROMPT) == {}  # the gap forgot the pod (block 2 chained to block 1)
    time.sleep(0.2)  # the refused address retried meanwhile, with its backoff
    good.send(A, 5, batch(stored([3], None, PROMPT[:4])))
    assert sub.wait(A, 6) and index.score(PROMPT) == {"pod-a": 4.0}


@pytest.mark.parametrize(
    "argument",
    [
        {"max_message_bytes": 0},
        {"max_queue_bytes": -1},
        {"max_replay_bytes": 1.5},
        {"max_topics": True},
        {"replay_timeout": float("nan")},
        {"resync_s": 0},
    ],
    ids=lambda argument: next(iter(argument)),
)
def test_a_subscriber_of_bounds_that_cannot_work_is_refused_naming_them(
    argument: dict[str, Any],
) -> None:
    """`max_message_bytes=0` divided by zero in the thread (no pod ever heard), a NaN timeout
    never waited for a replay."""
    name = next(iter(argument))
    with pytest.raises(InvalidArgumentError, match=f"^{name}: got "):
        Subscriber(PrefixIndex(BS), **argument)


class SlowIndex:
    """A `Sink`: a real `PrefixIndex`, each message applied after `pause` seconds (a router
    whose one thread is busy)."""

    def __init__(self, pause: float) -> None:
        self.index, self.pause = PrefixIndex(BS), pause

    def apply(self, source: str, payload: bytes) -> int:
        time.sleep(self.pause)
        return self.index.apply(source, payload)

    def reset(self, source: str, payload: bytes) -> int:
        return self.index.reset(source, payload)

    def clear(self, source: str) -> None:
        self.index.clear(source)

    def orphans(self) -> int:
        return self.index.orphans()


def slowly_joined(sub: Subscriber, pub: Pub) -> dict[str, int]:
    """`joined` for a slow router: message 0 sent every 0.5 s until taken (a copy every 10 ms
    queues copies that each read as a restart), then message 1; the counts from there."""
    while not sub.applied(A):
        pub.send(A, 0, batch())
        sub.wait(A, 1, 0.5)
    pub.send(A, 1, batch())
    assert sub.wait(A, 2)  # every copy of message 0 taken too
    return sub.stats()


class Replaying:
    """A publisher of topic `A` with a real replay endpoint: `send` keeps each message in the
    backlog and sends it on the PUB unless told it is lost (dropped at the high-water mark)."""

    def __init__(self, ctx: Any) -> None:
        self.pub = Pub(ctx)
        self.backlog = Backlog(1000, 1 << 20)
        self.server = ReplayServer(ctx, "tcp://127.0.0.1:0", self.backlog, A)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            self.server.turn(0.01)

    def send(self, seq: int, payload: bytes, lost: bool = False) -> None:
        self.backlog.add(A, seq, payload)
        if not lost:
            self.pub.send(A, seq, payload)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.server.close()


@pytest.fixture
def replaying(ctx: Any) -> Iterator[Replaying]:
    publisher = Replaying(ctx)
    yield publisher
    publisher.close()


def test_a_slow_router_is_not_charged_for_applying_what_a_replay_brought(
    replaying: Replaying, closing: Any
) -> None:
    """Messages 3-6 and 8 are lost; each gap is filled from the replay endpoint in a few ms,
    but applying messages 3-6 takes the slow router 0.48 s, past its recovery share of 0.4 s:
    before, the second gap was forgotten without asking, and every block of the pod with it."""
    slow = SlowIndex(0.12)
    sub = closing(Subscriber(slow, replay_timeout=0.4))
    sub.add(replaying.pub.endpoint, replaying.server.endpoint, pod="pod-a")
    start = slowly_joined(sub, replaying.pub)
    for seq in range(2, 10):  # block 1 first, each next one chained to the one before
        block = stored([seq - 1], seq - 2 or None, [seq] * BS)
        replaying.send(seq, batch(block), lost=seq in (3, 4, 5, 6, 8))
    assert sub.wait(A, 10, 10)
    counts = since(sub, start)
    assert (counts["gaps"], counts["replayed"], counts["resets"]) == (2, 5, 0)
    assert slow.index.pods() == {"pod-a": 8}  # every block, none forgotten
    slow.index.check()


def test_a_router_that_is_behind_closes_at_once(ctx: Any) -> None:
    """`close()` waited for the thread to drain every message queued (here 40 of 0.12 s: 4.8 s),
    10 s at most, then destroyed the sockets under it (a `ZMQError` in the thread)."""
    pub = Pub(ctx)
    slow = SlowIndex(0.12)
    sub = Subscriber(slow)
    try:
        sub.add(pub.endpoint, pod="pod-a")
        slowly_joined(sub, pub)
        for seq in range(2, 42):
            pub.send(A, seq, batch())
        assert wait_until(lambda: sub.applied(A) > 2)  # the thread is in the queue
    finally:
        began = time.monotonic()
        sub.close()
    assert time.monotonic() - began < 1.0 and not sub._thread.is_alive()


def test_a_router_applying_a_replay_closes_at_once(replaying: Replaying) -> None:
    """`close()` in the middle of applying what a replay brought (here 297 messages of 0.05 s)
    waited its 10 s, and the thread went on changing the index after `close()` returned."""
    slow = SlowIndex(0.05)
    sub = Subscriber(slow, replay_timeout=2.0)
    try:
        sub.add(replaying.pub.endpoint, replaying.server.endpoint, pod="pod-a")
        slowly_joined(sub, replaying.pub)
        for seq in range(2, 300):  # all but the last lost: one gap, one replay of 297
            block = stored([seq - 1], seq - 2 or None, [seq] * BS)
            replaying.send(seq, batch(block), lost=seq < 299)
        assert wait_until(lambda: sub.stats()["gaps"] == 1)
        assert wait_until(lambda: sub.applied(A) > 10)  # inside the replay's apply loop
    finally:
        began = time.monotonic()
        sub.close()
    applied = sub.stats()["messages"]
    assert time.monotonic() - began < 1.0 and not sub._thread.is_alive()
    time.sleep(0.2)
    assert sub.stats()["messages"] == applied < 200  # nothing applied after close()
