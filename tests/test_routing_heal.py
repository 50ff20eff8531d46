"""A router that finds an orphan resyncs from the pod's snapshot (`kvtier/routing/subscriber.py`).

A publisher that sends `AllBlocksCleared` and goes on without telling what it still holds (a
kvtier store whose event queue overflowed did, before it resynced its topics itself:
`tests/test_events_resync.py`; a clear queued by hand here) makes the router forget every block
of the topic, and on a topic that tenants share that is every tenant's. The store still holds
them, so its next blocks chain to parents the router forgot: orphans, skipped, and the pod
looked empty for those prompts for as long as it kept them. An orphan makes the subscriber take
the pod's snapshot (`GET /v1/blocks`, here the store's own `snapshot`) at once, and the router
holds what the store holds again.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import torch
import zmq
from conftest import wait_until

from kvtier import KVStore, parse_config
from kvtier.events.observer import snapshot
from kvtier.routing import PrefixIndex, Subscriber

BS = 4
TOPIC = "kv@pod-a@m"
PROMPT = list(range(100, 116))  # 4 blocks


def test_an_orphan_after_a_cleared_topic_resyncs_the_pod_from_its_snapshot() -> None:
    config = parse_config(
        {
            "model": {"name": "t", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                      "dtype": "float16"},
            "block_tokens": BS,
            "tiers": {"gpu": {"capacity": 64 * 128, "device": "cpu"}},
            "tenants": {"a": {}, "b": {}},
            "events": {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
                       "topic": TOPIC},
        }
    )  # fmt: skip
    store = KVStore(config)
    index = PrefixIndex(BS)
    subscriber = Subscriber(index)
    try:
        publisher = store.parts.events
        assert publisher is not None
        subscriber.add(publisher.endpoint, publisher.replay_endpoint,
                       lambda: snapshot(store, None), pod="pod-a")  # fmt: skip
        time.sleep(0.3)  # the subscription reaches the PUB before anything is sent

        def store_kv(tokens: list[int], tenant: str) -> None:
            kv = torch.zeros(1, 2, len(tokens), 1, 8, dtype=torch.float16)
            store.store(np.array(tokens), kv, tenant=tenant)
            publisher.flush()
            sent = publisher.next_seq(TOPIC)  # numbered from the store's start (µs)
            assert subscriber.wait(TOPIC, sent, 10), "the router did not get the events"

        store_kv(PROMPT, "b")
        store_kv(PROMPT[:8], "a")
        assert index.score(PROMPT) == {"pod-a": 16.0}
        publisher.cleared("a")  # the topic cleared, the store's blocks not told again
        store_kv([*PROMPT[:8], 7, 7, 7, 7], "a")  # chained to a's block 1, forgotten by then
        assert wait_until(lambda: subscriber.stats()["resyncs"] >= 1)
        index.check()
        assert index.stats()["orphans"] >= 1  # the clear left the new block an orphan ...
        assert index.score(PROMPT) == {"pod-a": 16.0}  # ... and the snapshot brought all back
        assert index.score([*PROMPT[:8], 7, 7, 7, 7]) == {"pod-a": 12.0}
        resyncs = subscriber.stats()["resyncs"]
        store_kv([*PROMPT[:8], 7, 7, 7, 7, 9, 9, 9, 9], "a")  # in step again: no resync
        assert subscriber.stats()["resyncs"] == resyncs
        assert index.score([*PROMPT[:8], 7, 7, 7, 7, 9, 9, 9, 9]) == {"pod-a": 16.0}
    finally:
        subscriber.close()
        store.close()


def test_a_publisher_without_a_snapshot_is_not_asked_for_one(ctx: Any) -> None:
    """Without a snapshot the orphan is counted and skipped, as before: nothing to ask."""
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(BS)
    subscriber = Subscriber(index)
    try:
        subscriber.add(f"tcp://127.0.0.1:{port}", pod="pod-a")
        orphan = ["BlockStored", [2], 1, PROMPT[4:8], BS, None, "GPU", None]
        for seq in range(100):  # until the subscription has joined
            pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"),
                                msgpack.packb([0.0, [orphan], None])])  # fmt: skip
            if subscriber.wait(TOPIC, 1, 0.05):
                break
        assert wait_until(lambda: index.stats()["orphans"] >= 1)
        assert subscriber.stats()["resyncs"] == 0 and subscriber.stats()["resync_errors"] == 0
    finally:
        subscriber.close()
        pub.close()
