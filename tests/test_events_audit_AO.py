"""Audit AO of KV events and cache-aware routing (issue 16): a router's scores wait for a few
milliseconds of the index's lock, whatever the events a pod sends, and a source's cache of media
weights is bounded.

- F1: a message's events were applied 256 events a hold of the index's lock, each event whole:
  one BlockStored of an 8 MiB message (94,244 blocks, a kvtier store's long prompt or a hostile
  pod) held it 0.73 s, 98 events of 2,048 blocks 0.96 s, and one BlockRemoved of a store's
  eviction burst as long; every `score` (every request the gateway routes) waited. Now runs of
  `runs.APPLY_BLOCKS` blocks, a long event cut in pieces chained as a publisher cuts one.
- F2: a snapshot (`reset`, a subscriber's resync, periodic with `resync_s`) was applied in one
  hold: 1.3 s of scores waiting for 200,000 blocks. Now built outside the lock and put in place
  in one hold (about 0.5 us a block it forgets and puts in place), keeping what fits the room
  the pod's other topics leave, as it did in place.
- F3: the weights a source kept per media mask were never bounded (16 media: 65,536 masks per
  topic, 4,096 topics a publisher): now `MAX_WEIGHTS` per source.

The truth is a fresh `PrefixIndex` fed the same blocks in small events.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import zmq
from conftest import wait_until

import kvtier.routing.index
from kvtier.events import wire
from kvtier.routing import PrefixIndex, Subscriber

try:  # a module of its own since this audit
    from kvtier.routing.runs import APPLY_BLOCKS
except ImportError:  # pragma: no cover - the code before it, which each test fails on
    APPLY_BLOCKS = 1024

BS = 4
TOPIC = "kv@pod-a@m"


def _stored(first: int, count: int, parent: int | None, medium: str = "GPU") -> bytes:
    """A BlockStored of blocks `first`..`first + count - 1` (hash i + 1 for block i, block i's
    tokens i * BS ...), as a kvtier publisher packs it."""
    tokens = np.arange(first * BS, (first + count) * BS, dtype="<u4").tobytes()
    hashes = np.arange(first + 1, first + count + 1, dtype=">u8").tobytes()
    return wire.stored(wire.stored_body(hashes, parent, tokens, BS), medium)


def _removed(hashes: list[int], medium: str = "GPU") -> bytes:
    packed = np.array(hashes, dtype=">u8").tobytes()
    return wire.removed_tagged([wire.tagged_u64(packed)], len(hashes), medium)


def _batch(events: list[bytes]) -> bytes:
    return wire.batch(0.0, events, None)


def _prompt(blocks: int) -> list[int]:
    return list(range(blocks * BS))


class Holds:
    """Stands in for an index's lock, recording how many hashes of `pod-a` each hold of it
    added or took away (the index's work under it, whatever the machine's load)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index, self.lock = index, index._lock
        self.changed: list[int] = []
        self.at = 0
        index._lock = self  # type: ignore[assignment]

    def blocks(self) -> int:
        return self.index._blocks.get("pod-a", 0)

    def __enter__(self) -> None:
        self.lock.acquire()
        self.at = self.blocks()

    def __exit__(self, *exc: object) -> None:
        self.changed.append(abs(self.blocks() - self.at))
        self.lock.release()


def test_a_score_waits_for_a_run_of_blocks_not_for_one_long_event() -> None:
    index = PrefixIndex(BS)
    holds = Holds(index)
    n = 5 * APPLY_BLOCKS + 7
    index.apply(TOPIC, _batch([_stored(0, n, None)]))
    assert sum(holds.changed) == n and max(holds.changed) <= APPLY_BLOCKS, holds.changed
    index.check()
    assert index.score(_prompt(n)) == {"pod-a": float(n * BS)}
    assert index.stats()["events"] == 1 and index.stats()["bad"] == 0

    # many events of a few hundred blocks (a store's prompts): runs of blocks too
    holds.changed.clear()
    index.apply(TOPIC, _batch([_stored(a, 300, a) for a in range(n, n + 3000, 300)]))
    assert sum(holds.changed) == 3000 and max(holds.changed) <= APPLY_BLOCKS, holds.changed

    # the eviction of them all, one BlockRemoved: the same
    holds.changed.clear()
    index.apply(TOPIC, _batch([_removed(list(range(1, n + 3001)))]))
    assert sum(holds.changed) == n + 3000 and max(holds.changed) <= APPLY_BLOCKS
    index.check()
    assert index.score(_prompt(n)) == {} and index.pods() == {"pod-a": 0}


