"""The router against publishers, replay endpoints and snapshots it does not trust: whatever
one pod's publisher sends, other pods' scores stay as their own publishers told them, the
subscriber's thread goes on, and what one publisher can make the router hold is bounded.
Hostile publishers are plain ZMQ sockets written here (the attacker); the router is real."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
from conftest import wait_until
from test_routing import BS, PROMPT, batch, removed, stored

from kvtier.routing import PrefixIndex, Subscriber

A, B = "kv@pod-a@m", "kv@pod-b@m"


class Pub:
    """A bare PUB socket sending whatever frames it is given."""

    def __init__(self, ctx: Any) -> None:
        self.socket = ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def send(self, topic: str, seq: int, payload: bytes) -> None:
        self.socket.send_multipart([topic.encode(), seq.to_bytes(8, "big"), payload])


def joined(sub: Subscriber, pubs: list[Pub], topics: list[str]) -> dict[str, int]:
    """Wait until `sub` takes messages of each pub: each sends message 0 of its topic (an empty
    batch) until it is applied, then message 1. Once that is applied, every repeat of message 0
    (a restart, to the subscriber) has been taken too: the stats returned are those the test
    starts from, and each topic's next message is number 2."""

    def heard() -> bool:
        for pub, topic in zip(pubs, topics, strict=True):
            if not sub.applied(topic):
                pub.send(topic, 0, batch())
        return all(sub.applied(topic) for topic in topics)

    assert wait_until(heard)
    for pub, topic in zip(pubs, topics, strict=True):
        pub.send(topic, 1, batch())
    assert all(sub.wait(topic, 2) for topic in topics)
    return sub.stats()


def since(sub: Subscriber, start: dict[str, int]) -> dict[str, int]:
    """`sub`'s counts since `start`."""
    return {name: n - start[name] for name, n in sub.stats().items()}


# ---- one pod's publisher speaks for another ---------------------------------------------


def test_a_publisher_cannot_clear_restart_or_add_to_another_pods_blocks(
    ctx: Any, closing: Any
) -> None:
    honest, hostile = Pub(ctx), Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index))
    sub.add(honest.endpoint)
    sub.add(hostile.endpoint)
    start = joined(sub, [honest, hostile], [B, A])
    honest.send(B, 2, batch(stored([1, 2], None, PROMPT[:8])))
    assert sub.wait(B, 3)
    assert index.score(PROMPT) == {"pod-b": 8.0}
    # pod a's publisher, on pod b's topic: a clear in sequence, a "restart" (number 0), and
    # on a topic of its own naming pod b, blocks pod b never held
    hostile.send(B, 3, batch(["AllBlocksCleared"]))
    hostile.send(B, 0, batch(removed([1])))
    hostile.send("kv@pod-b@other", 0, batch(stored([7, 8, 9, 10], None, PROMPT)))
    hostile.send(A, 2, batch(stored([5], None, PROMPT[:4])))  # its own: taken
    assert sub.wait(A, 3)
    assert index.score(PROMPT) == {"pod-a": 4.0, "pod-b": 8.0}
    counts = since(sub, start)
    assert counts["refused"] == 3 and counts["resets"] == 0 and sub.applied(B) == 3
    index.check()


def test_a_pod_named_when_its_publisher_is_added_cannot_be_taken_by_one_heard_first(
    ctx: Any, closing: Any
) -> None:
    """First come wins a pod nobody named; a router that names each publisher's pod at `add`
    is not at the mercy of which publisher it hears first."""
    hostile, honest = Pub(ctx), Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index))
    sub.add(hostile.endpoint, pod="pod-a")  # it may speak for pod a only
    sub.add(honest.endpoint, pod="pod-b")
    with pytest.raises(ValueError, match="pod-b"):
        sub.add(Pub(ctx).endpoint, pod="pod-b")
    for _ in range(20):  # the hostile one speaks first, as pod b, again and again
        hostile.send(B, 0, batch(stored([7, 8], None, PROMPT[:8])))
        time.sleep(0.01)
    start = joined(sub, [honest, hostile], [B, A])
    honest.send(B, 2, batch(stored([1, 2], None, PROMPT[:8])))
    assert sub.wait(B, 3)
    assert index.score(PROMPT) == {"pod-b": 8.0}
    hostile.send(B, 3, batch(["AllBlocksCleared"]))
    hostile.send(A, 2, batch(stored([5], None, PROMPT[:4])))
    assert sub.wait(A, 3)
    assert index.score(PROMPT) == {"pod-a": 4.0, "pod-b": 8.0}
    assert since(sub, start)["refused"] == 1
    index.check()


