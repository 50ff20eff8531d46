"""The event publisher against hostile peers of its replay endpoint (anyone who can connect may
send to it, and may never read): what a peer does not read costs a bounded queue however often it
asks and however many connections it opens, a reader that falls behind still gets every message
and the end marker, malformed requests are answered by nothing or by the end marker alone, and the
PUB keeps publishing meanwhile. The attackers are real sockets on loopback: ZMQ DEALERs that never
read, and raw TCP peers that speak ZMTP by hand and never read either."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, tiny_block_bytes, wait_until

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError
from kvtier.events import EventPublisher, EventSettings

TOPIC = "kv@pod-a@tiny"
TINY_CONFIG: dict[str, Any] = {
    "model": {**TINY_MODEL, "dtype": "float32"},
    "block_tokens": TINY_BLOCK_TOKENS,
    "tiers": {"gpu": {"capacity": 4 * tiny_block_bytes(), "device": "cpu"}, "host": None},
}
END = (-1).to_bytes(8, "big", signed=True)


def publisher_with(messages: int, tokens: int, **settings: Any) -> EventPublisher:
    """A publisher whose replay buffer holds `messages` messages of one BlockStored of `tokens`
    tokens each (5 bytes a token: about `5 * tokens` bytes a message)."""
    options = {"flush_s": 0.0, "max_batch": 1, "buffer": messages, **settings}
    publisher = EventPublisher(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", EventSettings(TOPIC, **options)
    )
    for n in range(messages):
        publisher.stored("alice", [n], None, list(range(1000, 1000 + tokens)), tokens, "GPU")
    publisher.flush()
    assert publisher.sent(TOPIC) == messages
    return publisher


def request(start: int, *topic: bytes) -> list[bytes]:
    return [b"", start.to_bytes(8, "big"), *topic]


def read_all(dealer: Any, quiet_ms: int = 1000) -> list[list[bytes]]:
    """Every reply `dealer` gets until none comes for `quiet_ms`."""
    got = []
    while dealer.poll(quiet_ms):
        got.append(dealer.recv_multipart())
    return got


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / (1 << 20)


class RawPeer:
    """A peer on a plain TCP socket that speaks ZMTP 3.0 (NULL) as a DEALER and never reads
    after its handshake: nothing of it is buffered by ZMQ on this side."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
        name, value = b"Socket-Type", b"DEALER"
        ready = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
        self.sock.sendall(greeting + bytes([0x04, len(ready)]) + ready)

    def send(self, frames: list[bytes]) -> None:
        wire = b"".join(
            bytes([int(i < len(frames) - 1), len(frame)]) + frame for i, frame in enumerate(frames)
        )
        self.sock.sendall(wire)

    def close(self) -> None:
        self.sock.close()


# ---- what a peer does not read ---------------------------------------------------------------


def test_a_peer_that_asks_again_and_again_without_reading_pins_a_few_messages(ctx: Any) -> None:
    """A raw peer asks for the whole buffer (16 messages of about 100 KB) 40 times and never
    reads, while the store publishes 16 new messages between two requests: each request names
    messages no other holds any more. Had each been queued whole, the publisher would hold 640 of
    them for that peer (about 60 MB, up to ZMQ's 1000-message high-water mark); it holds a few.
    Meanwhile an honest router's replay is whole."""
    publisher = publisher_with(16, 21_000)
    assert publisher.replay_endpoint is not None
    hostile = RawPeer(publisher.replay_endpoint)
    time.sleep(0.2)
    tokens = list(range(1000, 22_000))
    before = rss_mib()
    for round_ in range(40):
        hostile.send(request(0))
        for n in range(16):
            publisher.stored("alice", [16 * round_ + n], None, tokens, len(tokens), "GPU")
        publisher.flush()
    assert wait_until(lambda: publisher.stats()["replays_asked"] == 40)
    time.sleep(0.3)  # what the publisher queued reaches the connection
    grown = rss_mib() - before
    honest = ctx.socket(zmq.DEALER)
    honest.connect(publisher.replay_endpoint)
    honest.send_multipart(request(0))
    got = read_all(honest)
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == list(range(640, 656))
    assert got[-1] == [b"", b"", END, b""]
    hostile.close()
    publisher.close()
    assert grown < 30, f"{grown:.0f} MiB for a peer that never reads"


