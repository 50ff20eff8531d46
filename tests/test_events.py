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

from kvtier.blocks import BlockHasher, encode_tokens
from kvtier.events import EventPublisher, EventSettings, wire
from kvtier.events.observer import IndexEvents
from kvtier.index import RadixIndex
from kvtier.index.node import Node

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
    hashes = [1, 2**63 + 5, 2**64 - 1]  # uint64s, the top bit too
    tokens = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1, 7, 8]  # every int width
    publisher.stored("alice", hashes, None, tokens, 4, "GPU")
    publisher.removed("alice", hashes[2:], "GPU")
    publisher.stored("alice", hashes[2:], hashes[1], [8, 9, 10, 11], 4, "CPU")
    publisher.cleared("alice")
    long = list(range(70_000))  # an array past msgpack's 16-bit length
    publisher.stored("alice", list(range(5, 5 + 17_500)), 3, long, 4, "DISK")
    received: list[Decoded] = []
    while sum(len(decoded[3]) for decoded in received) < 6:
        received.append(decode(sub.recv_multipart()))
    assert [seq for _, seq, _, _ in received] == list(range(len(received)))  # no gaps
    assert all(topic == TOPIC for topic, *_ in received)
    events = [event for *_, batch in received for event in batch]
    assert events[0] == {"type": "AllBlocksCleared"}  # a topic's first words: forget my past
    assert events[1] == {"type": "BlockStored", "hashes": hashes, "parent": None,
                         "tokens": tokens, "block_size": 4, "medium": "GPU"}  # fmt: skip
    assert events[2] == {"type": "BlockRemoved", "hashes": hashes[2:], "medium": "GPU"}
    assert events[3]["parent"] == hashes[1] and events[3]["medium"] == "CPU"
    assert events[4] == {"type": "AllBlocksCleared"}
    assert events[5]["tokens"] == long and events[5]["hashes"][-1] == 5 + 17_499
    publisher.close()
    assert publisher.stats()["events"] == 6


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
    assert [e[-1]["hashes"] for *_, e in missed] == [[0], [1], [2], [3], [4], [5]]
    assert missed[0][3][0] == {"type": "AllBlocksCleared"}  # the topic's first message
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
    assert (topic, seq, events[-1]["hashes"]) == (f"{TOPIC}@alice", 0, [2])  # bob's never here
    assert publisher.replay_endpoint is not None
    bobs = replay(context, publisher.replay_endpoint, 0, f"{TOPIC}@bob".encode())
    assert [(t, s, e[-1]["hashes"]) for t, s, _, e in bobs] == [(f"{TOPIC}@bob", 0, [1])]
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


def test_the_replay_buffer_is_bounded_in_bytes_too(context: Any) -> None:
    settings = EventSettings(TOPIC, max_batch=1, flush_s=0.0, buffer=1000, buffer_bytes=20_000)
    publisher = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", settings)
    for n in range(30):  # about 5 KB a message: 1000 tokens of 5 bytes
        publisher.stored("alice", [n], None, list(range(1000)), 1000, "GPU")
    publisher.flush()
    assert publisher.replay_endpoint is not None
    kept = replay(context, publisher.replay_endpoint, 0)
    assert 2 <= len(kept) <= 4 and [s for _, s, _, _ in kept] == list(range(30 - len(kept), 30))
    assert kept[-1][3][0]["hashes"] == [29]
    publisher.close()


