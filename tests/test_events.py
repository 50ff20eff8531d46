"""The KV event publisher over real ZMQ sockets on loopback, read by a decoder written here from
vLLM's / llm-d's documented field positions (not kvtier's encoder): three frames per message,
sequence numbers without gaps, a late subscriber recovering through the replay endpoint,
tenants on topics of their own, and an overflow that tells routers to forget."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from kvtier.events import EventPublisher, EventSettings, hash64

TOPIC = "kv@pod-a@tiny"


# ---- the decoder: field positions as llm-d reads vLLM's events -----------------------------


def decode(frames: list[bytes]) -> tuple[str, int, float, list[dict[str, Any]]]:  # Decoded
    topic, seq, payload = frames
    ts, events, _dp_rank = msgpack.unpackb(payload)
    out = []
    for event in events:
        kind = event[0]
        if kind == "BlockStored":
            fields = {"hashes": 1, "parent": 2, "tokens": 3, "block_size": 4, "medium": 6}
            out.append({"type": kind, **{name: event[at] for name, at in fields.items()}})
        elif kind == "BlockRemoved":
            out.append({"type": kind, "hashes": event[1], "medium": event[2]})
        else:
            assert kind == "AllBlocksCleared", kind
            out.append({"type": kind})
    return topic.decode(), int.from_bytes(seq, "big"), ts, out


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: str = "") -> Any:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    time.sleep(0.3)  # a SUB's subscription reaches the PUB after the connect
    return sub


Decoded = tuple[str, int, float, list[dict[str, Any]]]


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int, *topic: bytes
) -> list[Decoded]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big"), *topic])
    got = []
    while True:
        frames = dealer.recv_multipart()
        assert frames[0] == b""
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            break
        got.append(decode(frames[1:]))
    dealer.close()
    return got


def test_events_arrive_in_order_with_every_field_at_its_place(context: Any) -> None:
    publisher = EventPublisher("tcp://127.0.0.1:0", settings=EventSettings(TOPIC, flush_s=0.0))
    sub = subscriber(context, publisher.endpoint)
    ids = [bytes([i]) * 16 for i in range(1, 4)]
    publisher.stored("alice", [hash64(i) for i in ids], None, list(range(12)), 4, "GPU")
    publisher.removed("alice", [hash64(ids[2])], "GPU")
    publisher.stored("alice", [hash64(ids[2])], hash64(ids[1]), [8, 9, 10, 11], 4, "CPU")
    publisher.cleared("alice")
    received: list[Decoded] = []
    while sum(len(decoded[3]) for decoded in received) < 4:
        received.append(decode(sub.recv_multipart()))
    assert [seq for _, seq, _, _ in received] == list(range(len(received)))  # no gaps
    assert all(topic == TOPIC for topic, *_ in received)
    events = [event for *_, batch in received for event in batch]
    assert events[0] == {"type": "BlockStored", "hashes": [hash64(i) for i in ids],
                         "parent": None, "tokens": list(range(12)), "block_size": 4,
                         "medium": "GPU"}  # fmt: skip
    assert events[1] == {"type": "BlockRemoved", "hashes": [hash64(ids[2])], "medium": "GPU"}
    assert events[2]["parent"] == hash64(ids[1]) and events[2]["medium"] == "CPU"
    assert events[3] == {"type": "AllBlocksCleared"}
    assert hash64(ids[0]) == int.from_bytes(ids[0][:8], "big") < 2**64
    publisher.close()
    assert publisher.stats()["events"] == 4


def test_a_late_subscriber_recovers_the_gap_through_the_replay_endpoint(context: Any) -> None:
    publisher = EventPublisher(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", EventSettings(TOPIC, max_batch=1, flush_s=0.0)
    )
    for n in range(5):  # before anyone listens: 5 messages, seq 0..4
        publisher.removed("alice", [n], "DISK")
    deadline = time.monotonic() + 5
    while publisher.stats()["messages"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    sub = subscriber(context, publisher.endpoint)
    publisher.removed("alice", [5], "DISK")
    _, seq, _, events = decode(sub.recv_multipart())
    assert seq == 5 and events[0]["hashes"] == [5]  # 0..4 were missed: a gap
    assert publisher.replay_endpoint is not None
    missed = replay(context, publisher.replay_endpoint, 0)
    assert [s for _, s, _, _ in missed] == [0, 1, 2, 3, 4, 5]
    assert [e[0]["hashes"] for *_, e in missed] == [[0], [1], [2], [3], [4], [5]]
    assert replay(context, publisher.replay_endpoint, 4)[0][1] == 4
    publisher.close()


def test_per_tenant_topics_keep_tenants_apart_with_sequences_of_their_own(context: Any) -> None:
    publisher = EventPublisher(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", EventSettings(TOPIC, True, flush_s=0.0)
    )
    alice = subscriber(context, publisher.endpoint, f"{TOPIC}@alice")
    publisher.removed("bob", [1], "GPU")
    publisher.removed("alice", [2], "GPU")
    topic, seq, _, events = decode(alice.recv_multipart())
    assert (topic, seq, events[0]["hashes"]) == (f"{TOPIC}@alice", 0, [2])  # bob's never here
    assert publisher.replay_endpoint is not None
    bobs = replay(context, publisher.replay_endpoint, 0, f"{TOPIC}@bob".encode())
    assert [(t, s, e[0]["hashes"]) for t, s, _, e in bobs] == [(f"{TOPIC}@bob", 0, [1])]
    assert replay(context, publisher.replay_endpoint, 0) == []  # no shared topic in this mode
    publisher.close()


def test_events_dropped_on_overflow_are_counted_and_tell_routers_to_forget(context: Any) -> None:
    publisher = EventPublisher(
        "tcp://127.0.0.1:0", settings=EventSettings(TOPIC, queue_limit=2, flush_s=0.0)
    )
    sub = subscriber(context, publisher.endpoint)
    with publisher._lock:  # the sender waits on it: the queue fills
        for n in range(6):
            publisher.removed("alice", [n], "CPU")
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while publisher.stats()["messages"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the sender drains what the queue held
    publisher.removed("alice", [99], "CPU")
    seen: list[dict[str, Any]] = []
    while not any(e.get("hashes") == [99] for e in seen):
        seen += decode(sub.recv_multipart())[3]
    assert publisher.stats()["dropped_events"] >= 3
    cleared = [i for i, e in enumerate(seen) if e["type"] == "AllBlocksCleared"]
    assert cleared and cleared[0] < len(seen) - 1  # forget first, then what came after
    publisher.close()
