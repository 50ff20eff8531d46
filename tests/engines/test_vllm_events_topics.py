"""The vLLM connector's relay of kvtier's events takes `kvtier.events_topic` and the topics
under it (`<topic>@<tenant>`), never a topic that merely starts with the same characters: a
tenant `alice.b` (or `alice2`) on a sidecar shared with `alice` has a topic that starts with
alice's, and the relay handed its blocks (token ids and hashes) to alice's vLLM, which then
told a router they were alice's pod's (`vllm_events.relayed`). Over real ZMQ, from a raw PUB.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_events_topics.py
"""

from __future__ import annotations

import time

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

from kvtier.integrations.vllm_events import Relay
from kvtier.routing import Subscriber

BASE = "kv@p@m"
TOPICS = [BASE, f"{BASE}@alice", f"{BASE}@alice.b", f"{BASE}@alice2", f"{BASE}x"]


def stored(first: int) -> bytes:
    event = ["BlockStored", [first], None, list(range(first, first + 4)), 4, None, "CPU", None]
    return bytes(msgpack.packb([0.0, [event], None]))


@pytest.mark.parametrize(
    ("topic", "wanted"),
    [
        (f"{BASE}@alice", {f"{BASE}@alice"}),
        (BASE, {BASE, f"{BASE}@alice", f"{BASE}@alice.b", f"{BASE}@alice2"}),
        ("", set(TOPICS)),
    ],
)
def test_the_relay_takes_its_topic_and_those_under_it_only(topic: str, wanted: set[str]) -> None:
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    relay = Relay(4, topic)
    sub = Subscriber(relay, resync_s=None)
    sub.add(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # the subscription reaches the PUB
    try:
        for i, source in enumerate(TOPICS):
            pub.send_multipart([source.encode(), (0).to_bytes(8, "big"), stored(100 * (i + 1))])
        for source in TOPICS:
            assert sub.wait(source, 1)
        taken = relay.take()
        got = {TOPICS[e.block_hashes[0] // 100 - 1] for e in taken}
        assert got == wanted, got
        relay.check()
    finally:
        sub.close()
        pub.close()
