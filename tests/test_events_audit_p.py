"""Audit P's findings on KV events and routing, each pinned with real components:

- a peer of the event PUB that sends a frame longer than any subscription of use (a topic the
  publisher can send, and its 1-byte header) is dropped (`MAXMSGSIZE`): ZMQ took a 64 MiB
  subscription whole and kept thousands of distinct 2 KB ones (GiBs); a subscriber to the
  longest topic of use still gets its messages;
- the router's index reads vLLM 0.33's events, tagged maps (`{"type": "BlockStored", ...}`),
  as well as positional arrays: it counted every vLLM 0.33 event bad;
- a topic is unambiguous: `events.topic` with a fourth field (`kv@pod@tiny@v2`, which a router
  read as the tenant), a per-tenant topic without three fields, and a model name with '@' under
  the default topic are `ConfigError`s naming the field;
- the routing API's arguments: a NaN, negative or non-number weight or slack, a `lora_name` or
  `tenant` that is no string, `tokens=None`, are kvtier's typed errors at construction or call
  (a NaN weight scored a pod holding the whole prompt 0, and the router chose an empty pod);
- after a flood of replay requests from 50 connections that never read, a router that asks
  again is answered within 1 s: every queued request was opened in turn, a few hundred a
  turn, and a legitimate one waited 10 s behind them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, tiny_block_bytes
from zmq.utils.monitor import recv_monitor_message

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError, InvalidArgumentError, InvalidTokensError
from kvtier.events.publisher import EventPublisher, EventSettings
from kvtier.events.replay import END_SEQ
from kvtier.routing import PrefixIndex, Router
from kvtier.routing.reading import starts_cleared


def batch(events: list[Any]) -> bytes:
    return bytes(msgpack.packb([time.time(), events, None]))


def disconnected(monitor: zmq.Socket[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if monitor.poll(50) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def test_a_peer_sending_a_frame_past_the_longest_subscription_is_dropped() -> None:
    settings = EventSettings("kv@pod@m", per_tenant=True, flush_s=0.001)
    pub = EventPublisher("tcp://127.0.0.1:*", settings=settings)
    ctx = zmq.Context()
    try:
        good = ctx.socket(zmq.SUB)
        good.setsockopt(zmq.ROUTING_ID, b"r" * 255)  # the longest: the handshake still fits
        tenant = "t" * 64  # the longest tenant id the config takes
        good.setsockopt(zmq.SUBSCRIBE, f"kv@pod@m@{tenant}".encode())
        good.connect(pub.endpoint)
        hostile = ctx.socket(zmq.XSUB)
        monitor = hostile.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        hostile.connect(pub.endpoint)
        time.sleep(0.3)
        hostile.send(b"\x01" + b"k" * (1 << 16))  # one 64 KiB subscription frame
        assert disconnected(monitor, 3.0), "the PUB kept a peer that sent a 64 KiB frame"
        pub.stored(tenant, [1], None, [1, 2, 3, 4], 4, "GPU")
        pub.flush()
        assert good.poll(3000), "a subscriber to the longest topic of use got nothing"
        assert good.recv_multipart()[0] == f"kv@pod@m@{tenant}".encode()
        hostile.disable_monitor()
        monitor.close(linger=0)
    finally:
        ctx.destroy(linger=0)
        pub.close()


def stored_map(hashes: list[int], parent: int | None, first: int, **extra: Any) -> dict[str, Any]:
    """A BlockStored as vLLM 0.33 sends it (msgspec `tag=True`), fields past ours included."""
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": list(range(first, first + 4 * len(hashes))), "block_size": 4,
        "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
        "extra_keys": [None] * len(hashes), "session_id": "s", **extra,
    }  # fmt: skip


def test_the_router_reads_vllm_tagged_map_events_and_positional_arrays() -> None:
    index = PrefixIndex(4)
    assert index.apply("kv@vllm@m", batch([stored_map([11, 12], None, 0)])) == 1
    assert index.apply("kv@vllm@m", batch([stored_map([13], 12, 8)])) == 1
    positional = ["BlockStored", [1, 2, 3], None, list(range(12)), 4, None, "CPU", None]
    assert index.apply("kv@kvtier@m", batch([positional])) == 1
    assert index.score(list(range(12))) == {"vllm": 12.0, "kvtier": 12 * 0.99}
    removed = {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU", "group_idx": 0}
    assert index.apply("kv@vllm@m", batch([removed])) == 1
    assert index.score(list(range(12)))["vllm"] == 8.0
    cleared = batch([{"type": "AllBlocksCleared"}])
    assert starts_cleared(cleared)
    assert index.apply("kv@vllm@m", cleared) == 1
    assert "vllm" not in index.score(list(range(12)))
    bad = [stored_map([21], None, 40, block_size="4"), {"type": "Nope"}, {"block_hashes": [1]}]
    assert index.apply("kv@vllm@m", batch(bad)) == 0
    assert index.stats()["bad"] == 3 and index.stats()["events"] == 5
    index.check()


@pytest.mark.parametrize(
    ("events", "field"),
    [
        ({"topic": "kv@pod@tiny@v2", "per_tenant_topic": True}, "events.topic"),
        ({"topic": "kv@pod@tiny@v2"}, "events.topic"),
        ({"topic": "kv@@tiny"}, "events.topic"),
        ({"topic": "kvtier", "per_tenant_topic": True}, "events.topic"),
    ],
)
def test_a_topic_with_a_field_a_router_would_misread_is_refused(
    events: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"events": {"endpoint": "tcp://127.0.0.1:0", **events}})
    assert info.value.field == field and "'@'" in info.value.expected


def test_a_model_name_with_an_at_sign_under_the_default_topic_is_refused(tmp_path: Path) -> None:
    block = tiny_block_bytes()
    config = {
        "model": {**TINY_MODEL, "name": "tiny@v2", "dtype": "float32"},
        "block_tokens": TINY_BLOCK_TOKENS,
        "tiers": {"gpu": {"capacity": 4 * block, "device": "cpu"}},
        "events": {"endpoint": "tcp://127.0.0.1:0", "per_tenant_topic": True},
    }
    with pytest.raises(ConfigError) as info:
        KVStore(parse_config(config))
    assert info.value.field == "model.name" and info.value.value == "tiny@v2"
    assert parse_config({"events": {"endpoint": "tcp://h:1", "topic": "kv@pod@m"}}).events


@pytest.mark.parametrize(
    "make",
    [
        lambda: PrefixIndex(4, weights={"GPU": math.nan}),
        lambda: PrefixIndex(4, weights={"GPU": -1.0}),
        lambda: PrefixIndex(4, weights={"GPU": "x"}),  # type: ignore[dict-item]
        lambda: PrefixIndex(4, weights={"GPU": math.inf}),
        lambda: Router(["a", "b"], "prefix-load", PrefixIndex(4), slack=math.nan),
        lambda: Router(["a", "b"], "prefix-load", PrefixIndex(4), slack="x"),  # type: ignore[arg-type]
        lambda: PrefixIndex(4).score(list(range(8)), lora_name=5),  # type: ignore[arg-type]
        lambda: PrefixIndex(4).score(list(range(8)), tenant=5),  # type: ignore[arg-type]
    ],
)
def test_a_bad_routing_argument_is_refused_naming_it(make: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"(weights\['GPU'\]|slack|lora_name|tenant)"):
        make()


def test_scoring_none_is_an_invalid_tokens_error() -> None:
    with pytest.raises(InvalidTokensError, match="NoneType"):
        PrefixIndex(4).score(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokensError):
        Router(["a"], "prefix", PrefixIndex(4)).choose(None)  # type: ignore[arg-type]


def test_a_replay_is_answered_soon_after_a_flood_of_requests() -> None:
    settings = EventSettings("kv@pod@m", flush_s=0.001)
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", settings=settings)
    assert pub.replay_endpoint is not None
    ctx = zmq.Context()
    try:
        for first in range(0, 40, 4):
            pub.stored("", [first + 1], None, list(range(first, first + 4)), 4, "GPU")
            pub.flush()
        flooders = [ctx.socket(zmq.DEALER) for _ in range(50)]
        for flooder in flooders:
            flooder.connect(pub.replay_endpoint)
        time.sleep(0.2)
        sent, deadline = 0, time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for flooder in flooders:
                try:
                    for _ in range(100):
                        flooder.send_multipart([b"", bytes(8)], zmq.NOBLOCK)
                        sent += 1
                except zmq.Again:
                    pass
        assert sent > 20_000
        start, got = time.monotonic(), list[list[bytes]]()
        while time.monotonic() - start < 3.0 and not (got and got[-1][2] == END_SEQ):  # was 10-14 s
            legit = ctx.socket(zmq.DEALER)  # a router asks again, as a subscriber does
            legit.connect(pub.replay_endpoint)
            legit.send_multipart([b"", bytes(8)])
            got = list[list[bytes]]()
            while legit.poll(200):
                got.append(legit.recv_multipart())
                if got[-1][2] == END_SEQ:
                    break
            legit.close(linger=0)
        assert got and got[-1][2] == END_SEQ, f"no answer in 3 s after {sent} requests"
        assert len(got) == 1 + pub.sent()
    finally:
        ctx.destroy(linger=0)
        pub.close()