def test_a_snapshot_cannot_replace_another_pods_blocks(ctx: Any, closing: Any) -> None:
    """A sidecar's `/v1/blocks` naming another pod's topic: that topic is refused, its own
    is taken."""
    honest, hostile = Pub(ctx), Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index))

    def snapshot() -> dict[str, Any]:  # the hostile sidecar's answer
        topics = [
            {"topic": B, "seq": 2**62, "events": batch()},  # wipe b, and skip all it says
            {"topic": A, "seq": 5, "events": batch(stored([5], None, PROMPT[:4]))},
        ]
        return {"block_size": BS, "topics": topics}

    sub.add(honest.endpoint)
    sub.add(hostile.endpoint, None, snapshot)
    joined(sub, [honest, hostile], [B, A])
    honest.send(B, 2, batch(stored([1, 2], None, PROMPT[:8])))
    assert sub.wait(B, 3)
    hostile.send(A, 5, batch())  # a gap: no replay endpoint, so the snapshot is asked for
    assert sub.wait(A, 6)
    honest.send(B, 3, batch(stored([3], 2, PROMPT[8:12])))
    assert sub.wait(B, 4)
    assert index.score(PROMPT) == {"pod-a": 4.0, "pod-b": 12.0}
    assert sub.stats()["refused"] == 1 and sub.stats()["resyncs"] == 1
    index.check()


def test_media_named_by_one_pod_do_not_use_up_the_media_of_another() -> None:
    index = PrefixIndex(BS)
    bogus = [stored([n], None, PROMPT[:4], f"M{n}") for n in range(40)]
    index.apply(A, batch(*bogus))  # past the media one source may name: the rest refused
    index.apply(B, batch(stored([1], None, PROMPT[:4], "CPU")))
    assert index.score(PROMPT) == {"pod-a": 4.0, "pod-b": 4 * 0.99}
    index.check()


# ---- bounds ---------------------------------------------------------------------------


def test_a_pod_holds_at_most_max_blocks_and_a_store_past_them_is_refused_whole() -> None:
    index = PrefixIndex(BS, max_blocks=4)
    prompt = list(range(24))  # 6 blocks
    index.apply(B, batch(stored([1], None, prompt[:4])))
    # pod a: 3 blocks, then a store of 2 more (past 4: refused whole), then 1 more (taken)
    assert index.apply(A, batch(stored([11, 12, 13], None, prompt[:12]))) == 1
    assert index.apply(A, batch(stored([14, 15], 13, prompt[12:20]))) == 0
    assert index.apply(A, batch(stored([14], 13, prompt[12:16]))) == 1
    assert index.stats()["full"] == 1
    # the same blocks again, in another medium: no more blocks, taken; another topic of the
    # same pod counts against the same bound
    assert index.apply(A, batch(stored([11, 12], None, prompt[:8], "CPU"))) == 1
    assert index.apply(A + "@tenant", batch(stored([21], None, prompt[:4]))) == 0
    assert index.score(prompt) == {"pod-a": 16.0, "pod-b": 4.0}
    assert index.pods() == {"pod-a": 4, "pod-b": 1}
    index.apply(A, batch(removed([14])))  # room again
    assert index.apply(A + "@tenant", batch(stored([21], None, prompt[:4]))) == 1
    index.check()
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(BS, max_blocks=0)


