"""A store's KV events, read over a real ZMQ socket by a decoder written from vLLM's / llm-d's
field positions: after every store, demotion, eviction, disk write and clear, the residency the
events describe (block hash -> media) equals the index's own, sequence numbers have no gaps, a
subscriber that joins late recovers through replay, and per-tenant topics keep tenants apart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import zmq
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, kv_for, tiny_block_bytes

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError
from kvtier.index.node import Node

MEDIA = {"gpu": "GPU", "host": "CPU", "disk": "DISK"}


def make(tmp_path: Path, per_tenant: bool = False, connect: tuple[str, ...] = ()) -> KVStore:
    block = tiny_block_bytes()
    return KVStore(
        parse_config(
            {
                "model": {**TINY_MODEL, "dtype": "float32"},
                "block_tokens": TINY_BLOCK_TOKENS,
                "tiers": {
                    "gpu": {"capacity": 4 * block, "device": "cpu"},
                    "host": {"capacity": 8 * block, "pinned": False},
                    "disk": {"capacity": 64 * block, "path": str(tmp_path / "disk")},
                },
                "mover": {"background": False},
                "tenants": {"alice": {}, "bob": {}},
                "events": {
                    "endpoint": "tcp://127.0.0.1:0",
                    "replay_endpoint": "tcp://127.0.0.1:0",
                    "topic": "kv@pod@tiny",
                    "per_tenant_topic": per_tenant,
                    "connect": list(connect),
                },
            }
        )
    )


class Listener:
    """A SUB that decodes by field position and keeps the residency the events describe."""

    def __init__(
        self, ctx: Any, endpoint: str | None, topic: str = "", host: str = "127.0.0.1"
    ) -> None:
        """Connects to `endpoint`; with None, binds a port of `host` (`port`) and waits for
        publishers to connect to it."""
        self.sub = ctx.socket(zmq.SUB)
        if "[" in (endpoint or host):
            self.sub.setsockopt(zmq.IPV6, 1)
        self.sub.setsockopt(zmq.RCVTIMEO, 200)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        if endpoint is None:
            self.port = self.sub.bind_to_random_port(f"tcp://{host}")
        else:
            self.sub.connect(endpoint)
            time.sleep(0.3)
        self.media: dict[int, set[str]] = {}
        self.tokens: dict[int, list[int]] = {}  # hash -> its block's tokens
        self.seqs: list[int] = []
        self.topics: set[str] = set()

    def apply(self, payload: bytes) -> None:
        _ts, events, _rank = msgpack.unpackb(payload)
        for event in events:
            if event[0] == "BlockStored":
                size = event[4]
                for n, h in enumerate(event[1]):
                    self.media.setdefault(h, set()).add(event[6])
                    self.tokens[h] = event[3][n * size : (n + 1) * size]
            elif event[0] == "BlockRemoved":
                for h in event[1]:
                    self.media[h].discard(event[2])
                    if not self.media[h]:
                        del self.media[h]
            else:
                self.media.clear()

    def drain(self) -> None:
        while True:
            try:
                topic, seq, payload = self.sub.recv_multipart()
            except zmq.Again:
                return
            self.topics.add(topic.decode())
            self.seqs.append(int.from_bytes(seq, "big"))
            self.apply(payload)


def residency(store: KVStore, tokens: dict[int, list[int]] | None = None) -> dict[int, set[str]]:
    """Block hash (its event number: `node.ev` + i) -> media, from the index itself; with
    `tokens`, each block's tokens must be those the events told of."""
    out: dict[int, set[str]] = {}
    stack: list[Node] = []
    for root in store.index.roots():
        stack.extend(root.children.values() if root.children else ())
    while stack:
        node = stack.pop()
        assert node.ev > 0  # every block was told of
        keys = np.frombuffer(node.key, "<u4").reshape(node.size, -1).tolist()
        for i in range(node.size):
            media = {
                MEDIA[t] for n, t in enumerate(store.tier_names) if node.slots[n][i] is not None
            }
            h = node.ev + i
            out[h] = media
            if tokens is not None:
                assert tokens[h] == keys[i], (h, tokens[h], keys[i])
        stack.extend(node.children.values() if node.children else ())
    return out


def settle(listener: Listener, store: KVStore) -> None:
    deadline = time.monotonic() + 5
    while True:
        listener.drain()
        if listener.media == residency(store) or time.monotonic() > deadline:
            break
    assert listener.media == residency(store, listener.tokens)


