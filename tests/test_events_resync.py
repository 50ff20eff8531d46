"""A store whose event queue overflowed tells its routers what it holds again
(`EventPublisher._resync`, `IndexEvents.retold`).

Before, a lost event made the topic's next message start with `AllBlocksCleared` and nothing
more: a router forgot every block of the topic (every tenant's, on a shared one), and one
without a snapshot to resync from held nothing of that pod until the store happened to tell of
the same blocks again; each block the store chained to a forgotten one was an orphan, skipped.
Now the publisher's thread, under the store's lock, drops what was queued for the lost topic
and sends `AllBlocksCleared` followed by every block that topic's tenants hold. The truth a
router is checked against here is the store's own snapshot (`GET /v1/blocks`) applied to a
fresh index; the router under test has no snapshot to ask (`Subscriber.add` without one).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import torch
import zmq

from kvtier import KVStore, parse_config
from kvtier.events.observer import snapshot
from kvtier.events.publisher import RESYNC_MIN_S, EventPublisher
from kvtier.routing import PrefixIndex, Subscriber

BS = 4
TOPIC = "kv@pod-a@m"
SLOT_BYTES = 2 * BS * 8 * 2  # K and V, one layer, one head of 8, float16


def _config(per_tenant: bool) -> Any:
    return parse_config(
        {
            "model": {"name": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                      "dtype": "float16"},
            "block_tokens": BS,
            "tiers": {"gpu": {"capacity": 24 * SLOT_BYTES, "device": "cpu"},
                      "host": {"capacity": 64 * SLOT_BYTES}},
            "mover": {"background": False},
            "tenants": {"a": {}, "b": {}},
            "events": {"endpoint": "tcp://127.0.0.1:0", "topic": TOPIC,
                       "per_tenant_topic": per_tenant},
        }
    )  # fmt: skip


class Pod:
    """A real store publishing events, and a router (no snapshot) subscribed to them."""

    def __init__(self, per_tenant: bool) -> None:
        self.store = KVStore(_config(per_tenant))
        publisher = self.store.parts.events
        assert publisher is not None
        self.publisher: EventPublisher = publisher
        self.router = PrefixIndex(BS)
        self.subscriber = Subscriber(self.router)
        self.subscriber.add(publisher.endpoint, pod="pod-a")
        self.prompts: list[list[int]] = []
        self.topics = [publisher.topic_of(t) for t in ("a", "b")] if per_tenant else [TOPIC]
        for _ in range(200):  # until the subscription has joined (ZMQ drops what comes before)
            publisher.cleared("a")
            publisher.flush()
            if self.subscriber.wait(publisher.topic_of("a"), 1, 0.05):
                break

    def put(self, tokens: list[int], tenant: str) -> None:
        kv = torch.full((1, 2, len(tokens), 1, 8), float(len(tokens)), dtype=torch.float16)
        self.store.store(np.array(tokens), kv, tenant=tenant)
        self.prompts.append(tokens)
        self.store.check()

    def settle(self) -> None:
        """Send what is queued (waiting out a resync's spacing) until the router has it all."""
        deadline = time.monotonic() + 10
        while True:
            self.publisher.flush()
            if self.publisher.stats()["unsynced_topics"] == 0:
                break
            assert time.monotonic() < deadline, self.publisher.stats()
            time.sleep(0.05)
        for topic in self.topics:
            sent = self.publisher.next_seq(topic)  # numbers from the store's start (µs)
            assert self.subscriber.wait(topic, sent, 10), f"{topic}: up to {sent} not seen"

    def check_router(self) -> None:
        """The router holds exactly what the store's snapshot tells of: per prompt, the same
        score; in all, the same blocks; no orphan met."""
        truth = PrefixIndex(BS)
        for entry in snapshot(self.store, None)["topics"]:
            truth.apply(entry["topic"], entry["events"])
        self.router.check()
        assert self.router.stats()["orphans"] == 0, self.router.stats()
        assert self.router.stats()["blocks"] == truth.stats()["blocks"]
        held = {pod: n for pod, n in self.router.pods().items() if n}  # heard of, holding none
        assert held == {pod: n for pod, n in truth.pods().items() if n}
        for tokens in self.prompts:
            assert self.router.score(tokens) == truth.score(tokens), tokens

    def puts(self, prompts: Iterable[tuple[list[int], str]]) -> None:
        for tokens, tenant in prompts:
            self.put(tokens, tenant)

    def overflow(self, limit: int, prompts: Iterable[tuple[list[int], str]]) -> None:
        """Store `prompts` (tokens, tenant) with the sender stalled and the queue `limit`
        events long: it fills."""
        observer = self.store.index.observer
        normal = self.publisher.queue_limit
        with self.publisher._sending:  # the sender waits on it: nothing leaves the queue
            self.publisher.queue_limit = observer.queue_limit = limit  # type: ignore[union-attr]
            try:
                self.puts(prompts)
            finally:
                self.publisher.queue_limit = observer.queue_limit = normal  # type: ignore[union-attr]

    def close(self) -> None:
        self.subscriber.close()
        self.store.close()


@pytest.fixture
def pod() -> Iterator[Pod]:
    p = Pod(per_tenant=False)
    yield p
    p.close()


def _mixed(
    rng: random.Random, heads: list[list[int]], n: int, tenants: str = "ab"
) -> Iterator[tuple[list[int], str]]:
    """`n` random prompts (`_prompts`), each of a tenant drawn from `tenants`."""
    for tokens in _prompts(rng, heads, n):
        yield tokens, rng.choice(tenants)


def _prompts(rng: random.Random, heads: list[list[int]], n: int) -> Iterator[list[int]]:
    for _ in range(n):
        head = rng.choice(heads)
        yield head[: BS * rng.randint(1, len(head) // BS)] + [
            rng.randrange(1000, 2000) for _ in range(BS * rng.randint(0, 3))
        ]


def test_a_router_without_a_snapshot_relearns_every_tenants_blocks_after_an_overflow(
    pod: Pod, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(1)
    heads = [[rng.randrange(100, 900) for _ in range(6 * BS)] for _ in range(4)]
    for tokens in _prompts(rng, heads, 12):
        pod.put(tokens, rng.choice("ab"))
    pod.settle()
    pod.check_router()
    assert pod.router.stats()["blocks"] > 0
    cleared = pod.router.stats()["cleared"]

    pod.overflow(4, _mixed(rng, heads, 20))  # demotions and evictions too: 24 gpu slots
    stats = pod.publisher.stats()
    assert stats["dropped_events"] > 0 and stats["unsynced_topics"] == 1
    pod.settle()
    stats = pod.publisher.stats()
    assert (stats["resyncs"], stats["unsynced_topics"]) == (1, 0)
    assert pod.router.stats()["cleared"] == cleared + 1  # one clear, then the whole topic
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.events"]
    assert len(lines) == 1 and f"{stats['dropped_events']} KV events lost" in lines[0]
    assert f"told the routers of {TOPIC} again" in lines[0]  # what an SRE reads in the log
    pod.check_router()
    # in step again: later edits chain to what the resync told
    for tokens in _prompts(rng, heads, 10):
        pod.put(tokens, rng.choice("ab"))
    pod.settle()
    pod.check_router()
    assert pod.publisher.stats()["resyncs"] == 1
    assert pod.store.status()["events"]["resyncs"] == 1  # the SRE sees it too


def test_overflows_closer_than_the_spacing_resync_once_the_spacing_has_passed(pod: Pod) -> None:
    rng = random.Random(2)
    heads = [[rng.randrange(100, 900) for _ in range(5 * BS)] for _ in range(3)]

    pod.overflow(3, _mixed(rng, heads, 8))
    pod.publisher.flush()
    assert pod.publisher.stats()["resyncs"] == 1
    started = time.monotonic()
    pod.overflow(3, _mixed(rng, heads, 8))
    pod.puts(_mixed(rng, heads, 5))  # queued while the lost topic waits: dropped unsent
    pod.publisher.flush()
    if time.monotonic() - started < RESYNC_MIN_S * 0.9:  # no second resync inside the spacing
        assert pod.publisher.stats()["resyncs"] == 1
        assert pod.publisher.stats()["unsynced_topics"] == 1
    pod.settle()
    assert pod.publisher.stats()["resyncs"] == 2
    pod.check_router()


def test_with_per_tenant_topics_only_the_lost_topic_is_told_again() -> None:
    pod = Pod(per_tenant=True)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)  # every message as sent, per topic
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(pod.publisher.endpoint)
    try:
        time.sleep(0.3)  # the raw subscription joins
        rng = random.Random(3)
        heads = [[rng.randrange(100, 900) for _ in range(4 * BS)] for _ in range(3)]
        for tokens in _prompts(rng, heads, 6):
            pod.put(tokens, "b")
        for tokens in _prompts(rng, heads, 4):
            pod.put(tokens, "a")
        pod.settle()

        a_topic, b_topic = pod.topics
        before = pod.publisher.next_seq(a_topic)
        pod.overflow(2, _mixed(rng, heads, 10, "a"))  # a's edits only: b's topic loses nothing
        pod.put(heads[0][:BS], "b")  # b's edits meanwhile reach b's routers as ever
        pod.settle()
        pod.check_router()
        clears: dict[str, list[int]] = {a_topic: [], b_topic: []}  # messages with a clear
        while raw.poll(500):
            topic, seq, payload = raw.recv_multipart()
            events = msgpack.unpackb(payload)[1]
            if any(e[0] == "AllBlocksCleared" for e in events):
                clears[topic.decode()].append(int.from_bytes(seq, "big"))
        assert [n for n in clears[a_topic] if n >= before] == [before]  # the resync's
        assert clears[b_topic] == [pod.publisher.first_seq]  # b's: its first message only
        assert pod.publisher.stats()["resyncs"] == 1
    finally:
        raw.close()
        ctx.destroy(linger=0)
        pod.close()


@pytest.mark.parametrize("seed", range(4))
def test_random_overflows_leave_the_router_equal_to_the_store(seed: int) -> None:
    """Random prompts of two tenants, some stored with the sender stalled and a queue of a few
    events (demotions and evictions included): after each settle, no orphan and the router
    holds exactly the store's blocks."""
    pod = Pod(per_tenant=False)
    rng = random.Random(seed)
    heads = [[rng.randrange(100, 900) for _ in range(rng.randint(2, 8) * BS)] for _ in range(5)]
    try:
        for _ in range(4):
            if rng.random() < 0.6:
                pod.overflow(rng.randint(1, 6), _mixed(rng, heads, rng.randint(1, 15)))
            pod.puts(_mixed(rng, heads, rng.randint(0, 8)))
            pod.settle()
            pod.check_router()
        assert pod.publisher.stats()["events"] > 0
    finally:
        pod.close()


class ClearIgnoring:
    """A router as llm-d's event pool was written (`pkg/kvevents/pool.go`: `AllBlocksCleared`
    is skipped): per (hash, medium), stored or removed, in the order the messages came."""

    def __init__(self) -> None:
        self.held: set[tuple[int, str]] = set()

    def apply(self, payload: bytes) -> None:
        for event in msgpack.unpackb(payload)[1]:
            if event[0] == "BlockStored":
                self.held |= {(h, event[6]) for h in event[1]}
            elif event[0] == "BlockRemoved":
                self.held -= {(h, event[2]) for h in event[1]}


def _held(payload: bytes) -> set[tuple[int, str]]:
    """(hash, medium) of every BlockStored of an event batch (a snapshot's)."""
    return {(h, e[6]) for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored" for h in e[1]}


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@pytest.mark.parametrize("seed", range(3))
def test_a_router_that_ignores_clears_ends_exact_too(seed: int) -> None:
    """llm-d skips `AllBlocksCleared`: after an overflow it would keep every block whose
    removal was lost. The resync sends the removals it lost (or dropped unsent) again before
    the blocks held, so such a router ends holding exactly what the store holds."""
    pod = Pod(per_tenant=False)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)
    raw.setsockopt(zmq.RCVHWM, 0)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(pod.publisher.endpoint)
    router = ClearIgnoring()
    rng = random.Random(seed)
    heads = [[rng.randrange(100, 900) for _ in range(rng.randint(2, 6) * BS)] for _ in range(5)]
    try:
        time.sleep(0.3)  # the raw subscription joins before anything is stored
        for _ in range(3):  # evictions too: 24 gpu slots
            pod.overflow(rng.randint(1, 4), _mixed(rng, heads, rng.randint(5, 15)))
            pod.puts(_mixed(rng, heads, rng.randint(0, 5)))
            pod.settle()
            while raw.poll(300):
                router.apply(raw.recv_multipart()[2])
            truth = snapshot(pod.store, None)["topics"]
            assert router.held == (_held(truth[0]["events"]) if truth else set())
        assert pod.publisher.stats()["resyncs"] >= 2
    finally:
        raw.close()
        ctx.destroy(linger=0)
        pod.close()