def test_a_snapshot_is_built_outside_the_lock_and_put_in_place_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    index = PrefixIndex(BS)
    index.apply(TOPIC, _batch([_stored(0, 8, None)]))
    locked: list[bool] = []  # per block key computed: was the index's lock held?
    keys = kvtier.routing.index.chain  # type: ignore[attr-defined]

    def chain(previous: bytes, data: bytes, block_size: int) -> Iterator[bytes]:
        for key in keys(previous, data, block_size):
            locked.append(index._lock.locked())
            yield key

    monkeypatch.setattr(kvtier.routing.index, "chain", chain)
    n = 4 * APPLY_BLOCKS
    snapshot = _batch([_stored(a, 512, a or None) for a in range(0, n, 512)])
    assert index.reset(TOPIC, snapshot) == n // 512
    assert len(locked) == n and not any(locked)  # every key computed outside it
    monkeypatch.undo()
    index.check()
    assert index.score(_prompt(n)) == {"pod-a": float(n * BS)}
    assert index.pods() == {"pod-a": n} and index.stats()["blocks"] == n
    # in step with the publisher after it: a child of the snapshot's last block, then a removal
    index.apply(TOPIC, _batch([_stored(n, 2, n), _removed([n + 2])]))
    index.check()
    assert index.score(_prompt(n + 2)) == {"pod-a": float((n + 1) * BS)}
    assert index.stats()["orphans"] == 0
    # a snapshot past the pod's bound with its other topic: kept in order until full, as it
    # was applied in place (review: it was refused whole, the topic blanked)
    small = PrefixIndex(BS, max_blocks=n + 4)
    small.apply(TOPIC + "@t", _batch([_stored(0, 8, None)]))
    assert small.reset(TOPIC, snapshot) == n // 512 - 1
    small.check()
    assert small.pods() == {"pod-a": 8 + n - 512} and small.stats()["full"] == 1
    assert small.score(_prompt(n), tenant="x") == {"pod-a": float((n - 512) * BS)}


def test_a_long_event_cut_in_pieces_is_learnt_as_whole_and_refused_as_whole() -> None:
    n = 2 * APPLY_BLOCKS + 100
    cut, truth = PrefixIndex(BS), PrefixIndex(BS)
    cut.apply(TOPIC, _batch([_stored(0, n, None, "CPU"), _removed([5, 6], "CPU")]))
    truth.apply(
        TOPIC, _batch([_stored(a, min(100, n - a), a or None, "CPU") for a in range(0, n, 100)])
    )
    truth.apply(TOPIC, _batch([_removed([5, 6], "CPU")]))
    for index in (cut, truth):
        index.check()
    assert cut.pods() == truth.pods() == {"pod-a": n - 2}
    for blocks in (1, 4, 5, n):
        assert cut.score(_prompt(blocks)) == truth.score(_prompt(blocks))
    assert cut.stats()["events"] == 2 and cut.stats()["bad"] == 0  # events, not pieces

    # a token id out of range in its last block: nothing of it is held, one event counted bad
    index = PrefixIndex(BS)
    tokens = _prompt(n)
    tokens[-1] = 1 << 32
    bad = ["BlockStored", list(range(1, n + 1)), None, tokens, BS, None, "GPU", None]
    index.apply(TOPIC, wire.batch(0.0, [msgpack.packb(bad)], None))
    index.check()
    assert index.pods() == {"pod-a": 0} and index.score(_prompt(1)) == {}
    assert index.stats()["bad"] == 1 and index.stats()["orphans"] == 0

    # a pod full past its first piece keeps that piece: its other pieces are skipped, no orphan
    index = PrefixIndex(BS, max_blocks=APPLY_BLOCKS + 10)
    index.apply(TOPIC, _batch([_stored(0, n, None)]))
    index.check()
    assert index.pods() == {"pod-a": APPLY_BLOCKS}
    assert (index.stats()["full"], index.stats()["bad"], index.stats()["orphans"]) == (1, 1, 0)