def test_a_publisher_holds_at_most_max_topics_each_named_in_at_most_256_chars(
    ctx: Any, closing: Any
) -> None:
    hostile = Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index, max_topics=3))
    sub.add(hostile.endpoint)
    joined(sub, [hostile], [A])
    long = A + "@" + "x" * 300
    hostile.send(long, 0, batch(stored([1], None, PROMPT[:4])))
    for n in range(5):  # t0, t1 taken (3 topics in all), t2, t3, t4 refused
        hostile.send(f"{A}@t{n}", 0, batch(stored([1], None, PROMPT[:4])))
    assert wait_until(lambda: sub.stats()["refused"] == 4)
    assert index.stats()["sources"] == 3 and index.score(PROMPT) == {"pod-a": 4.0}
    assert sub.applied(long) == 0 and sub.applied(f"{A}@t2") == 0
    hostile.send(A, 2, batch(stored([2], None, PROMPT[4:8])))  # a known topic still is
    assert sub.wait(A, 3)


# ---- what a pod's own publisher says: counted, kept to itself ----------------------------


def test_tokens_announced_again_under_another_hash_keep_the_index_whole() -> None:
    """vLLM hashes the same tokens differently under another cache salt (and a kvtier topic
    shared by tenants, under another namespace): one key, two hashes, both live. The key is
    held while either is (`kvtier/routing/index.py`, "One key, several hashes")."""
    index = PrefixIndex(BS)
    index.apply(A, batch(stored([1, 2], None, PROMPT[:8])))
    index.apply(A, batch(stored([3], None, PROMPT[:4])))  # block 0 again, another hash
    index.check()
    index.apply(A, batch(removed([3])))
    index.check()
    assert index.score(PROMPT) == {"pod-a": 8.0}  # hash 1 still holds block 0
    index.apply(A, batch(removed([1])))
    index.check()
    assert index.score(PROMPT) == {}  # its block 0 is gone; block 1 stays, past a hole
    assert index.pods() == {"pod-a": 1}


@pytest.mark.parametrize(
    "frames",
    [
        [A.encode(), (2).to_bytes(8, "big")],  # no payload
        [A.encode(), (2).to_bytes(8, "big"), batch(), b""],  # a fourth frame
        [A.encode(), (2).to_bytes(7, "big"), batch()],  # a short number
        [b"\xff\xfe", (2).to_bytes(8, "big"), batch()],  # a topic that is no UTF-8
    ],
    ids=["2 frames", "4 frames", "7-byte number", "binary topic"],
)
def test_a_message_of_another_shape_is_counted_and_changes_nothing(
    ctx: Any, closing: Any, frames: list[bytes]
) -> None:
    hostile = Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index))
    sub.add(hostile.endpoint)
    start = joined(sub, [hostile], [A])
    hostile.socket.send_multipart(frames)
    hostile.send(A, 2, batch(stored([1], None, PROMPT[:4])))
    assert sub.wait(A, 3)
    counts = since(sub, start)
    assert counts["bad"] == 1 and counts["gaps"] == 0 and counts["resets"] == 0
    assert index.score(PROMPT) == {"pod-a": 4.0} and index.stats()["sources"] == 1


def test_a_message_of_many_frames_passes_zmqs_bound_and_is_only_counted(
    ctx: Any, closing: Any
) -> None:
    """ZMQ's MAXMSGSIZE bounds each frame, not a message: 32 frames of 512 KiB reach a
    subscriber that takes 1 MiB (buffered whole by ZMQ first; libzmq has no bound on the
    frames of one message), and can only be counted."""
    hostile = Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index, max_message_bytes=1 << 20))
    sub.add(hostile.endpoint)
    joined(sub, [hostile], [A])
    hostile.socket.send_multipart([A.encode()] + [b"x" * (1 << 19)] * 32)
    hostile.send(A, 2, batch(stored([1], None, PROMPT[:4])))
    assert sub.wait(A, 3)
    assert sub.stats()["bad"] == 1  # it came through whole; counted, not applied


# ---- recovery that never ends --------------------------------------------------------------


class SilentReplay:
    """A replay ROUTER that takes requests and never answers them."""

    def __init__(self, ctx: Any) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.requests = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(10):
                self.router.recv_multipart()
                self.requests += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.router.close()


