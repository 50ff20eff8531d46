"""One topic, the same tokens under several hashes: the tenants of a kvtier store that share its
topic (`events.per_tenant_topic` off, the default), or vLLM's requests of two cache salts.

Each tenant's namespace numbers its own blocks, so two tenants that cache the same system prompt
tell a router of the same tokens under two hashes, both live. The router keeps both
(`kvtier/routing/index.py`, "One key, several hashes"): a tenant's next block, chained to its
own hash, is no orphan, and the tokens stay held while either tenant holds them. Keeping only
the hash told last lost the other tenant's: its next blocks were skipped as orphans.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import zmq
from test_routing import BS, batch, removed, stored

from kvtier import KVStore, parse_config
from kvtier.routing import PrefixIndex
from kvtier.routing.index import MAX_HASHES

TOPIC = "kv@pod-a@m"
PROMPT = list(range(100, 116))  # 4 blocks


def test_two_hashes_of_the_same_tokens_both_chain_and_both_hold() -> None:
    index = PrefixIndex(BS)
    index.apply(TOPIC, batch(stored([1, 2], None, PROMPT[:8])))  # tenant a, on gpu
    index.apply(TOPIC, batch(stored([11, 12], None, PROMPT[:8], "DISK")))  # tenant b, same tokens
    index.apply(TOPIC, batch(stored([3], 2, PROMPT[8:12])))  # a's next block, chained to its own
    index.check()
    assert index.stats()["orphans"] == 0
    assert index.score(PROMPT) == {"pod-a": 12.0}  # blocks 0-1 at gpu's weight, block 2 too
    index.apply(TOPIC, batch(removed([1, 2])))  # a's copies of blocks 0-1 go: b's stay on disk
    index.check()
    assert index.score(PROMPT) == {"pod-a": 4 * 0.98 * 2 + 4 * 1.0}
    index.apply(TOPIC, batch(removed([11], "DISK")))  # block 0 held by no hash now
    index.check()
    assert index.score(PROMPT) == {}
    assert index.pods() == {"pod-a": 2}  # b's block 1 and a's block 2, past the hole


def test_two_tenants_of_a_real_store_on_one_topic_tell_a_router_no_orphan() -> None:
    """Two tenants store the same prompt, then each its own continuation, chained to its own
    copy of the prompt; the store's events, sent over ZMQ and applied as they come, hold every
    block of both."""
    config = parse_config(
        {
            "model": {
                "name": "t",
                "num_layers": 1,
                "num_kv_heads": 1,
                "head_dim": 8,
                "dtype": "float16",
            },
            "block_tokens": BS,
            "tiers": {"gpu": {"capacity": 64 * 128, "device": "cpu"}},
            "tenants": {"a": {}, "b": {}},
            "events": {"endpoint": "tcp://127.0.0.1:0", "topic": TOPIC},
        }
    )
    ctx: Any = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 2000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    store = KVStore(config)
    try:
        publisher = store.parts.events
        assert publisher is not None
        sent = publisher.sent(TOPIC)  # the join's retell (an AllBlocksCleared) is read too
        sub.connect(publisher.endpoint)
        time.sleep(0.3)  # the subscription reaches the PUB before anything is sent
        index = PrefixIndex(BS)
        steps = [("a", []), ("b", []), ("a", [7, 7, 7, 7]), ("b", [8, 8, 8, 8])]
        for tenant, tail in steps:
            tokens = np.array(PROMPT + tail)
            store.store(tokens, torch.zeros(1, 2, len(tokens), 1, 8, dtype=torch.float16),
                        tenant=tenant)  # fmt: skip
        publisher.flush()
        for _ in range(publisher.sent(TOPIC) - sent):
            topic, _number, payload = sub.recv_multipart()
            index.apply(topic.decode(), payload)
        index.check()
        assert index.stats()["orphans"] == 0 and index.stats()["bad"] == 0
        for tail in ([7, 7, 7, 7], [8, 8, 8, 8]):
            assert index.score(PROMPT + tail) == {"pod-a": 20.0}  # all 5 blocks of each
    finally:
        store.close()
        sub.close()
        ctx.destroy(linger=0)


def test_a_key_keeps_its_last_hashes_only() -> None:
    """A publisher that tells of one block under ever new hashes (a hostile one, or a cache
    salt per request) costs bounded work an event: the key keeps its last `MAX_HASHES`."""
    index = PrefixIndex(BS)
    for h in range(1, MAX_HASHES + 51):
        index.apply(TOPIC, batch(stored([h], None, PROMPT[:4])))
    index.check()
    assert index.pods() == {"pod-a": 1} and index.score(PROMPT) == {"pod-a": 4.0}
    index.apply(TOPIC, batch(removed(list(range(51, MAX_HASHES + 51)))))  # the kept ones
    index.check()
    assert index.score(PROMPT) == {}  # the 50 oldest went when the key passed its bound
    index.apply(TOPIC, batch(stored([7], 50, PROMPT[4:8])))  # chained to a hash dropped
    assert index.stats()["orphans"] == 1
