"""Audit BG: the router's decode bounds against what kvtier itself sends, and a refused message
that begins with AllBlocksCleared.

- A sidecar's `GET /v1/blocks` is one event batch per topic, each node's run in each tier one
  event: a store of more than 65,536 runs (70,000 one-block prompts: a 3.6 MB snapshot) was
  refused by the router's fixed bound (`reading.MAX_EVENTS`), counted `bad`, and the topic
  cleared, so every resync forgot every block of the pod (measured with a real store:
  `blocks` 70,000 from the live events, 0 after the first resync).
- `events.max_message_bytes` raised to 64 MiB, the subscriber's with it (as the docs say), and a
  300,000-block run of 16-token blocks (one 27 MB message): refused whole (`MAX_ITEMS`, 4 Mi
  entries), not one block learnt.
- A message that begins with AllBlocksCleared needs no recovery of the gap before it; refused
  whole, its clear was lost too, and the gap's removed blocks stayed scored.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import zmq

from kvtier.events import wire
from kvtier.events.publisher import EventPublisher, EventSettings
from kvtier.routing import PrefixIndex, Subscriber
from kvtier.routing.reading import MAX_EVENTS

BS = 4
TOPIC = "kv@pod@tiny"


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def snapshot_batch(runs: int) -> bytes:
    """What `GET /v1/blocks` sends for a topic of `runs` one-block prompts, packed as the
    sidecar packs it (`observer.snapshot`: one batch, one BlockStored a run): prompt i is the
    tokens 4i..4i+3, hash 1000 + i."""
    key = np.arange(BS * runs, dtype="<u4").tobytes()
    specs: list[wire.Spec] = [
        wire.told_stored(key, BS * 4, 1000, i, i + 1, None, BS, (0,), ["GPU"]) for i in range(runs)
    ]
    return wire.batch(time.time(), wire.Packer().pack_all(specs), None)


def prompt(i: int) -> list[int]:
    return list(range(BS * i, BS * i + BS))


class Pub:
    def __init__(self, ctx: Any) -> None:
        self.socket = ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"

    def send(self, seq: int, events: list[Any], topic: str = TOPIC) -> None:
        payload = msgpack.packb([time.time(), events, None])
        self.socket.send_multipart([topic.encode(), seq.to_bytes(8, "big"), payload])


def stored(h: int, tokens: list[int]) -> list[Any]:
    return ["BlockStored", [h], None, tokens, BS, None, "GPU", None]


def test_a_snapshot_of_more_runs_than_a_message_holds_is_taken_whole() -> None:
    runs = MAX_EVENTS + 4464  # 70,000
    payload = snapshot_batch(runs)
    index = PrefixIndex(BS)
    assert index.reset(TOPIC, payload) == runs  # was BadEvent: "70000 events, expected 65536"
    assert index.stats()["bad"] == 0 and index.pods() == {"pod": runs}
    assert index.score(prompt(0)) == index.score(prompt(runs - 1)) == {"pod": 4.0}
    index.check()


def test_a_resync_from_a_large_stores_snapshot_keeps_its_blocks(ctx: Any, closing: Any) -> None:
    """The subscriber's resync (`resync_s`) of a pod whose snapshot holds 70,000 runs: before,
    counted `bad` and the topic cleared (every score {}); now the pod's every block."""
    runs = MAX_EVENTS + 4464
    payload = snapshot_batch(runs)
    pub = Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index, resync_s=0.2))

    def blocks() -> dict[str, Any]:
        return {"block_size": BS, "topics": [{"topic": TOPIC, "seq": 1, "events": payload}]}

    sub.add(pub.endpoint, snapshot=blocks, pod="pod")
    assert wait_until(lambda: sub.stats()["resyncs"] >= 1, 20)
    assert wait_until(lambda: index.pods() == {"pod": runs}, 10), (sub.stats(), index.stats())
    assert sub.stats()["bad"] == 0 and index.stats()["bad"] == 0
    assert index.score(prompt(runs // 2)) == {"pod": 4.0}
    index.check()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_message_of_a_raised_max_message_bytes_is_applied(closing: Any) -> None:
    """64 MiB messages on both sides; one BlockStored of 300,000 16-token blocks (4.8 M token
    ids, a 27 MB message): before, refused whole (`bad` 1, no block); now every block."""
    most, bs, n = 64 << 20, 16, 300_000
    settings = EventSettings(topic=TOPIC, max_message_bytes=most)
    publisher = closing(EventPublisher("tcp://127.0.0.1:0", settings=settings))
    index = PrefixIndex(bs)
    sub = closing(Subscriber(index, max_message_bytes=most, max_replay_bytes=4 * most))
    sub.add(publisher.endpoint, pod="pod")
    for _ in range(200):  # until the PUB has the subscription
        publisher.cleared("")
        publisher.flush()
        if sub.wait(TOPIC, 1, 0.05):
            break
    tokens = (np.arange(n * bs, dtype=np.uint32) % 50_000).tolist()
    publisher.stored("", list(range(1, n + 1)), None, tokens, bs, "GPU")
    publisher.flush()
    assert sub.wait(TOPIC, publisher.next_seq(TOPIC), 60)
    assert sub.stats()["bad"] == 0 and index.stats()["bad"] == 0, index.stats()
    assert index.pods() == {"pod": n}
    assert index.score(tokens[: 3 * bs]) == {"pod": 3.0 * bs}
    index.check()


def test_a_refused_message_that_begins_with_a_clear_still_clears(ctx: Any, closing: Any) -> None:
    """After a gap, a message beginning with AllBlocksCleared is applied without recovery (it
    forgets what the gap held); one refused whole (here: a map with an int key) lost its clear
    too, and the blocks the gap removed stayed scored."""
    pub = Pub(ctx)
    index = PrefixIndex(BS)
    sub = closing(Subscriber(index))
    sub.add(pub.endpoint, pod="pod")

    def heard() -> bool:
        pub.send(0, [["AllBlocksCleared"], stored(7, [1, 2, 3, 4])])
        return bool(sub.wait(TOPIC, 1, 0.05))

    assert wait_until(heard)
    assert index.score([1, 2, 3, 4]) == {"pod": 4.0}
    # messages 1-4 lost (block 7 removed among them); 5 begins with a clear, then is no batch
    pub.send(5, [["AllBlocksCleared"], {1: 2}])
    assert sub.wait(TOPIC, 6)
    assert index.stats()["bad"] == 1
    assert index.score([1, 2, 3, 4]) == {}  # was {"pod": 4.0}: the removed block
    index.check()
    pub.send(6, [stored(8, [5, 6, 7, 8])])  # the topic goes on from there
    assert sub.wait(TOPIC, 7)
    assert index.score([5, 6, 7, 8]) == {"pod": 4.0}
    index.check()
