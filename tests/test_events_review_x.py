"""Reviewer X's regressions in this session's event changes, pinned with real sockets:

- a subscriber to a topic of about 1,000 bytes or more (a long `model.name` in the default
  topic, a 64-character tenant on it) got nothing: the PUB's frame bound took a subscription's
  header as ZMTP 3.0's one byte, and libzmq 4.3 sends ZMTP 3.1's `SUBSCRIBE` command (10);
- a client that asks the replay endpoint the same thing twice in one turn is answered twice:
  only a flooding connection's repeats (past its first 16 requests in a turn) are answered once;
- a tagged map read one way by `starts_cleared` and another by the index; one of 33 fields
  made its whole batch unreadable.
"""

from __future__ import annotations

import time

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from kvtier.events.publisher import EventPublisher, EventSettings
from kvtier.events.replay import END_SEQ
from kvtier.routing import PrefixIndex
from kvtier.routing.reading import starts_cleared


@pytest.mark.parametrize("per_tenant", [False, True])
def test_a_subscriber_to_a_long_topic_gets_its_messages(per_tenant: bool) -> None:
    topic, tenant = "kv@host@" + "m" * 1500, "t" * 64
    settings = EventSettings(topic, per_tenant=per_tenant, flush_s=0.001)
    pub = EventPublisher("tcp://127.0.0.1:*", settings=settings)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        full = topic + (f"@{tenant}" if per_tenant else "")
        sub.setsockopt(zmq.SUBSCRIBE, full.encode())
        sub.connect(pub.endpoint)
        time.sleep(0.4)
        pub.stored(tenant, [1], None, [1, 2, 3, 4], 4, "GPU")
        pub.flush()
        assert sub.poll(3000), "a subscriber to the whole topic got nothing"
        assert sub.recv_multipart()[0] == full.encode()
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_a_request_asked_twice_in_a_turn_is_answered_twice() -> None:
    settings = EventSettings("kv@pod@m", flush_s=0.001)
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", settings=settings)
    ctx = zmq.Context()
    try:
        for first in range(0, 12, 4):
            pub.stored("", [first + 1], None, list(range(first, first + 4)), 4, "GPU")
            pub.flush()
        dealer = ctx.socket(zmq.DEALER)
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        time.sleep(0.3)
        asks = [0, 2, 0, 0]
        for start in asks:  # sent back to back: one turn takes them all
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
        ends = 0
        while ends < len(asks) and dealer.poll(3000):
            ends += dealer.recv_multipart()[2] == END_SEQ
        assert ends == len(asks)
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_a_tagged_map_with_two_types_is_read_as_its_decode_reads_it() -> None:
    """`starts_cleared` took a map's first "type", the index its last (a dict's): a map that
    said both AllBlocksCleared and BlockRemoved let a gap before it pass unrecovered."""
    both = {"type": "AllBlocksCleared", "medium": "GPU"}
    packer = msgpack.Packer()
    head = b"\x83" + packer.pack("type") + packer.pack("AllBlocksCleared")
    head += packer.pack("medium") + packer.pack("GPU")
    twice = head + packer.pack("type") + packer.pack("BlockRemoved")
    payload = b"\x93" + packer.pack(1.0) + b"\x91" + twice + packer.pack(None)
    assert starts_cleared(payload) is False
    assert starts_cleared(msgpack.packb([1.0, [both], None])) is True


def test_a_tagged_map_of_40_fields_is_read() -> None:
    """Extra fields are ignored, up to 64 a map (a later vLLM's BlockStored may add some)."""
    event = {
        "type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
        "token_ids": [0, 1, 2, 3], "block_size": 4, "lora_id": None, "medium": "GPU",
        "lora_name": None, **{f"later_{i}": i for i in range(32)},
    }  # fmt: skip
    index = PrefixIndex(4)
    assert index.apply("kv@vllm@m", msgpack.packb([1.0, [event], None])) == 1
    assert index.score([0, 1, 2, 3]) == {"vllm": 4.0}
