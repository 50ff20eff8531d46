"""The order of KV events, as a router that chains blocks to their parents applies them.

A router keys a block by its tokens chained to its parent's key (llm-d does; so does
`kvtier.routing.PrefixIndex`, which skips a BlockStored whose parent hash the pod does not hold
as an orphan, its keys unknowable). The index never holds a block without its parent (prefix
closure), so in the order the edits happened every BlockStored finds its parent. The observer
joins an edit of one block into an entry queued earlier (`kvtier/events/observer.py`), which
moves the edit ahead of what was queued between: that must never make a parent missing when a
BlockStored is applied. Found by `kvtier replay --replicas 4 --route prefix` on Mooncake's
synthetic trace, whose router check failed with orphans: the host copies of a node's tail went a
block at a time from the end while flights wrote it to disk a run at a time, and the loss of the
host copy of the block before a run was joined into a loss queued ahead of that run's
BlockStored.

Each test applies what a real publisher sent, over ZMQ on loopback, to a real `PrefixIndex`: no
orphans, nothing skipped, and in the end every block the index holds is where the router thinks,
with its best medium's weight.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from kvtier.blocks import BlockHasher, encode_tokens
from kvtier.events import EventPublisher, EventSettings
from kvtier.events.observer import IndexEvents
from kvtier.index import BlockRef, RadixIndex
from kvtier.index.node import Node
from kvtier.routing import PrefixIndex
from kvtier.routing.index import DEFAULT_WEIGHTS

TOPIC = "kv@pod@m"
BT = 4
TIERS = ("gpu", "host", "disk")
MEDIA = ("GPU", "CPU", "DISK")
GPU, HOST, DISK = range(3)


class Published:
    """A bare index of three tiers whose observer queues events that are sent only at
    `deliver` (`flush_s` long: every join the observer may make, it makes), and a subscriber."""

    def __init__(self) -> None:
        self.hasher = BlockHasher()
        self.index = RadixIndex(TIERS, BT, self.hasher)
        settings = EventSettings(TOPIC, queue_limit=10**6, flush_s=1000.0)
        self.publisher = EventPublisher("tcp://127.0.0.1:0", settings=settings)
        self.index.observer = IndexEvents(self.publisher, self.index, lambda namespace: "t")
        self.ns = self.hasher.seed(b"\0" * 16, b"t")
        self.ctx: Any = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVTIMEO, 2000)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.publisher.endpoint)
        time.sleep(0.3)  # the subscription reaches the PUB before anything is sent
        self.router = PrefixIndex(BT)
        self.next_slot = [0, 0, 0]
        self.focus: Node | None = None  # the node `_step` edits most often

    def slots(self, tier: int, n: int) -> list[int]:
        first = self.next_slot[tier]
        self.next_slot[tier] += n
        return list(range(first, first + n))

    def insert(self, tokens: np.ndarray[Any, Any], tier: int) -> Node:
        key = encode_tokens(tokens)
        match = self.index.match(self.ns, key)
        new = len(tokens) // BT - match.num_blocks
        return self.index.insert(match, key, {tier: self.slots(tier, new)}).end

    def deliver(self) -> None:
        """Send what is queued and apply it, message by message, to the router."""
        self.publisher.flush()
        for seq in range(self.publisher.sent(TOPIC)):
            topic, number, payload = self.sub.recv_multipart()
            assert int.from_bytes(number, "big") == seq  # none lost on the way
            self.router.apply(topic.decode(), payload)
        stats = self.router.stats()
        assert stats["orphans"] == 0 and stats["bad"] == 0, stats

    def check_router(self) -> None:
        """Every block the index holds is held by the router, with its fastest copy's weight,
        and the router holds no other."""
        self.router.check()
        held, through = 0, dict[int, float]()  # node id -> the score of its whole path
        for node, tokens in self.nodes():
            expected = through.get(id(node.parent), 0.0)
            for i in range(node.size):
                if not node.copies(i):
                    break
                held += 1
                expected += BT * DEFAULT_WEIGHTS[MEDIA[node.fastest(i)]]
                score = self.router.score(tokens[: (i + 1) * BT + len(tokens) - node.size * BT])
                assert score == {"pod": pytest.approx(expected)}
            through[id(node)] = expected
        assert self.router.stats()["blocks"] == held == self.index.num_blocks

    def nodes(self) -> Iterator[tuple[Node, list[int]]]:
        """Every node, parents first, with its tokens from the root."""
        stack: list[tuple[Node, list[int]]] = [
            (child, []) for root in self.index.roots() for child in (root.children or {}).values()
        ]
        while stack:
            node, above = stack.pop()
            tokens = above + np.frombuffer(node.key, "<u4").tolist()
            yield node, tokens
            stack += [(child, tokens) for child in (node.children or {}).values()]

    def close(self) -> None:
        self.publisher.close()
        self.sub.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def published() -> Iterator[Published]:
    made = Published()
    try:
        yield made
    finally:
        made.close()


def test_a_host_copy_lost_after_a_flight_to_disk_is_not_told_before_that_flight(
    published: Published,
) -> None:
    """Six blocks on host. Block 5 demoted alone (disk gains it, host loses it); a flight
    writes blocks 2-4 to disk; host loses 4, 3, 2 from the end; a flight writes 0-1; host loses
    1. Joining the losses of 4..1 into the loss of 5 queued before the flights told the router
    that block 1 had no copy left before the BlockStored of 2-4, which chains to block 1."""
    index = published.index
    node = published.insert(np.arange(6 * BT), HOST)
    index.set_slot(BlockRef(node, 5), DISK, published.slots(DISK, 1)[0])
    index.clear_slot(BlockRef(node, 5), HOST)
    index.add_copies(node, DISK, 2, published.slots(DISK, 3))
    for i in (4, 3, 2):
        index.clear_slot(BlockRef(node, i), HOST)
    index.add_copies(node, DISK, 0, published.slots(DISK, 2))
    index.clear_slot(BlockRef(node, 1), HOST)
    index.check()
    published.deliver()
    published.check_router()


def _step(p: Published, rng: random.Random, heads: list[np.ndarray[Any, Any]]) -> None:
    """One edit of the kinds the store and the mover make, each allowed by prefix closure."""
    index = p.index
    nodes = [node for node, _ in p.nodes()]
    op = rng.choices(["insert", "flight", "demote", "lose", "tail", "promote", "drop"],
                     weights=[2, 4, 2, 6, 1, 2, 1])[0]  # fmt: skip
    if op == "insert" or not nodes:
        head = rng.choice(heads)
        start = rng.randrange(1_000_000, 2_000_000)
        tokens = np.concatenate([head, np.arange(start, start + rng.randint(1, 12) * BT)])
        match = index.match(p.ns, encode_tokens(tokens))
        end = match.end
        tier = HOST if end.parent is None else max(HOST, end.fastest_last())
        p.insert(tokens, tier)
        return
    node = p.focus if p.focus in nodes and rng.random() < 0.8 else rng.choice(nodes)
    p.focus = node  # the mover works on a node's tail for a while: its edits meet in the queue
    disk = node.slots[DISK]
    if op == "flight":  # the last blocks without a disk copy written there at once, as a
        # flight of the mover does: a node's tail goes down in runs, from the end
        free = [i for i in range(node.size) if disk[i] is None and node.fastest(i) < DISK]
        if free:
            hi = max(free) + 1
            lo = hi - 1
            while lo and lo - 1 in free and hi - lo < rng.randint(1, 6):
                lo -= 1
            if node.depth[DISK - 1] >= hi:
                index.add_copies(node, DISK, lo, p.slots(DISK, hi - lo))
    elif op == "demote":  # one block written to disk (the mover's per-block path)
        free = [i for i in range(node.size) if disk[i] is None and node.fastest(i) < DISK]
        if free:
            index.set_slot(BlockRef(node, max(free)), DISK, p.slots(DISK, 1)[0])
    elif op == "lose":  # copies lost from the end of their run, as the mover's eviction does
        tier = rng.choice([GPU, HOST])
        for _ in range(rng.randint(1, 4)):
            held = [i for i in range(node.size) if node.slots[tier][i] is not None]
            if not held or not index.can_clear(BlockRef(node, held[-1]), tier):
                break
            index.clear_slot(BlockRef(node, held[-1]), tier)
    elif op == "promote":  # the next block onto gpu, as a prefetch does, in order
        i = next((i for i in range(node.size) if node.slots[GPU][i] is None), None)
        if i is not None:
            assert node.parent is not None
            before = node.fastest(i - 1) if i else node.parent.fastest_last()
            if before == GPU:
                index.set_slot(BlockRef(node, i), GPU, p.slots(GPU, 1)[0])
    elif op == "tail":  # host copies of a node's tail lost in one edit (bulk eviction)
        n = node.depth[HOST] - node.depth[GPU]
        if n:
            index.clear_tail(node, HOST, rng.randint(1, n))
    elif op == "drop" and not node.children:  # a leaf's tail dropped from every tier
        index.drop_tail(node, rng.randint(1, node.size))


@pytest.mark.parametrize("seed", range(8))
def test_random_edits_never_tell_a_router_of_an_orphan(published: Published, seed: int) -> None:
    rng = random.Random(seed)
    heads = [np.arange(k * 10_000, k * 10_000 + rng.randint(1, 3) * BT) for k in range(3)]
    for _ in range(1500):
        _step(published, rng, heads)
    published.index.check()
    published.deliver()
    published.check_router()