def test_a_sources_weights_per_media_mask_stay_bounded() -> None:
    n, media = 4096, [f"M{i}" for i in range(12)]
    index = PrefixIndex(BS)
    # every block in 12 media, then block i keeps the media of the bits of i % 4095 + 1: one
    # prompt meets 4,095 masks of one source
    index.apply(TOPIC, _batch([_stored(0, n, None, medium) for medium in media]))
    masks = [i % 4095 + 1 for i in range(n)]
    removals = [
        _removed([i + 1 for i in range(n) if not masks[i] >> bit & 1], medium)
        for bit, medium in enumerate(media)
    ]
    index.apply(TOPIC, _batch(removals))
    index.check()
    prompt = _prompt(n)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        scores = index.score(prompt)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert set(scores) == {"pod-a"} and scores["pod-a"] > (n - 1) * BS * 0.98
    assert grown < 100_000, f"one score kept {grown:,} bytes of weights"


def _heard_then_removed(context: zmq.Context[zmq.Socket[bytes]], sub: Subscriber) -> None:
    """8 pods added, each heard telling of 2 blocks, then removed."""
    pubs = []
    for i in range(8):
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.add(f"tcp://127.0.0.1:{port}", pod=f"pod-{i}")
        pubs.append(pub)
    message = _batch([_stored(0, 2, None)])

    def heard() -> bool:
        for i, pub in enumerate(pubs):
            if not sub.applied(f"kv@pod-{i}@m"):
                pub.send_multipart([f"kv@pod-{i}@m".encode(), bytes(8), message])
        return all(sub.applied(f"kv@pod-{i}@m") for i in range(8))

    try:
        assert wait_until(heard)
        assert sub.index.pods() == {f"pod-{i}": 2 for i in range(8)}  # type: ignore[attr-defined]
        for i in range(8):
            sub.remove(f"pod-{i}")
        assert wait_until(lambda: not any(sub.index.pods().values()))  # type: ignore[attr-defined]
    finally:
        for pub in pubs:
            pub.close()