def test_event_numbers_name_each_live_block_once_and_stay_with_it_through_splits(
    context: Any,
) -> None:
    """A node's blocks take the numbers ev, ev + 1, ... of a range of their own (`node.ev`): over
    many prompts, splits and a run longer than a range (`node_blocks`: a chain of nodes), every
    live block has a number no other live block has, a split keeps each block's number, and
    the events a subscriber reads name exactly those numbers, each run after its parent's last
    block."""
    hasher = BlockHasher()
    index = RadixIndex(("gpu",), 1, hasher, node_blocks=8)  # a node holds 8 blocks at most
    settings = EventSettings(TOPIC, queue_limit=10**6, flush_s=0.0)
    publisher = EventPublisher("tcp://127.0.0.1:0", settings=settings)
    sub = subscriber(context, publisher.endpoint)
    observer = IndexEvents(publisher, index, lambda namespace: "t")
    index.observer = observer
    ns = hasher.seed(b"\0" * 16, b"t")
    slot = 0

    def store(tokens: list[int]) -> None:
        nonlocal slot
        key = encode_tokens(tokens)
        match = index.match(ns, key)
        count = len(tokens) - match.num_blocks
        index.insert(match, key, {0: list(range(slot, slot + count))})
        slot += count

    def numbers() -> dict[bytes, tuple[int, int, bytes | None]]:
        """Each live block's (number, token, id of the block before it), keyed by its id (a
        chain of its tokens from the namespace root: the same before and after a split)."""
        out: dict[bytes, tuple[int, int, bytes | None]] = {}
        ds = index.digest_size
        stack: list[tuple[Node, bytes | None]] = []
        for root in index.roots():
            stack += [(child, None) for child in (root.children or {}).values()]
        while stack:
            node, above = stack.pop()
            ids, tokens = index.forest.ids_of(node), memoryview(node.key).cast("I")
            for i in range(node.size):
                before = above if i == 0 else ids[(i - 1) * ds : i * ds]
                out[ids[i * ds : (i + 1) * ds]] = (node.ev + i, tokens[i], before)
            stack += [(child, ids[-ds:]) for child in (node.children or {}).values()]
        return out

    for p in range(40):
        store([p % 4] + [p * 1000 + i for i in range(6)])  # 4 first blocks shared, then own
    before = numbers()
    store([0] + [0 * 1000 + i for i in range(3)] + [999_999])  # splits the first prompt's node
    index.check()
    after = numbers()
    assert all(after[block][0] == number for block, (number, _, _) in before.items())
    long = [7_000_000 + i for i in range(2 * 8 + 3)]
    store(long)  # longer than a node may be: a chain of three nodes, told of parents first
    chain = index.match(ns, encode_tokens(long)).end
    assert chain.size == 3 and chain.parent is not None and chain.parent.size == 8
    store([*long, 1, 2, 3])  # the leaf grows to 6 blocks
    store([*long, 1, 2, 3, 4, 5, 6])  # 9 would be too many: a child hangs below it instead
    grown = index.match(ns, encode_tokens([*long, 1, 2, 3, 4, 5, 6])).end
    assert grown.size == 3 and grown.parent is chain and chain.size == 6
    split = [8_000_000 + i for i in range(8)]
    store(split)  # one node of 8: a whole range
    store([*split[:4], 9_000_000])  # split after 4: the tail keeps numbers ev + 4 .. ev + 7
    tail = index.match(ns, encode_tokens(split)).end
    assert tail.size == 4 and tail.ev % 8 == 4
    store([*split, 1, 2])  # the tail may not grow past its range: a child hangs below it
    assert tail.size == 4 and index.match(ns, encode_tokens([*split, 1, 2])).end.parent is tail
    index.check()
    live = numbers()
    assert len({number for number, _, _ in live.values()}) == len(live) == index.num_blocks

    told: dict[int, tuple[int, int | None]] = {}  # number -> (token, number before it)
    while len(told) < index.num_blocks:
        for event in decode(sub.recv_multipart())[3]:
            if event["type"] == "BlockStored":
                assert event["medium"] == "GPU" and event["block_size"] == 1
                for i, number in enumerate(event["hashes"]):
                    parent = event["parent"] if i == 0 else event["hashes"][i - 1]
                    told[number] = (event["tokens"][i], parent)
    publisher.close()
    assert len(told) == len(live)
    for number, token, before_id in live.values():  # its token, after the block before it
        assert told[number] == (token, None if before_id is None else live[before_id][0])


def test_a_batch_packs_in_order_and_merges_removals_next_to_each_other() -> None:
    """`Packer.pack_all` over what the observer queues: a BlockStored per tier a store wrote
    (one body), removals in a row in one medium as one BlockRemoved, a new event wherever the
    medium or the kind changes, every hash at the top of uint64 too; decoded by msgpack."""
    key = bytes(range(40))  # 10 tokens of 4 bytes, 4 a block at kb = 16
    specs: list[wire.Spec] = [
        wire.told_stored(key, 16, 2**64 - 3, 0, 2, None, 4, (0, 2), ["GPU", "CPU", "DISK"]),
        wire.told_removed(2**64 - 2, 2, "CPU"),
        wire.told_removed(5, 1, "CPU"),
        wire.Removed((9).to_bytes(8, "big"), "CPU"),
        wire.told_removed(6, 3, "GPU"),
        wire.CLEARED,
        wire.told_removed(7, 1, "GPU"),
        wire.told_stored(key, 16, 100, 1, 2, 7, 4, (1,), ["GPU", "CPU"]),
    ]
    events = [msgpack.unpackb(event) for event in wire.Packer().pack_all(specs)]
    tokens = [int.from_bytes(key[i : i + 4], "little") for i in range(0, 32, 4)]
    assert events == [
        ["BlockStored", [2**64 - 3, 2**64 - 2], None, tokens, 4, None, "GPU", None],
        ["BlockStored", [2**64 - 3, 2**64 - 2], None, tokens, 4, None, "DISK", None],
        ["BlockRemoved", [2**64 - 2, 2**64 - 1, 5, 9], "CPU"],
        ["BlockRemoved", [6, 7, 8], "GPU"],
        ["AllBlocksCleared"],
        ["BlockRemoved", [7], "GPU"],
        ["BlockStored", [101], 7, tokens[4:], 4, None, "CPU", None],
    ]


def test_the_replay_endpoint_drops_a_peer_that_sends_more_than_a_request(context: Any) -> None:
    """Anyone who can connect may send to the replay ROUTER: a frame larger than any request is
    refused by ZMQ (the peer disconnected) before it is buffered whole, and honest requests are
    still answered."""
    from zmq.utils.monitor import recv_monitor_message

    publisher = EventPublisher(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", EventSettings(TOPIC, flush_s=0.0)
    )
    assert publisher.replay_endpoint is not None
    publisher.removed("alice", [1], "GPU")
    hostile = context.socket(zmq.DEALER)
    hostile.setsockopt(zmq.RECONNECT_IVL, -1)  # once dropped, it stays dropped
    monitor = hostile.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    monitor.setsockopt(zmq.RCVTIMEO, 5000)
    hostile.connect(publisher.replay_endpoint)
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
    hostile.send_multipart([b"", (0).to_bytes(8, "big"), b"x" * (8 << 20)])
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    assert [s for _, s, _, _ in replay(context, publisher.replay_endpoint, 0)] == [0]
    hostile.disable_monitor()
    publisher.close()
