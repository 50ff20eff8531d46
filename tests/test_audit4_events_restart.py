"""A subscriber connected to a store's KV-event endpoint across the store's restart ends with
exactly the new life's residency, per topic and medium, decoding only the wire as llm-d does
(field positions, events in order, AllBlocksCleared honoured, no replay).

A PUB sends a subscriber nothing before it (re)connects, so the new life's first words (their
AllBlocksCleared) are lost to one that was connected before the restart: the retell a join
brings (`EventPublisher._retell`) starts with AllBlocksCleared on every topic. Pinned here:
- a store closed and started again on its state and endpoint (disk recovery): the old life's
  hashes are forgotten, the recovered blocks known; `kvtier.routing` connected as well ends
  right; a peer in sync when another joins forgets and relearns the same, numbers unbroken;
- per-tenant topics and a restart that recovers nothing: each tenant's topic is cleared, even
  one whose tenant holds nothing in the new life;
- a real `kvtier serve` SIGKILLed and started again on the same config and port (slow suite):
  the decoder equals the new process's `GET /v1/blocks`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import yaml
import zmq
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, kv_for, tiny_block_bytes, wait_until
from service_server import ADMIN_KEY, free_port, kv_of, start, tokens_of, write_config

from kvtier import KVStore, parse_config
from kvtier.client import Client
from kvtier.routing import PrefixIndex, Subscriber

MEDIA = {"gpu": "GPU", "host": "CPU", "disk": "DISK"}
TOPIC = "kv@pod@tiny"
View = dict[str, dict[int, set[str]]]  # topic -> block hash -> media


def make(tmp_path: Path, port: int, per_tenant: bool = False, disk: bool = True) -> KVStore:
    block = tiny_block_bytes()
    tiers: dict[str, Any] = {
        "gpu": {"capacity": 4 * block, "device": "cpu"},
        "host": {"capacity": 8 * block, "pinned": False},
    }
    if disk:
        tiers["disk"] = {"capacity": 64 * block, "path": str(tmp_path / "disk")}
    return KVStore(
        parse_config(
            {
                "model": {**TINY_MODEL, "dtype": "float32"},
                "block_tokens": TINY_BLOCK_TOKENS,
                "tiers": tiers,
                "mover": {"background": False},
                "tenants": {"alice": {}, "bob": {}},
                "events": {
                    "endpoint": f"tcp://127.0.0.1:{port}",
                    "replay_endpoint": "tcp://127.0.0.1:0",
                    "topic": TOPIC,
                    "per_tenant_topic": per_tenant,
                },
            }
        )
    )


class Told:
    """What event batches tell, read as llm-d's consumer reads them, from the fields'
    positions: per topic, each hash's media; events applied in order; AllBlocksCleared forgets
    that topic's blocks; a removal of a hash not held changes nothing."""

    def __init__(self) -> None:
        self.topics: View = {}

    def apply(self, topic: str, payload: bytes) -> None:
        _ts, events, _rank = msgpack.unpackb(payload)
        held = self.topics.setdefault(topic, {})
        for event in events:
            if event[0] == "BlockStored":  # hashes, parent, tokens, block size, lora, medium
                for h in event[1]:
                    held.setdefault(h, set()).add(event[6])
            elif event[0] == "BlockRemoved":  # hashes, medium
                for h in event[1]:
                    held.get(h, set()).discard(event[2])
                    if h in held and not held[h]:
                        del held[h]
            elif event[0] == "AllBlocksCleared":
                held.clear()

    def view(self) -> View:
        return {topic: held for topic, held in self.topics.items() if held}