def test_many_connections_that_never_read_share_the_buffer_instead_of_copying_it() -> None:
    """24 raw peers (no ZMQ on their side) each ask for a buffer of 8 messages of about 850 KB
    and never read. A copy of the buffer queued per peer would be about 160 MB of this process,
    less what the kernel's socket buffers take; the replies share the buffer's bytes."""
    publisher = publisher_with(8, 170_000)
    assert publisher.replay_endpoint is not None
    peers = [RawPeer(publisher.replay_endpoint) for _ in range(24)]
    time.sleep(0.3)
    before = rss_mib()
    for peer in peers:
        peer.send(request(0))
    assert wait_until(lambda: publisher.stats()["replays_asked"] == 24)
    time.sleep(0.5)  # every peer's replies are queued, as far as its connection takes them
    grown = rss_mib() - before
    for peer in peers:
        peer.close()
    publisher.close()
    assert grown < 30, f"{grown:.0f} MiB for 24 replays of a 6.5 MiB buffer"


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_reader_that_falls_behind_still_gets_every_message_and_the_end_marker(ctx: Any) -> None:
    """A replay of 3000 messages of about 5 KB to a router that reads only 0.5 s after asking:
    more than ZMQ's high-water marks hold on either side. Every message comes, in order, then
    the end marker (none is dropped at a full queue, which would leave a gap and no end)."""
    publisher = publisher_with(3000, 1000)
    assert publisher.replay_endpoint is not None
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart(request(0))
    time.sleep(0.5)
    got = read_all(dealer, quiet_ms=2000)
    assert [int.from_bytes(frames[2], "big") for frames in got[:-1]] == list(range(3000))
    assert got[-1] == [b"", b"", END, b""]
    publisher.close()


# ---- requests of every shape ---------------------------------------------------------------


def test_malformed_requests_get_nothing_and_odd_ones_only_the_end_marker(ctx: Any) -> None:
    """Requests that are not a replay request (a missing or 7-byte sequence number, a frame too
    many) get no answer; a start past the last message (2**64 - 1 included), a topic nobody
    publishes, a topic that is not UTF-8 get the end marker alone; and the honest request that
    follows on the same connection gets the buffer."""
    publisher = publisher_with(3, 10)
    assert publisher.replay_endpoint is not None
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    for frames in ([b""], [b"", b"\0" * 7], [b"", b"\0" * 8, TOPIC.encode(), b"x"]):
        dealer.send_multipart(frames)
    for frames in (
        request(3),
        request(2**64 - 1),
        request(0, b"kv@pod-b@tiny"),
        request(0, b"\xff\xfe" + TOPIC.encode()),
    ):
        dealer.send_multipart(frames)
    dealer.send_multipart(request(1, TOPIC.encode()))
    got = read_all(dealer, quiet_ms=500)
    assert got[:4] == [[b"", b"", END, b""]] * 4
    assert [(f[1], int.from_bytes(f[2], "big")) for f in got[4:6]] == [
        (TOPIC.encode(), 1),
        (TOPIC.encode(), 2),
    ]
    assert got[6:] == [[b"", b"", END, b""]]
    assert publisher.stats()["replays_asked"] == 5
    publisher.close()


def test_the_pub_keeps_publishing_while_peers_flood_the_replay_endpoint(ctx: Any) -> None:
    """Twenty connections that never read ask for a buffer of 2000 messages again and again
    while a store publishes: every event reaches the PUB's subscriber, in order, none dropped."""
    publisher = publisher_with(2000, 500, flush_s=0.005)
    assert publisher.replay_endpoint is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(publisher.endpoint)
    hostile = [RawPeer(publisher.replay_endpoint) for _ in range(20)]
    time.sleep(0.3)
    for n in range(200):
        for peer in hostile:
            peer.send(request(0))
        publisher.removed("alice", [n], "GPU")
        time.sleep(0.002)
    publisher.flush()
    told: list[int] = []
    while len(told) < 200:
        _topic, _seq, payload = sub.recv_multipart()
        told += [h for event in msgpack.unpackb(payload)[1] for h in event[1]]
    assert told == list(range(200)) and publisher.stats()["dropped_events"] == 0
    for peer in hostile:
        peer.close()
    publisher.close()


@pytest.mark.parametrize("taken", ["endpoint", "replay_endpoint"])
def test_an_address_taken_stops_the_start_naming_it_and_leaves_nothing_bound(
    ctx: Any, taken: str
) -> None:
    """A store whose events address is taken does not start, and the error names that field;
    the other address, bound first, is free again at once (the operator fixes one line)."""
    holder = ctx.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    free_port = free.getsockname()[1]
    free.close()
    addresses = {"endpoint": f"tcp://127.0.0.1:{free_port}", taken: f"tcp://127.0.0.1:{port}"}
    if taken == "endpoint":
        addresses["replay_endpoint"] = f"tcp://127.0.0.1:{free_port}"
    config = {**TINY_CONFIG, "events": {**addresses, "topic": TOPIC}}
    with pytest.raises(ConfigError, match=rf"events\.{taken}.*an address to bind"):
        KVStore(parse_config(config))
    again = ctx.socket(zmq.PUB)
    again.bind(f"tcp://127.0.0.1:{free_port}")  # raises if the failed start left it bound
    again.close(linger=0)
    holder.close(linger=0)