def test_events_track_where_every_block_lives(tmp_path: Path, ctx: Any) -> None:
    store = make(tmp_path)
    assert store.parts.events is not None
    listener = Listener(ctx, store.parts.events.endpoint)
    prompts = [list(range(100 * p, 100 * p + 12)) for p in range(6)]  # 3 blocks each
    for n, tokens in enumerate(prompts):  # stores; past 4 gpu / 8 host slots: demotions
        store.store(tokens, kv_for(store, 12, seed=n), tenant="alice")
        settle(listener, store)
    assert store.persist() > 0  # disk copies
    settle(listener, store)
    assert any("DISK" in media for media in listener.media.values())
    for n, tokens in enumerate(prompts[:3]):
        store.load(tokens, tenant="alice")  # back up from disk where they left memory
        store.store(tokens[:4] + [9999] * 8, kv_for(store, 12, seed=50 + n), tenant="alice")
        settle(listener, store)
    store.clear(tenant="alice")
    settle(listener, store)
    assert listener.media == {}
    first = listener.seqs[0]  # the store's start, in µs (`EventPublisher`, Incarnations)
    assert listener.seqs == list(range(first, first + len(listener.seqs)))  # no gaps
    assert listener.topics == {"kv@pod@tiny"}
    store.check()
    store.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_a_subscriber_that_binds_gets_every_event_through_connect(
    tmp_path: Path, ctx: Any, host: str
) -> None:
    """llm-d's indexer with a static `zmqEndpoint` binds and waits for publishers (vLLM connects
    to it): with `events.connect` the store's PUB goes to it as well as binding its own."""
    indexer = Listener(ctx, None, "kv@", host)
    store = make(tmp_path, connect=(f"tcp://{host}:{indexer.port}",))
    assert store.parts.events is not None
    publisher = store.parts.events
    bound = Listener(ctx, publisher.endpoint)  # its own endpoint serves as before
    deadline = time.monotonic() + 10
    while not (indexer.seqs and bound.seqs):  # both connected: ZMQ connects in the background
        assert time.monotonic() < deadline, "the connected subscriber never heard the store"
        publisher.cleared("bob")  # nothing to forget: a message either may miss
        time.sleep(0.1)
        indexer.drain()
        bound.drain()
    for n in range(6):  # past 4 gpu / 8 host slots: demotions
        store.store(list(range(100 * n, 100 * n + 12)), kv_for(store, 12, seed=n), tenant="bob")
        settle(indexer, store)
        settle(bound, store)
    store.clear(tenant="bob")
    settle(indexer, store)
    settle(bound, store)
    assert indexer.media == {} and indexer.topics == {"kv@pod@tiny"}
    first = max(indexer.seqs[0], bound.seqs[0])  # both heard every message from there
    assert indexer.seqs[indexer.seqs.index(first) :] == bound.seqs[bound.seqs.index(first) :]
    assert bound.seqs == list(range(bound.seqs[0], bound.seqs[-1] + 1))  # without gaps
    store.close()


def test_a_peer_that_joins_later_is_told_every_block_held(tmp_path: Path, ctx: Any) -> None:
    """A router that does not replay (llm-d) joins after the blocks were told: the store tells
    it (and everyone: a block told again changes nothing) every block it holds, untouched
    blocks included, once its subscription can have arrived."""
    store = make(tmp_path)
    publisher = store.parts.events
    assert publisher is not None
    early = Listener(ctx, publisher.endpoint)
    for n in range(6):  # past 4 gpu / 8 host slots: demotions
        store.store(list(range(100 * n, 100 * n + 12)), kv_for(store, 12, seed=n), tenant="bob")
        settle(early, store)
    assert store.persist() > 0
    settle(early, store)
    retells = publisher.stats()["retells"]
    late = Listener(ctx, publisher.endpoint)  # no replay asked, nothing stored after
    settle(late, store)
    assert any("DISK" in media for media in late.media.values())
    assert publisher.stats()["retells"] > retells
    settle(early, store)  # what it already knew, told again: the same residency
    assert early.seqs == list(range(early.seqs[0], early.seqs[0] + len(early.seqs)))
    store.check()
    store.close()


def test_an_address_zmq_cannot_connect_to_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        make(tmp_path, connect=("tcp://-:1",))
    assert info.value.field == "events.connect" and "connect to" in info.value.expected


def test_a_late_subscriber_recovers_and_tenants_keep_to_their_topics(
    tmp_path: Path, ctx: Any
) -> None:
    store = make(tmp_path, per_tenant=True)
    publisher = store.parts.events
    assert publisher is not None and publisher.replay_endpoint is not None
    store.store(list(range(12)), kv_for(store, 12, seed=1), tenant="bob")
    store.store(list(range(12)), kv_for(store, 12, seed=2), tenant="alice")
    deadline = time.monotonic() + 5
    while publisher.stats()["messages"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    late = Listener(ctx, publisher.endpoint, "kv@pod@tiny@alice")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"kv@pod@tiny@alice"])
    while (frames := dealer.recv_multipart())[2] != (-1).to_bytes(8, "big", signed=True):
        assert frames[1] == b"kv@pod@tiny@alice"  # bob's never replayed to alice
        late.seqs.append(int.from_bytes(frames[2], "big"))
        late.apply(frames[3])
    alice = set(residency(store))
    assert late.seqs[0] == publisher.first_seq and set(late.media) <= alice and late.media
    bob_root = next(r for r in store.index.roots() if r.ids == store.namespaces.seed("bob"))
    assert bob_root.children
    bob_first = next(iter(bob_root.children.values()))
    assert bob_first.ev not in late.media
    dealer.close()
    store.close()


def test_a_restarted_store_tells_routers_to_forget_then_what_recovery_brought_back(
    tmp_path: Path, ctx: Any
) -> None:
    store = make(tmp_path)
    for n in range(3):
        store.store(list(range(100 * n, 100 * n + 12)), kv_for(store, 12, seed=n), tenant="bob")
    assert store.persist() > 0
    store.close()
    again = make(tmp_path)  # recovers the disk tier, then turns events on
    publisher = again.parts.events
    assert publisher is not None and publisher.replay_endpoint is not None
    publisher.flush()
    listener = Listener(ctx, publisher.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    first = True
    while (frames := dealer.recv_multipart())[2] != (-1).to_bytes(8, "big", signed=True):
        if first:  # the topic's first words: forget whatever this pod said in a past life
            assert msgpack.unpackb(frames[3])[1][0] == ["AllBlocksCleared"]
            first = False
        listener.apply(frames[3])
    restored = residency(again, listener.tokens)
    assert listener.media == restored and restored  # what the disk tier kept
    assert all(media == {"DISK"} for media in restored.values())
    dealer.close()
    again.check()
    again.close()