def test_a_removed_pod_leaves_nothing_in_the_index() -> None:
    """F4: `remove(pod)` cleared each topic of the pod, but the index kept each source, empty,
    and `pods()` named the pod (0 blocks) for good: a router whose pods churn (each rescheduled
    pod a new name) grew without end."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    index = PrefixIndex(BS)
    sub = Subscriber(index)
    try:
        for _ in range(2):  # removed, then added again (at another address): the same
            _heard_then_removed(context, sub)
            index.check()
            assert index.pods() == {} and index.stats()["sources"] == 0
            assert index.score(_prompt(2)) == {}
    finally:
        sub.close()
        context.destroy(linger=0)


def test_a_snapshot_at_a_full_pod_keeps_what_fits_and_is_refused_whole_if_others_grew() -> None:
    """Review of AO: `reset` refused a snapshot whole when it would take its pod past
    `max_blocks` with the pod's other topics, and forgot the topic: a resync near the bound
    blanked what applying it in place (as before the audit) mostly kept."""
    index = PrefixIndex(BS, max_blocks=100)
    index.apply(TOPIC + "@t1", _batch([_stored(0, 60, None)]))
    index.apply(TOPIC + "@t2", _batch([_stored(1000, 40, None)]))
    resync = _batch([_stored(a, 10, a or None) for a in range(0, 70, 10)])  # t1 grew to 70
    assert index.reset(TOPIC + "@t1", resync) == 6  # 60 fit beside t2's 40
    index.check()
    assert index.pods() == {"pod-a": 100} and index.stats()["full"] == 1
    assert index.score(_prompt(70), tenant="t1") == {"pod-a": 60.0 * BS}
    # the other topics fill the pod: its first block is full, the rest orphans, as in place
    assert index.reset(TOPIC + "@t3", resync) == 0
    index.check()
    assert (index.stats()["full"], index.stats()["orphans"]) == (2, 6)
    assert index.pods() == {"pod-a": 100}

    # t2 grows while t1's snapshot is built (after the room was read): refused whole
    index.clear(TOPIC + "@t3")
    index.clear(TOPIC + "@t1")
    index.apply(TOPIC + "@t2", _batch([_removed(list(range(1021, 1041)))]))  # t2: 20 left
    grow = _GrowAfterRead(index, TOPIC + "@t2", _batch([_stored(1020, 30, 1020)]))
    assert index.reset(TOPIC + "@t1", resync) == 0 and grow.grown
    index.check()
    assert index.pods() == {"pod-a": 50} and index.stats()["full"] == 3
    assert index.score(_prompt(1), tenant="t1") == {}


class _GrowAfterRead:
    """Stands in for an index's lock: once its first hold ends, applies `payload` to `topic`
    (another topic of the pod, heard while a snapshot is built outside the lock)."""

    def __init__(self, index: PrefixIndex, topic: str, payload: bytes) -> None:
        self.index, self.lock, self.topic, self.payload = index, index._lock, topic, payload
        self.grown = False
        index._lock = self  # type: ignore[assignment]

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if not self.grown:
            self.grown = True
            self.index.apply(self.topic, self.payload)


def test_a_long_removal_with_a_bad_hash_is_refused_whole_and_counted_once() -> None:
    """Review of AO: a BlockRemoved of more than `APPLY_BLOCKS` hashes, one of them not a hash,
    was cut and its pieces before the bad one applied (before: skipped whole, counted `bad`);
    and an event cut in pieces whose later piece was refused counted both applied and `bad`."""
    n = 3 * APPLY_BLOCKS
    index = PrefixIndex(BS)
    index.apply(TOPIC, _batch([_stored(0, n, None)]))
    hashes: list[object] = list(range(n, 0, -1))
    hashes[-5] = "junk"
    removal = msgpack.packb(["BlockRemoved", hashes, "GPU"])
    assert index.apply(TOPIC, wire.batch(0.0, [removal], None)) == 0
    index.check()
    assert index.pods() == {"pod-a": n} and index.score(_prompt(n)) == {"pod-a": float(n * BS)}
    assert (index.stats()["events"], index.stats()["bad"]) == (1, 1)

    # a pod full past the first piece of a BlockStored: the piece is kept, the event is bad only
    full = PrefixIndex(BS, max_blocks=APPLY_BLOCKS + 10)
    assert full.apply(TOPIC, _batch([_stored(0, 2 * APPLY_BLOCKS, None)])) == 0
    full.check()
    assert full.pods() == {"pod-a": APPLY_BLOCKS}
    assert {k: full.stats()[k] for k in ("events", "bad", "full")} == {
        "events": 0,
        "bad": 1,
        "full": 1,
    }


class _Unscanned(dict):  # type: ignore[type-arg]
    def values(self):  # type: ignore[no-untyped-def]
        raise AssertionError("clear() went through every source")


def test_clearing_a_topic_does_not_go_through_every_source() -> None:
    """Review of AO: `clear` looked through every source for another of the pod (a pod of
    1,000 topics removed among 40 such: 1.44 s of the lock, from 0.002 s); a count of each
    pod's sources tells."""
    index = PrefixIndex(BS)
    for pod in ("pod-a", "pod-b"):
        for tenant in ("t1", "t2"):
            index.apply(f"kv@{pod}@m@{tenant}", _batch([_stored(0, 2, None)]))
    sources = index._sources
    index._sources = _Unscanned(sources)
    index.clear("kv@pod-a@m@t1")
    index.clear("kv@pod-a@m@t1")  # a topic forgotten already: nothing
    index._sources = dict(index._sources)
    assert index.pods() == {"pod-a": 2, "pod-b": 4}
    index._sources = _Unscanned(index._sources)
    index.clear("kv@pod-a@m@t2")
    index._sources = dict(index._sources)
    index.check()
    assert index.pods() == {"pod-b": 4} and index.stats()["sources"] == 2
    assert index.score(_prompt(2)) == {"pod-b": 2.0 * BS}


def test_cleared_counts_the_clears_of_topics_heard_of_since_their_last_clear() -> None:
    """Review of AO: `clear` forgets its topic (F4), so `stats()["cleared"]` no longer counts a
    second clear of it, nor the snapshot after it, as it did of a topic kept empty (README)."""
    index = PrefixIndex(BS)
    index.apply(TOPIC, _batch([_stored(0, 2, None)]))
    index.clear(TOPIC)
    index.clear(TOPIC)
    assert index.stats()["cleared"] == 1
    index.reset(TOPIC, _batch([_stored(0, 2, None)]))  # heard of again: nothing to clear
    assert index.stats()["cleared"] == 1
    index.reset(TOPIC, _batch([_stored(0, 2, None)]))
    index.apply(TOPIC, _batch([msgpack.packb(["AllBlocksCleared"])]))
    assert index.stats()["cleared"] == 3 and index.pods() == {"pod-a": 0}