def test_a_publisher_whose_replays_never_answer_does_not_starve_the_others(
    ctx: Any, closing: Any
) -> None:
    """Every message of the hostile publisher shows a gap, and its replay endpoint lets each
    request run to `replay_timeout`: its replays are rationed, so the honest publisher's
    messages are still taken within a few timeouts, not after one timeout per hostile message."""
    honest, hostile, replay = Pub(ctx), Pub(ctx), closing(SilentReplay(ctx))
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index, replay_timeout=0.3))
    sub.add(honest.endpoint)
    sub.add(hostile.endpoint, replay.endpoint)
    start = joined(sub, [honest, hostile], [B, A])
    for n in range(1, 21):  # gaps all: 20 replays of 0.3 s had each been asked
        hostile.send(A, 2 + 2 * n, batch())
    time.sleep(0.05)
    started = time.monotonic()
    honest.send(B, 2, batch(stored([1], None, PROMPT[:4])))
    assert sub.wait(B, 3, timeout=10)
    assert time.monotonic() - started < 1.5
    assert sub.wait(A, 43, timeout=10)
    assert 1 <= replay.requests <= 3 and since(sub, start)["resets"] == 20


@pytest.mark.parametrize(
    "topics",
    [
        [{"topic": A, "seq": -1, "events": batch()}],  # a number no replay can ask from
        [{"topic": A, "seq": "5", "events": batch()}],
    ],
    ids=["negative seq", "text seq"],
)
def test_a_snapshot_of_another_shape_is_counted_and_the_gap_forgotten(
    ctx: Any, closing: Any, topics: Any
) -> None:
    """Whatever callable answers for `/v1/blocks`, its answer is checked as the client checks
    one: a shape the subscriber cannot use is a resync error, not the end of its thread."""
    hostile, replay = Pub(ctx), closing(SilentReplay(ctx))
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index, replay_timeout=0.2))
    sub.add(hostile.endpoint, replay.endpoint, lambda: {"block_size": BS, "topics": topics})
    start = joined(sub, [hostile], [A])
    hostile.send(A, 5, batch(stored([1], None, PROMPT[:4])))  # a gap: replay, then snapshot
    hostile.send(A, 6, batch(stored([2], 1, PROMPT[4:8])))
    assert sub.wait(A, 7)
    counts = since(sub, start)
    assert counts["resync_errors"] == 1 and counts["resets"] == 1 and counts["resyncs"] == 0
    assert index.score(PROMPT) == {"pod-a": 8.0}


# ---- anything at all -----------------------------------------------------------------------


def junk(rng: Any, depth: int = 0) -> Any:
    """A random msgpack value, often of a shape the wire format uses."""
    choices: list[Any] = [None, True, -1, 0, 2**64 - 1, 2**63, 1.5, "GPU", "", b"\x00" * 9, [], {}]
    if depth < 3 and rng.random() < 0.4:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 9))]
    return rng.choice(choices)


def event(rng: Any) -> list[Any]:
    """A random event of hashes 0..5 and tokens 0, 1 (so that blocks meet), one field in three
    of them replaced by junk."""
    kind = rng.choices(["BlockStored", "BlockRemoved", "AllBlocksCleared"], [6, 3, 1])[0]
    hashes = [rng.randrange(6) for _ in range(rng.randrange(1, 3))]
    medium = rng.choice(["GPU", "CPU"])
    found: list[Any] = [kind]
    if kind == "BlockStored":
        tokens = [rng.randrange(2) for _ in range(BS * len(hashes))]
        found += [hashes, rng.choice([None, *range(6)]), tokens, BS, None, medium, None]
    elif kind == "BlockRemoved":
        found += [hashes, medium]
    if rng.random() < 0.3:
        found[rng.randrange(len(found))] = junk(rng)
    return found


def test_random_events_are_applied_or_refused_and_never_break_the_index() -> None:
    import random

    rng = random.Random(7)
    index = PrefixIndex(BS)
    for _ in range(3000):
        index.apply(rng.choice([A, B]), msgpack.packb([0.0, [event(rng)], None]))
        index.check()
    assert index.stats()["bad"] > 0 and index.stats()["events"] > 0