class Decoder(Told):
    """A SUB connected to `endpoint`, whose messages it applies (`Told`); it never asks for a
    replay."""

    def __init__(self, ctx: Any, endpoint: str) -> None:
        super().__init__()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVTIMEO, 100)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self.sub.connect(endpoint)
        self.seqs: dict[str, list[int]] = {}

    def drain(self) -> None:
        while True:
            try:
                topic, seq, payload = self.sub.recv_multipart()
            except zmq.Again:
                return
            self.seqs.setdefault(topic.decode(), []).append(int.from_bytes(seq, "big"))
            self.apply(topic.decode(), payload)

    def settles_on(self, expected: Callable[[], View], timeout: float = 4.0) -> bool:
        """Whether the view comes to equal `expected()` within `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.drain()
            if self.view() == expected():
                return True
        return False


def residency(store: KVStore) -> View:
    """Per topic, block hash (`node.ev` + i) -> media, read from the index itself."""
    publisher = store.parts.events
    assert publisher is not None
    out: View = {}
    for root in store.index.roots():
        tenant = store.namespaces.tenant_of(root.ids)
        assert tenant is not None
        stack = list(root.children.values()) if root.children else []
        while stack:
            node = stack.pop()
            for i in range(node.size):
                media = {
                    MEDIA[t] for n, t in enumerate(store.tier_names) if node.slots[n][i] is not None
                }
                if media:
                    out.setdefault(publisher.topic_of(tenant), {})[node.ev + i] = media
            stack.extend(node.children.values() if node.children else ())
    return out


def prompt(n: int) -> list[int]:
    return list(range(100 * n, 100 * n + 12))


def test_a_subscriber_connected_across_a_restart_forgets_the_past_life(
    tmp_path: Path, ctx: Any
) -> None:
    """Before, the new life's AllBlocksCleared went out before the SUB had reconnected, and the
    retell it then heard cleared nothing: 8 hashes of the past life kept CPU/DISK copies."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    store = make(tmp_path, port)
    decoder = Decoder(ctx, endpoint)
    router = PrefixIndex(TINY_BLOCK_TOKENS)
    sub = Subscriber(router)
    with contextlib.closing(sub):
        sub.add(endpoint, pod="pod")
        time.sleep(0.3)  # both subscriptions reach the PUB
        for n in range(3):  # past 4 gpu and 8 host slots: demotions
            store.store(prompt(n), kv_for(store, 12, seed=n), tenant="bob")
        assert store.persist() > 0
        store.store(prompt(7), kv_for(store, 12, seed=7), tenant="alice")  # never on disk
        assert decoder.settles_on(lambda: residency(store))
        before = residency(store)
        store.close()

        store = make(tmp_path, port)  # recovers the disk tier, then turns events on
        now = residency(store)
        assert now and all(media == {"DISK"} for held in now.values() for media in held.values())
        assert not set(now[TOPIC]) & set(before[TOPIC])  # new hashes: old ones would be stale
        assert decoder.settles_on(lambda: residency(store)), (decoder.view(), residency(store))
        recovered = sum(len(held) for held in now.values())  # kvtier.routing ends right too
        assert wait_until(lambda: router.stats()["blocks"] == recovered, 4), router.stats()
        assert router.score(prompt(7)) == {} and router.score(prompt(0))

        # a peer joins: the one in sync is told to forget and hears every block again
        heard = len(decoder.seqs[TOPIC])
        late = Decoder(ctx, endpoint)
        assert late.settles_on(lambda: residency(store))
        assert decoder.settles_on(lambda: residency(store))
        life = decoder.seqs[TOPIC][heard - 1 :]
        assert len(life) > 1 and life == list(range(life[0], life[0] + len(life)))  # no gap
        store.store(prompt(8), kv_for(store, 12, seed=8), tenant="alice")
        assert decoder.settles_on(lambda: residency(store))
        assert wait_until(lambda: router.stats()["blocks"] == recovered + 3, 4), router.stats()
        assert router.score(prompt(8)) == {"pod": 12.0}  # its 3 blocks, on GPU
        router.check()
    store.check()
    store.close()


def test_each_tenants_topic_is_cleared_when_the_new_life_holds_nothing(
    tmp_path: Path, ctx: Any
) -> None:
    """Per-tenant topics and no disk tier: the restarted store holds nothing and sends nothing
    of its own. Before, a subscriber connected throughout kept both tenants' old blocks."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    store = make(tmp_path, port, per_tenant=True, disk=False)
    decoder = Decoder(ctx, endpoint)
    time.sleep(0.3)
    store.store(prompt(0), kv_for(store, 12, seed=0), tenant="alice")
    store.store(prompt(1), kv_for(store, 12, seed=1), tenant="bob")
    assert decoder.settles_on(lambda: residency(store))
    assert set(decoder.view()) == {f"{TOPIC}@alice", f"{TOPIC}@bob"}
    store.close()

    store = make(tmp_path, port, per_tenant=True, disk=False)
    assert residency(store) == {}
    assert decoder.settles_on(lambda: {}), decoder.view()
    store.store(prompt(2), kv_for(store, 12, seed=2), tenant="bob")  # bob's topic only
    assert decoder.settles_on(lambda: residency(store))
    assert set(decoder.view()) == {f"{TOPIC}@bob"}
    store.close()


def _snapshot_view(url: str) -> View:
    """The store's residency per topic, from its `GET /v1/blocks`, decoded by positions."""
    reader = Told()
    with Client(url, api_key=ADMIN_KEY, shared_memory=False) as client:
        for entry in client.blocks()["topics"]:
            reader.apply(entry["topic"], entry["events"])
    return reader.view()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_sigkilled_server_started_again_leaves_no_stale_block(tmp_path: Path, ctx: Any) -> None:
    """A `kvtier serve` with a disk tier, SIGKILLed and started again on its port and state:
    a subscriber connected throughout ends with the new process's snapshot exactly."""
    events, port = free_port(), free_port()
    config = write_config(tmp_path, gpu_blocks=4, host_blocks=8, disk="1MiB")
    document = yaml.safe_load(config.read_text())
    document["events"] = {"endpoint": f"tcp://127.0.0.1:{events}", "topic": TOPIC}
    config.write_text(yaml.safe_dump(document))
    decoder = Decoder(ctx, f"tcp://127.0.0.1:{events}")
    first = start(config, port=port)
    try:
        with Client(first.url, api_key=ADMIN_KEY, shared_memory=False) as client:
            for n in range(4):
                client.store(tokens_of(1000 * n, 16), kv_of(16, seed=n))
        assert decoder.settles_on(lambda: _snapshot_view(first.url), 8)
        assert decoder.view()
    finally:
        first.process.kill()
        first.process.wait()
    second = start(config, port=port)
    try:
        assert decoder.settles_on(lambda: _snapshot_view(second.url), 8), decoder.view()
    finally:
        assert second.stop() == 0
