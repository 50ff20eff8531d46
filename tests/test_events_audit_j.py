"""What peers that never read, and a pod that hangs, may cost (audit J), over real sockets:

- the replay ROUTER keeps a few requests of a connection unread (`RCVHWM`), not ZMQ's 1,000:
  50 connections flooding requests they never read answers of leave a publisher's memory flat;
- the replies it holds for connections that never read are bounded across all of them
  (`replay.QUEUED_BYTES`), not 32 messages a connection, even once the backlog moved past them;
- the PUB holds at most 128 messages (of 8 MiB at most) for a subscriber that stops reading
  (`SNDHWM`), not ZMQ's 1,000;
- `replays` counts replays answered, `replays_asked` the requests: a flood of one request
  repeated is answered a few times, and counted so;
- a router's periodic resync of a pod whose `/v1/blocks` hangs holds the other pods' messages
  up `replay_timeout` at most (the snapshot runs on a thread of its own, `routing.snapshots`),
  and an answer that comes late is thrown away, not applied over newer messages.

The memory checks run the publisher in a child process and read its resident size."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from kvtier.client import Client
from kvtier.events import EventPublisher, EventSettings
from kvtier.routing import PrefixIndex, Subscriber

CHILD = """
import sys
from kvtier.events import EventPublisher, EventSettings, replay
replay.QUEUED_BYTES = int(sys.argv[2])  # the bound across connections, to the test's size
settings = EventSettings(topic="kv@p@m", buffer_bytes=int(sys.argv[1]))
pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", settings)
print(pub.replay_endpoint, flush=True)
n = 0
for line in sys.stdin:
    count, tokens = map(int, line.split())
    for _ in range(count):
        n += 1
        pub.stored("t", [n], None, [n % 1000] * tokens, tokens, "GPU")
        pub.flush()
    print("ok", flush=True)
