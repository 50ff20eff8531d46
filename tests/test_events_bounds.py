"""Bounded event messages, both ways. A publisher never sends a message longer than its
`max_message_bytes`: a run of blocks too long for one event goes out as several, each chained to
the one before by its parent hash, so a decoder written from the wire's field positions (and the
router's index) learns the same blocks. A router's subscriber takes nothing longer than its own
bound from a publisher it does not trust, and a replay endpoint that never stops answering, or a
gap no replay could fill, costs it a bounded wait and a forgotten topic, not its memory."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import torch
import zmq
from conftest import TINY_MODEL, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.events import EventPublisher, EventSettings, wire
from kvtier.routing import PrefixIndex, Subscriber

TOPIC = "kv@pod-a@tiny"


# ---- the packer cuts long runs -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(1, 300),
    bs=st.sampled_from([1, 4, 16]),
    limit=st.integers(200, 4000),  # one block of 16 tokens fits in 200 bytes
    tiers=st.sampled_from([(0,), (1,), (0, 2)]),
    removed=st.integers(1, 700),
)
def test_no_event_passes_the_bound_and_the_pieces_tell_the_same_blocks(
    blocks: int, bs: int, limit: int, tiers: tuple[int, ...], removed: int
) -> None:
    """A `told_stored` and a `Stored` of `blocks` blocks, and removals of `removed` hashes, with
    events of at most `limit` bytes: decoded by msgpack, per medium the pieces' hashes and tokens
    in order are the whole run's, each piece's parent is the last hash of the piece before (the
    first's the run's own), and the removals together name every hash once, in order."""
    media = ["GPU", "CPU", "DISK"]
    key = np.arange(blocks * bs, dtype="<u4").tobytes()
    ev, parent = 2**64 - 2 * blocks - 7, 12345  # near the top of uint64: no wrap, still exact
    whole_tokens = list(range(blocks * bs))
    hashes = [ev + i for i in range(blocks)]
    specs: list[wire.Spec] = [
        wire.told_stored(key, 4 * bs, ev, 0, blocks, parent, bs, tiers, media),
        wire.told_removed(10, removed, "CPU"),
        wire.Removed(np.arange(5, 5 + removed, dtype=">u8").tobytes(), "CPU"),
        wire.Stored(wire.Blocks(np.array(hashes, ">u8").tobytes(), None, key, bs), "REMOTE"),
    ]
    packed = wire.Packer(limit).pack_all(specs)
    assert all(len(event) <= limit for event in packed)
    events = [msgpack.unpackb(event) for event in packed]
    runs: dict[str, list[list[Any]]] = {}
    gone: list[int] = []
    for event in events:
        if event[0] == "BlockStored":
            runs.setdefault(event[6], []).append(event)
        else:
            assert event[0] == "BlockRemoved" and event[2] == "CPU"
            gone += event[1]
    assert gone == list(range(10, 10 + removed)) + list(range(5, 5 + removed))
    told = {media[t]: parent for t in tiers} | {"REMOTE": None}
    for medium, first_parent in told.items():
        pieces = runs.pop(medium)
        assert [h for p in pieces for h in p[1]] == hashes
        assert [t for p in pieces for t in p[3]] == whole_tokens
        assert [p[2] for p in pieces] == [first_parent] + [p[1][-1] for p in pieces[:-1]]
        assert all(p[4] == bs and len(p[3]) == bs * len(p[1]) for p in pieces)
    assert not runs


# ---- a store's publisher over a real socket ----------------------------------------------


def test_a_long_prompt_goes_out_in_messages_under_the_bound_and_a_router_learns_it_whole(
    ctx: Any,
) -> None:
    """A 32,000-token prompt (2,000 blocks, about 180 KB of tokens and hashes per tier) under
    `max_message_bytes` 64 KiB: every message fits, the numbers have no gap, and a router's
    index fed by the same socket scores the whole prompt on both tiers the store wrote."""
    limit = 1 << 16
    config = {
        "model": {**TINY_MODEL, "dtype": "float16", "num_layers": 1, "num_kv_heads": 1},
        "block_tokens": 16,
        "tiers": {
            "gpu": {"capacity": "4MiB", "device": "cpu"},
            "host": {"capacity": "4MiB", "pinned": False},
        },
        "mover": {"background": False},
        "policy": {"write": "write_through"},
        "events": {"endpoint": "tcp://127.0.0.1:0", "topic": TOPIC, "max_message_bytes": limit},
    }
    store = KVStore(parse_config(config))
    publisher = store.parts.events
    assert publisher is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    time.sleep(0.3)
    tokens = np.arange(7, 7 + 32_000, dtype=np.int64)
    layout = store.layout
    kv = torch.zeros(1, 2, len(tokens), 1, layout.head_dim, dtype=torch.float16)
    assert store.store(tokens, kv).stored_tokens == 32_000
    publisher.flush()
    index = PrefixIndex(16)
    told: dict[str, list[int]] = {}  # medium -> hashes, in the order told
    seqs = []
    for _ in range(publisher.sent(TOPIC)):
        topic, seq, payload = sub.recv_multipart()
        assert len(payload) <= limit
        seqs.append(int.from_bytes(seq, "big"))
        index.apply(topic.decode(), payload)
        for event in msgpack.unpackb(payload)[1]:
            if event[0] == "BlockStored":
                told.setdefault(event[6], []).extend(event[1])
    index.check()
    first = seqs[0]  # the store's start, in µs (`EventPublisher`, Incarnations)
    assert seqs == list(range(first, first + len(seqs))) and len(seqs) >= 6  # 2 x 180 KB
    assert {m: len(set(h)) for m, h in told.items()} == {"GPU": 2000, "CPU": 2000}
    assert told["GPU"] == told["CPU"]
    assert index.score(tokens) == {"pod-a": 32_000.0}
    store.close()


def test_a_bound_too_small_for_one_block_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match="max_message_bytes: got 1000"):
        EventPublisher("tcp://127.0.0.1:0", settings=EventSettings(max_message_bytes=1000))
    config = {
        "model": {**TINY_MODEL, "dtype": "float16"},
        "tiers": {"gpu": {"capacity": "1MiB", "device": "cpu"}},
        "events": {"endpoint": "tcp://127.0.0.1:0", "max_message_bytes": 4096},
    }
    with pytest.raises(ConfigError, match="max_message_bytes"):
        parse_config(config)


# ---- a router's subscriber against publishers it does not trust -------------------------


def stored_batch(hash_: int, tokens: list[int]) -> bytes:
    event = ["BlockStored", [hash_], None, tokens, len(tokens), None, "GPU", None]
    packed: bytes = msgpack.packb([time.time(), [event], None])
    return packed


def test_a_message_past_the_subscribers_bound_is_never_taken_and_the_rest_still_is(
    ctx: Any,
) -> None:
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(4)
    sub = Subscriber(index, max_message_bytes=1 << 20)
    sub.add(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)
    # a valid BlockStored of 200,000 blocks of [5, 5, 5, 5] (about 1.4 MiB): had it been
    # taken, the pod would hold the prompt [5] * 8
    blocks = 200_000
    event = ["BlockStored", list(range(1, blocks + 1)), None, [5] * (4 * blocks), 4, None, "GPU"]
    huge = msgpack.packb([time.time(), [[*event, None]], None])
    assert len(huge) > 1 << 20
    pub.send_multipart([TOPIC.encode(), (0).to_bytes(8, "big"), huge])
    honest = stored_batch(2, [1, 2, 3, 4])

    seq = iter(range(1, 10**6))

    def taken() -> bool:  # sent, in sequence, until the dropped connection is made again
        pub.send_multipart([TOPIC.encode(), next(seq).to_bytes(8, "big"), honest])
        return index.score([1, 2, 3, 4]) == {"pod-a": 4.0}

    assert wait_until(taken)
    assert index.score([5] * 8) == {}  # the long message's blocks never arrived
    assert sub.stats()["bad"] == 0
    stats = sub.stats()
    assert stats["disconnects"] >= 1  # ZMQ dropped the connection; the subscriber made it again
    assert stats["resets"] >= 1  # the lost message 0 was a gap nobody could fill
    index.check()
    sub.close()
    pub.close()


class HostileReplay:
    """A replay ROUTER that answers a request without end (never the end marker): the first
    message of the gap again and again (`flood` False), or every message of the gap in turn,
    each `size` bytes long (`flood`); it counts the requests it got."""

    def __init__(self, ctx: Any, flood: bool, size: int = 0) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.requests = 0
        self.flood = flood
        self.payload = stored_batch(9, [9, 9, 9, 9]) + b"\0" * size  # extra bytes: not events
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        client: bytes | None = None
        seq = 0
        while not self.stop.is_set():
            if self.router.poll(1):
                frames = self.router.recv_multipart()
                client, seq = frames[0], int.from_bytes(frames[2], "big")
                self.requests += 1
            if client is not None:
                item = seq.to_bytes(8, "big")
                self.router.send_multipart([client, b"", TOPIC.encode(), item, self.payload])
                seq += self.flood

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.router.close()


@pytest.mark.parametrize("mode", ["repeats", "floods", "a gap no replay could hold"])
def test_a_replay_endpoint_that_never_stops_costs_a_bounded_wait_and_a_forgotten_topic(
    ctx: Any, mode: str
) -> None:
    """After a gap of 1000 messages the subscriber asks the replay endpoint, which answers
    without end: the first message of the gap over and over (the replay ends at
    `replay_timeout`), or every message of the gap in turn at 64 KiB each (it ends at
    `max_replay_bytes`, 4 MiB here: before the gap is whole). Either way nothing it sent is
    applied, the topic is forgotten, and the next messages apply. A sequence number near 2**63
    is a gap no replay could hold: nothing is asked for."""
    hostile = HostileReplay(ctx, flood=mode == "floods", size=64 << 10)
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(4)
    sub = Subscriber(index, replay_timeout=1.0, max_replay_bytes=4 << 20)
    sub.add(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{hostile.port}")
    time.sleep(0.3)
    first = 2**63 if mode == "a gap no replay could hold" else 1000
    started = time.monotonic()
    pub.send_multipart([TOPIC.encode(), first.to_bytes(8, "big"), stored_batch(1, [1, 2, 3, 4])])
    assert sub.wait(TOPIC, first + 1, timeout=5)
    assert time.monotonic() - started < 3  # bounded by the subscriber, not by the endpoint
    assert sub.stats()["resets"] == 1 and sub.stats()["replayed"] == 0
    assert hostile.requests == (0 if mode == "a gap no replay could hold" else 1)
    assert index.score([1, 2, 3, 4]) == {"pod-a": 4.0} and index.score([9] * 4) == {}
    nxt = (first + 1).to_bytes(8, "big")
    pub.send_multipart([TOPIC.encode(), nxt, stored_batch(3, [5, 6, 7, 8])])
    assert sub.wait(TOPIC, first + 2)
    assert index.score([1, 2, 3, 4, 5, 6, 7, 8]) == {"pod-a": 4.0}  # block 3 has no parent
    index.check()
    sub.close()
    hostile.close()
    pub.close()