"""


class Child:
    """A publisher with a replay endpoint in a process of its own (module doc)."""

    def __init__(self, buffer_bytes: int, queued_bytes: int = 64 << 20) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(buffer_bytes), str(queued_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.replay_endpoint = self.proc.stdout.readline().strip()

    def publish(self, count: int, tokens: int) -> None:
        """`count` messages of about `tokens` * 4 bytes each, sent before this returns."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{count} {tokens}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def silent_dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """A DEALER that will never read what it is sent."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.setsockopt(zmq.SNDHWM, 100)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    return dealer


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_replay_router_keeps_few_requests_of_a_connection_unread(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    child = Child(64 << 20)
    try:
        before = child.rss_mib()
        dealers = [silent_dealer(context, child.replay_endpoint) for _ in range(50)]
        request = [b"", (0).to_bytes(8, "big"), b"x" * 4000]  # under the 4 KiB frame bound
        sent, end = 0, time.monotonic() + 6
        while sent < 60_000 and time.monotonic() < end:  # old code: up to 1,000 a connection
            for dealer in dealers:
                with contextlib.suppress(zmq.Again):  # its queue is full: the next one
                    dealer.send_multipart(request, zmq.NOBLOCK)
                    sent += 1
        time.sleep(0.5)  # what the kernel buffers reaches the publisher
        grown = child.rss_mib() - before
        assert grown < 40, f"the publisher grew by {grown:.0f} MiB"  # 50 x 16 x 4 KiB: ~3 MiB
    finally:
        child.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_replies_held_for_silent_connections_are_bounded_in_all(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    child = Child(4 << 20, queued_bytes=8 << 20)  # 8 messages of 512 KiB kept
    try:
        child.publish(8, 1 << 17)
        before = child.rss_mib()
        dealers = []  # kept open: each pins what ZMQ holds for it (old code: 1.3 MiB each)
        for _ in range(40):
            dealers.append(silent_dealer(context, child.replay_endpoint))
            dealers[-1].send_multipart([b"", (0).to_bytes(8, "big")])
            time.sleep(0.02)
            child.publish(8, 1 << 17)  # the backlog moves past what was sent
        grown = child.rss_mib() - before
        assert grown < 25, f"the publisher grew by {grown:.0f} MiB"  # 8 MiB held at most
    finally:
        child.close()


def test_pub_holds_few_messages_for_a_subscriber_that_stops_reading(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub = EventPublisher("tcp://127.0.0.1:0", settings=EventSettings(topic="kv@p@m"))
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        time.sleep(0.5)  # joined and subscribed
        for n in range(1100):  # ~128 KiB each; never read meanwhile
            pub.stored("t", [n], None, [n % 1000] * 32768, 32768, "GPU")
            pub.flush()
        got = 0
        while sub.poll(300):
            sub.recv_multipart()
            got += 1
        # 128 held by the PUB (SNDHWM, 8 MiB messages by default), what the kernel buffers, 1
        assert 0 < got < 400, f"{got} messages were held for the subscriber"
    finally:
        pub.close()


def test_replays_counts_replays_answered_not_requests(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", EventSettings(topic="kv@p@m"))
    try:
        for n in range(3):
            pub.stored("t", [n], None, [n] * 4, 4, "GPU")
        pub.flush()
        assert pub.replay_endpoint is not None
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        for _ in range(2000):  # one request, repeated: a flood's repeats are answered once a turn
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        ends = 0
        while dealer.poll(500):
            frames = dealer.recv_multipart()
            ends += frames[1] == b""
        stats = pub.stats()
        assert stats["replays_asked"] == 2000
        assert 0 < ends < 2000 and stats["replays"] == ends, (ends, stats)
    finally:
        pub.close()


def hanging_server() -> tuple[socket.socket, str]:
    """A server that takes connections and never answers (a stopped sidecar)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def take() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=take, daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def batch(block: int, first: bool) -> bytes:
    events = [["AllBlocksCleared"]] if first else []
    stored = ["BlockStored", [block], None, [block] * 4, 4, None, "GPU", None]
    return msgpack.packb([time.time(), [*events, stored], None])  # type: ignore[no-any-return]


def test_a_hung_snapshot_holds_other_pods_up_replay_timeout_at_most(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server, url = hanging_server()
    hung = Client(url, api_key="admin-key", timeout_s=4, shared_memory=False)
    good, bad = context.socket(zmq.PUB), context.socket(zmq.PUB)
    good_at = f"tcp://127.0.0.1:{good.bind_to_random_port('tcp://127.0.0.1')}"
    bad_at = f"tcp://127.0.0.1:{bad.bind_to_random_port('tcp://127.0.0.1')}"
    sub = Subscriber(PrefixIndex(4), replay_timeout=0.5, resync_s=0.3)
    try:
        sub.add(good_at, pod="good")
        sub.add(bad_at, snapshot=hung.blocks, pod="bad")
        time.sleep(0.4)  # connected; the bad pod's first resync is due
        worst = 0.0
        for n in range(8):
            started = time.monotonic()
            good.send_multipart([b"kv@good@m", n.to_bytes(8, "big"), batch(n + 1, n == 0)])
            assert sub.wait("kv@good@m", n + 1, timeout=2.0), f"message {n} not applied in 2 s"
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.2)
        assert worst < 1.2, f"a message waited {worst:.2f} s behind the hung pod"
        assert sub.stats()["resync_errors"] >= 1
    finally:
        sub.close()
        hung.close()
        server.close()


def test_a_snapshot_that_answers_late_is_thrown_away_not_applied_over_newer_messages(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The first snapshot answers after the timeout with the state as of the first message
    (block 1 held); a message removing block 1 is applied meanwhile. A late answer taken at the
    next resync (the change's first form) scored block 1 again and moved `applied` back."""
    topic = "kv@p@m"

    def events(*items: Sequence[object]) -> bytes:
        return msgpack.packb([time.time(), list(items), None])  # type: ignore[no-any-return]

    stored = ["BlockStored", [1], None, [1] * 4, 4, None, "GPU", None]
    calls: list[float] = []

    def snapshot() -> dict[str, object]:
        calls.append(time.monotonic())
        time.sleep(0.8 if len(calls) == 1 else 30)  # late once, then hung
        state = events(["AllBlocksCleared"], stored)
        return {"block_size": 4, "topics": [{"topic": topic, "seq": 1, "events": state}]}

    pub = context.socket(zmq.PUB)
    at = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    index = PrefixIndex(4)
    sub = Subscriber(index, replay_timeout=0.3, resync_s=0.3)
    try:
        sub.add(at, snapshot=snapshot, pod="p")
        time.sleep(0.45)  # the first ask is under way
        pub.send_multipart(
            [topic.encode(), (0).to_bytes(8, "big"), events(["AllBlocksCleared"], stored)]
        )
        pub.send_multipart(
            [topic.encode(), (1).to_bytes(8, "big"), events(["BlockRemoved", [1], "GPU"])]
        )
        assert sub.wait(topic, 2, timeout=2.0)
        assert index.score([1, 1, 1, 1]) == {}
        time.sleep(1.5)  # the late answer came; later resyncs asked again
        assert len(calls) >= 2, "a new call after the late one ended"
        assert index.score([1, 1, 1, 1]) == {}, "a late, older snapshot was applied"
        assert sub.applied(topic) == 2
    finally:
        sub.close()
